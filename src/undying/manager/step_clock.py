"""How long the job's steps take, from the ranks' commits.

Two measures, for two readers: the time of each rank between two of its
consecutive commits (the grace period of a dying gasp must cover two of the
slowest; the trace switch is set far enough ahead in steps), and the time of
each step of the whole job, from the commit of its last rank to that of the
next step's last rank (the status page's step-time chart).
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["StepClock"]


class StepClock:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._rank_step_s: deque[float] = deque(maxlen=50)
        self._last_commit: dict[int, tuple[int, float]] = {}
        self._commits: dict[int, dict[int, float]] = {}  # step -> rank -> commit time
        self._done: dict[int, float] = {}  # step -> when its last rank committed it
        self.step_times: deque[tuple[int, float]] = deque(maxlen=200)

    def reset(self, world_size: int) -> None:
        """A new layout: steps in flight are of the old one (the step times seen so far stay)."""
        self.world_size = world_size
        self._commits.clear()
        self._last_commit.clear()

    def longest_rank_step_s(self) -> float:
        return max(self._rank_step_s, default=0.0)

    def median_rank_step_s(self) -> float:
        return statistics.median(self._rank_step_s) if self._rank_step_s else 0.0

    def committed(self, rank: int, step: int, t: float) -> None:
        previous = self._last_commit.get(rank)
        if previous is not None and previous[0] == step - 1:
            self._rank_step_s.append(t - previous[1])
        self._last_commit[rank] = (step, t)
        self._note_job_step(rank, step, t)

    def _note_job_step(self, rank: int, step: int, t: float) -> None:
        """A step is done when every rank committed it; its time is from the previous step's done."""
        commits = self._commits.setdefault(step, {})
        commits[rank] = t
        if len(commits) < self.world_size:
            return
        done = max(commits.values())
        del self._commits[step]
        previous = self._done.get(step - 1)
        self._done[step] = done
        if previous is not None and done > previous:
            self.step_times.append((step, round(done - previous, 6)))
        for old in [s for s in self._done if s < step - 2]:
            del self._done[old]
        for old in [s for s in self._commits if s < step - 100]:
            del self._commits[old]
