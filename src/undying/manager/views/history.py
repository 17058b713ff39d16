"""What the whole run did, in bounded memory: the page's charts and the metrics' histograms.

The status is the present (the ranks as they are, the last 200 step times);
the page wants the whole run and Prometheus wants histograms that only grow.
Both come from what the manager receives anyway (each rank's commit with the
values it gave ``step.log``, each checkpoint save), fed here once each.

Bounded however long the job runs. A ``Downsampled`` series holds the whole
run in at most ``capacity`` buckets: when a step falls past the last bucket,
neighbours merge pairwise and each bucket covers twice as many steps. Each
bucket keeps count, sum, min and max, so a spike (a recovery, a checkpoint
stall) survives as its bucket's max instead of being averaged away, and a run
shorter than ``capacity`` steps is kept step by step. Per-rank series are kept
for the first ``PAGE_RANKS`` ranks (more lines than that are no picture), and
the per-rank histogram labels the first ``LABELLED_RANKS`` ranks one by one and
the rest together (see ``RankStepLabel``).

A restarted manager reads the run back from the event log (``replay``), so the
page and the histograms go on from where the old manager was.
"""

from __future__ import annotations

import bisect
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undying.jobfiles.events import LogReader
from undying.protocol.worker_wire import CheckpointSaved

__all__ = ["RunHistory", "Downsampled", "Histogram", "STEP_BUCKETS", "SAVE_BUCKETS",
           "LABELLED_RANKS"]

log = logging.getLogger("undying.manager")

# A step takes milliseconds (a small model on CPU) to minutes (a large one, a recovery inside it).
STEP_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                   30.0, 60.0, 300.0)
# A save's stall is a CPU copy (milliseconds); its write, up to minutes for a large state.
SAVE_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0,
                                   300.0, 600.0)
# Ranks with a label of their own in undying_rank_step_seconds: a histogram is ~17 series a label
# value, so 16 ranks are ~280 series, an ordinary exporter's size; the ranks past them share one
# label value.
LABELLED_RANKS = 16
# Ranks with a line of their own on the page (the job's line covers every rank).
PAGE_RANKS = 32
# Buckets of each series: a run of up to this many steps is kept step by step.
CAPACITY = 1024
# Names given to step.log kept as series (the first ones seen), and how long a name may be.
MAX_VALUES = 8
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]{0,63}")
# Commits of steps not yet committed by every rank are kept this far behind the newest.
_PENDING_STEPS = 100
# Names of goodput's losses: as many as a status names, never a label set that grows.
_MAX_CAUSES = 16


class Downsampled:
    """Values per step, the whole run in at most ``capacity`` buckets of ``width`` steps each."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 2 or capacity % 2:
            raise ValueError(
                f"a series needs an even capacity of at least 2 buckets, got {capacity}")
        self.capacity = capacity
        self.width = 1
        # the first step seen: bucket i covers origin + i*width onwards
        self.origin: int | None = None
        self.last_step = 0
        self._n: list[int] = []
        self._sum: list[float] = []
        self._min: list[float] = []
        self._max: list[float] = []

    def add(self, step: int, value: float) -> None:
        if not math.isfinite(value):
            return  # a NaN loss is no point on a chart (the log keeps it)
        if self.origin is None:
            self.origin = step
        index = max(0, step - self.origin) // self.width
        while index >= self.capacity:
            self._halve()
            index = max(0, step - self.origin) // self.width
        while len(self._n) <= index:
            self._n.append(0)
            self._sum.append(0.0)
            self._min.append(math.inf)
            self._max.append(-math.inf)
        self._n[index] += 1
        self._sum[index] += value
        self._min[index] = min(self._min[index], value)
        self._max[index] = max(self._max[index], value)
        self.last_step = max(self.last_step, step)

    def _halve(self) -> None:
        """Merge neighbours: half as many buckets, each twice as wide."""
        n, s, lo, hi = self._n, self._sum, self._min, self._max
        pairs = range(0, len(n), 2)
        self._n = [n[i] + (n[i + 1] if i + 1 < len(n) else 0) for i in pairs]
        self._sum = [s[i] + (s[i + 1] if i + 1 < len(s) else 0.0) for i in pairs]
        self._min = [min(lo[i], lo[i + 1]) if i + 1 < len(lo) else lo[i] for i in pairs]
        self._max = [max(hi[i], hi[i + 1]) if i + 1 < len(hi) else hi[i] for i in pairs]
        self.width *= 2

    def points(self, first: int | None = None, last: int | None = None,
               limit: int = 400) -> list[list[float]]:
        """Buckets overlapping steps ``first``..``last``, merged into at most ``limit`` points.

        Each point is ``[first step, last step, mean, min, max]`` of the steps it covers.
        """
        if self.origin is None:
            return []
        origin, width = self.origin, self.width
        n, total, low, high = self._n, self._sum, self._min, self._max
        lo = 0 if first is None else max(0, (first - origin) // width)
        hi = len(n) - 1 if last is None else min(len(n) - 1, (last - origin) // width)
        filled = sum(1 for i in range(lo, hi + 1) if n[i])
        group = max(1, math.ceil(filled / max(1, limit)))
        out: list[list[float]] = []
        count, acc, least, most, start, members = 0, 0.0, math.inf, -math.inf, 0, 0
        for i in range(lo, hi + 1):
            if not n[i]:
                continue
            if members == 0:
                start = i
            count += n[i]
            acc += total[i]
            least = low[i] if low[i] < least else least
            most = high[i] if high[i] > most else most
            members += 1
            if members == group:
                bucket_end = min(origin + (i + 1) * width - 1, self.last_step)
                out.append([origin + start * width, bucket_end, acc / count, least, most])
                count, acc, least, most, members = 0, 0.0, math.inf, -math.inf, 0
        if members:
            end = max(i for i in range(lo, hi + 1) if n[i])
            out.append([origin + start * width, min(origin + (end + 1) * width - 1, self.last_step),
                        acc / count, least, most])
        return out


@dataclass
class Histogram:
    """Observations counted per bucket (cumulative on the way out, as Prometheus wants them)."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        if not self.counts:
            self.counts = [0] * len(self.bounds)
        # the first bound at or above it (le: "less or equal")
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) for each bound; ``count`` is the +Inf
        bucket."""
        running, out = 0, []
        for bound, n in zip(self.bounds, self.counts or [0] * len(self.bounds), strict=True):
            running += n
            out.append((bound, running))
        return out


def rank_step_label(rank: int) -> str:
    """The ``rank`` label of a rank's step time: its number for the first ranks, one shared value
    past them."""
    return str(rank) if rank < LABELLED_RANKS else f"{LABELLED_RANKS}+"


class RunHistory:
    """The run's step times (the job's and each rank's), logged values and saves, bounded.

    Fed by the manager: ``commit`` for each rank's commit, ``checkpoint`` for
    each save report, ``set_goodput`` when goodput is worked out. Read by the
    page's data endpoint (``view``) and the metrics collector.
    """

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        # each step: from the previous step's last commit to its own
        self.job = Downsampled(capacity)
        self.ranks: dict[int, Downsampled] = {}  # each rank's time between its consecutive commits
        # each step.log name: the mean over the ranks that gave it
        self.values: dict[str, Downsampled] = {}
        self.last_values: dict[str, float] = {}  # each name's mean at the newest step that had it
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.rank_step_seconds: dict[str, Histogram] = {}
        self.save_seconds = {"blocking": Histogram(SAVE_BUCKETS), "write": Histogram(SAVE_BUCKETS)}
        self.bytes_written = 0
        self.goodput: tuple[float, dict[str, float]] | None = None
        self._last: dict[int, tuple[int, float]] = {}  # rank -> its last commit (step, t)
        # step -> rank -> commit
        self._pending: dict[int, dict[int, tuple[float, Mapping[str, float]]]] = {}
        self._done: dict[int, float] = {}  # step -> when its last rank committed it

    # --- fed by the manager ---------------------------------------------------------

    def commits(self, rows: Iterable[tuple[int, int, int, float, Mapping[str, float]]],
                world_size: int) -> None:
        """Rows of (rank, step, generation, t, metrics), as the manager takes commits."""
        for rank, step, _generation, t, metrics in rows:
            self.commit(rank, step, t, metrics, world_size)

    def commit(self, rank: int, step: int, t: float, metrics: Mapping[str, float],
               world_size: int) -> None:
        previous = self._last.get(rank)
        self._last[rank] = (step, t)
        if previous is not None and previous[0] == step - 1 and t >= previous[1]:
            seconds = t - previous[1]
            self.rank_step_seconds.setdefault(rank_step_label(rank),
                                              Histogram(STEP_BUCKETS)).observe(seconds)
            if rank < PAGE_RANKS:
                self.ranks.setdefault(rank, Downsampled(self.capacity)).add(step, seconds)
        commits = self._pending.setdefault(step, {})
        # (a rank's second commit of a step re-run after a fault: the later counts)
        commits[rank] = (t, metrics)
        if len(commits) >= max(1, world_size):
            self._step_done(step, commits)

    def _step_done(self, step: int, commits: dict[int, tuple[float, Mapping[str, float]]]) -> None:
        del self._pending[step]
        done = max(t for t, _ in commits.values())
        previous = self._done.get(step - 1)
        self._done[step] = done
        if previous is not None and done >= previous:
            self.job.add(step, done - previous)
            self.step_seconds.observe(done - previous)
        sums: dict[str, list[float]] = {}
        for _, metrics in commits.values():
            for name, value in metrics.items():
                if not isinstance(value, (int, float)):
                    continue
                if name in self.values or name in sums or (
                        len(self.values.keys() | sums.keys()) < MAX_VALUES
                        and _NAME.fullmatch(name)):
                    sums.setdefault(name, []).append(float(value))
        for name, values in sums.items():
            mean = math.fsum(values) / len(values)
            self.values.setdefault(name, Downsampled(self.capacity)).add(step, mean)
            self.last_values[name] = mean
        for old in [s for s in self._done if s < step - 2]:
            del self._done[old]
        for old in [s for s in self._pending if s < step - _PENDING_STEPS]:
            del self._pending[old]

    def checkpoint(self, message: CheckpointSaved) -> None:
        """A save report: a committed save's stall, write time and size (a reused one wrote
        nothing)."""
        if message.error or message.kind == "existing":
            return
        self.save_seconds["blocking"].observe(message.blocking_s)
        self.save_seconds["write"].observe(message.write_s)
        self.bytes_written += max(0, int(message.bytes))

    def set_goodput(self, ratio: float, lost_s: Mapping[str, float]) -> None:
        """The job's goodput (the share of wall time spent on steps that count) and its losses by
        cause, in seconds.

        The manager calls this where goodput is worked out; the metrics show the
        last values set (none before the first call: no made-up number).
        """
        if (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                or not 0.0 <= ratio <= 1.0):
            raise ValueError(f"goodput is a share of wall time between 0 and 1, got {ratio!r}")
        if len(lost_s) > _MAX_CAUSES:
            raise ValueError(
                f"goodput names at most {_MAX_CAUSES} causes of lost time, got {len(lost_s)}")
        losses: dict[str, float] = {}
        for cause, seconds in lost_s.items():
            if not isinstance(cause, str) or not _NAME.fullmatch(cause):
                raise ValueError(
                    f"a cause of lost time is a short name like 'recovery', got {cause!r}")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                    or not math.isfinite(seconds) or seconds < 0:
                raise ValueError(
                    f"the time lost to {cause} must be seconds (0 or more), got {seconds!r}")
            losses[cause] = float(seconds)
        self.goodput = (float(ratio), losses)

    def replay(self, path: Path, world_size: int) -> None:
        """A restarted manager: the run so far, read back from the job's event log.

        The history is a view: a log it cannot read leaves it empty (said once),
        never a manager that cannot carry its job on.
        """
        try:
            with LogReader(path) as reader:
                for c in reader.iter_commits():
                    self.commit(c.rank, c.step, c.t, c.metrics, world_size)
                for e in reader.events("checkpoint_saved"):
                    d = e.data
                    self.checkpoint(CheckpointSaved(int(e.rank or 0), int(d.get("step", 0)),
                                                    str(d.get("kind", "")),
                                                    str(d.get("path", "")),
                                                    float(d.get("blocking_s", 0.0)),
                                                    float(d.get("write_s", 0.0)),
                                                    int(d.get("bytes", 0)), e.t))
        except (LogReader.Error, OSError, ValueError, TypeError) as e:
            log.warning("the run's history (the page's charts, the step-time histograms) starts "
                        "afresh: the event log %s could not be read back (%s: %s)", path,
                        type(e).__name__, e)

    # --- read by the page and the metrics ---------------------------------------------

    def view(self, first: int | None = None, last: int | None = None,
             points: int = 400) -> dict[str, Any]:
        """The run between steps ``first`` and ``last`` (the whole run by default), at most
        ``points`` per series."""
        return {
            "first": self.job.origin if self.job.origin is not None else None,
            "last": self.job.last_step or None,
            "width": self.job.width,
            "step_times": self.job.points(first, last, points),
            "ranks": {str(r): s.points(first, last, points) for r, s in sorted(self.ranks.items())},
            "ranks_shown": PAGE_RANKS,
            "values": {name: s.points(first, last, points) for name, s in self.values.items()},
        }
