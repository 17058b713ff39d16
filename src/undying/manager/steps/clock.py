"""How long the job's steps take, from the ranks' commits.

Two measures, for two readers: the time of each rank between two of its
consecutive commits (the grace period of a dying gasp must cover two of the
slowest; the trace switch is set far enough ahead in steps), and the time of
each step of the whole job, from the commit of its last rank to that of the
next step's last rank (the status page's step-time chart).

It also keeps what progress and goodput are computed from (``jobfiles.progress``,
``jobfiles.goodput``): the job's completed steps in order (``ledger``), the recent ones
and the last values given to ``step.log`` (``job_steps``), rank 0's plan of
steps and epochs (``plan``), and the checkpoint stalls (``stalls``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from undying.jobfiles.goodput import Stall, StepLedger
from undying.jobfiles.progress import PLAN_EVENT, JobSteps, Plan

__all__ = ["StepClock"]

# Checkpoint stalls kept one by one (for goodput to place each); older ones are kept as their sum.
KEPT_STALLS = 64


class StepClock:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._rank_step_s: deque[float] = deque(maxlen=50)
        self._last_commit: dict[int, tuple[int, float]] = {}
        self._done: dict[int, float] = {}  # step -> when its last rank committed it
        self.step_times: deque[tuple[int, float]] = deque(maxlen=200)
        self.job_steps = JobSteps(world_size)
        self.ledger = StepLedger()
        # the recent saves' stalls; older ones summed in folded_stall_s
        self.stalls: deque[Stall] = deque()
        self.folded_stall_s = 0.0
        self.plan: Plan | None = None
        # told rank 0's plan when it comes (a drill armed before it is checked against it then)
        self.plan_told: list[Callable[[Plan], None]] = []

    def reset(self, world_size: int) -> None:
        """A new layout: steps in flight are of the old one (the step times seen so far stay)."""
        self.world_size = world_size
        self._last_commit.clear()
        self.job_steps.reset(world_size)

    def reported(self, phase: str, detail: Mapping[str, Any]) -> None:
        """A rank's progress report: rank 0's plan of steps is kept
        (others are no concern of the clock)."""
        if phase == PLAN_EVENT:
            plan = Plan.from_detail(detail)
            if plan is not None:  # (a damaged one leaves the last)
                self.plan = plan
                for told in self.plan_told:
                    told(plan)

    def saved(self, step: int, t: float, blocking_s: float) -> None:
        """A checkpoint of ``step`` was saved; the loop stalled ``blocking_s`` for its copy."""
        if blocking_s > 0:
            self.stalls.append(Stall(step, t, blocking_s))
        if len(self.stalls) > KEPT_STALLS:  # (a status poll must not grow with the job's length)
            self.folded_stall_s += self.stalls.popleft().seconds

    def replay(self, commits: Iterable[tuple[int, int, float]],
               reports: Iterable[tuple[str, float, Mapping[str, Any]]]) -> None:
        """A restarted manager's clock, fed again what the log kept: the commits (without their
        values), the plan and the saves' stalls, so progress and goodput go on from where they
        were."""
        for rank, step, t in commits:
            self.committed(rank, step, t)
        for kind, t, data in reports:
            if kind == PLAN_EVENT:
                self.reported(kind, data)
            elif kind == "checkpoint_saved":
                self.saved(int(data.get("step", 0)), t, float(data.get("blocking_s") or 0.0))

    def longest_rank_step_s(self) -> float:
        return max(self._rank_step_s, default=0.0)

    def median_rank_step_s(self) -> float:
        return statistics.median(self._rank_step_s) if self._rank_step_s else 0.0

    def committed(self, rank: int, step: int, t: float, metrics: Mapping[str, float] | None = None
                  ) -> tuple[float, dict[str, float]] | None:
        """A rank's commit; when it completes the step (every rank committed it): when, and the
        step's values (their mean over the ranks)."""
        previous = self._last_commit.get(rank)
        if previous is not None and previous[0] == step - 1:
            self._rank_step_s.append(t - previous[1])
        self._last_commit[rank] = (step, t)
        done = self.job_steps.commit(rank, step, t, metrics)
        if done is not None:
            self.ledger.done(step, done[0])
            self._note_job_step(step, done[0])
        return done

    def _note_job_step(self, step: int, done: float) -> None:
        """Every rank committed ``step`` at ``done``: its time is from the previous step's done."""
        previous = self._done.get(step - 1)
        self._done[step] = done
        if previous is not None and done > previous:
            self.step_times.append((step, round(done - previous, 6)))
        for old in [s for s in self._done if s < step - 2]:
            del self._done[old]
