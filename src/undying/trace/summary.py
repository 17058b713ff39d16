"""Per-rank step summaries: a few numbers per window of steps, for slow-rank detection.

A rank's raw records (several per step, more with comm markers on) stay on its
own disk; what travels to the manager is one small dict per window of steps,
made here on the worker. Windows are aligned on step numbers (steps 1-10,
11-20, ...), not on when a rank started, so that every rank's window ``k``
covers the same steps (a replacement that joins mid-window simply sends a
shorter first window) and the detector can compare like with like.

Each step's phases come from the records that carry its ``step`` number:

- ``step``: the whole step, from batch fetch to commit;
- ``fp``, ``data``: forward pass and wait for the batch (summed per step);
- ``ckpt`` with ``part`` "block": the training loop's stall (the "write" part
  runs in the background and costs the loop nothing, so it is left out);
- ``comm``: the step's collectives (launch to completion); what counts is the
  exposed wait, from the last one's launch to the last completion (see
  ``StepAccumulator.comm_wait`` for why not their sum).

``compute`` is what is left of the step: step - data - ckpt - comm. Only the
part of a phase that lies inside the step's own interval is subtracted (records
carry their start ``t``), because where the tracer puts a checkpoint stall
relative to the commit is its business; a stall after the commit lengthens no
step and must not shorten the step's compute. Without comm records ``compute``
still contains the wait for the others, which is why the detector then judges
compute by the forward pass instead.

The window's values are robust means over its steps: the mean of the middle
60% (the fifth of the steps highest and the fifth lowest left out; the median
when fewer than 5 steps). On a loaded machine single steps jitter by tens of
percent and an occasional step takes twice as long: a plain mean follows those,
the trimmed one does not, and it wobbles less than the median of the same
steps (measured on real 4-rank traces on a 2-core machine: a rank's window
value spreads by 0.045 of the step against 0.050 for the median), which is what
lets the detector use a tight bar.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import Any, NamedTuple

__all__ = [
    "StepPhases", "StepAccumulator", "StepSummarizer", "PHASE_KINDS", "robust_mean",
    "window_summary",
]

# Record kinds that carry a duration attributed to a step.
PHASE_KINDS = ("step", "fp", "data", "ckpt", "comm")


def _num(value: Any) -> float | None:
    """A finite float from a record field, or None for anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


class StepPhases(NamedTuple):
    """One step's phases on one rank, in seconds."""

    step: float
    fp: float
    data: float
    ckpt: float  # the blocking part
    comm: float | None  # the exposed collective wait; None without comm records
    compute: float  # step - data - ckpt - comm, of what lies inside the step


class StepAccumulator:
    """The records of one step on one rank, in one generation, folded as they arrive."""

    __slots__ = ("gen", "t", "dur", "fp", "data", "ckpt", "n_comm", "_last_launch", "_last_end",
                 "_spans")

    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.t: float | None = None  # the step record's start (wall clock)
        self.dur: float | None = None  # the step record's duration; None until it arrives
        self.fp = 0.0
        self.data = 0.0
        self.ckpt = 0.0  # blocking part only
        self.n_comm = 0
        self._last_launch: float | None = None  # start of the step's last collective
        self._last_end: float | None = None  # the latest completion of any of them
        # (start, duration) of the data and checkpoint phases to subtract from
        # the step, kept until the step's own interval is known (a step's
        # records may arrive in any order): one or two per step.
        self._spans: list[tuple[float | None, float]] = []

    @property
    def done(self) -> bool:
        """Whether the step's own record arrived (the step completed)."""
        return self.dur is not None

    def add(self, record: dict[str, Any]) -> None:
        """Fold one record of this step in. Records of unknown kinds are ignored."""
        kind = record.get("kind")
        dur = _num(record.get("dur"))
        if dur is None or dur < 0:
            return
        t = _num(record.get("t"))
        if kind == "step":
            self.t, self.dur = t, dur
        elif kind == "fp":
            self.fp += dur
        elif kind == "data":
            self.data += dur
            self._spans.append((t, dur))
        elif kind == "ckpt":
            if record.get("part", "block") != "block":
                return
            self.ckpt += dur
            self._spans.append((t, dur))
        elif kind == "comm":
            self.n_comm += 1
            if t is None:  # no clock stamp: all that can be said is its length
                t = (self._last_end or 0.0) - dur
            if self._last_launch is None or t > self._last_launch:
                self._last_launch = t
            if self._last_end is None or t + dur > self._last_end:
                self._last_end = t + dur

    def _inside(self, t: float | None, dur: float) -> float:
        """How much of a phase [t, t+dur] lies within the step's interval."""
        if t is None or self.t is None or self.dur is None:
            return dur
        overlap = min(t + dur, self.t + self.dur) - max(t, self.t)
        # Clock stamps are rounded to microseconds: a phase that starts with the
        # step may appear to start a hair before it, and one that follows the
        # step may appear to touch it.
        if overlap < 5e-6:
            return 0.0
        return min(dur, overlap + 2e-6)

    def values(self) -> StepPhases:
        """The step's phases in seconds; ``comm`` None when the step has no comm record."""
        assert self.dur is not None, "values() of a step whose step record has not arrived"
        inside = sum(self._inside(t, d) for t, d in self._spans)
        comm = self.comm_wait()
        if comm is not None:
            assert self._last_launch is not None
            inside += self._inside(self._last_launch, comm)
        return StepPhases(self.dur, self.fp, self.data, self.ckpt, comm,
                          max(0.0, self.dur - inside))

    def comm_wait(self) -> float | None:
        """The step's exposed collective time: from its last collective's launch to the last
        completion.

        Not the sum of the collectives' durations: with DDP, bucket all-reduces
        are launched during the backward pass and overlap it and each other, so
        their sum counts backward compute (and the same wait) several times
        over. Once the last bucket is launched the rank has nothing left to do
        but wait, and that wait is what a fast rank spends on the slowest one.
        A single collective's wait is simply its duration. None without comm records.
        """
        if self._last_launch is None or self._last_end is None:
            return None
        return max(0.0, self._last_end - self._last_launch)


class StepSummarizer:
    """Folds one rank's records into one summary per window of ``window`` steps.

    ``observe`` is called for every record the rank makes and costs a dict
    lookup and a few additions; ``take`` is polled (say once per step) and
    returns a summary once a window is over, that is once a record of a later
    window arrives. Waiting for that rather than for the window's last step
    record keeps records that follow the step record (a checkpoint stall after
    the commit) in their window. ``flush`` closes the last window at the end.

    A record of a newer generation replaces what an older one said about the
    same step (the step was re-run after a recovery); a record for an earlier,
    closed window of the same generation is dropped and counted in ``dropped``.
    """

    def __init__(self, window: int = 10) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 step, got {window}")
        self.window = window
        self.dropped = 0
        self._bucket: int | None = None
        self._gen = 0
        self._steps: dict[int, StepAccumulator] = {}
        self._rank: int | None = None
        self._node: str | None = None
        self._ready: deque[dict[str, Any]] = deque()

    def observe(self, record: dict[str, Any]) -> None:
        """Take one record of this rank (any kind; those without a step number are ignored)."""
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return
        gen = record.get("gen", 0)
        if isinstance(gen, bool) or not isinstance(gen, int):
            gen = 0
        bucket = (step - 1) // self.window
        if self._bucket is None:
            self._bucket = bucket
        elif bucket != self._bucket:
            if bucket > self._bucket or gen > self._gen:
                self._close()  # the window is over, or a recovery rolled the job back
                self._bucket = bucket
            else:
                self.dropped += 1
                return
        if gen > self._gen:
            self._gen = gen
        acc = self._steps.get(step)
        if acc is None or gen > acc.gen:
            acc = self._steps[step] = StepAccumulator(gen)
        elif gen < acc.gen:
            self.dropped += 1  # a straggler from before the step was re-run
            return
        if self._rank is None:
            rank = record.get("rank")
            if isinstance(rank, int) and not isinstance(rank, bool):
                self._rank = rank
        if self._node is None:
            node = record.get("node")
            if isinstance(node, str):
                self._node = node
        acc.add(record)

    def take(self) -> dict[str, Any] | None:
        """The oldest finished window's summary, or None when no window finished since the last
        call."""
        return self._ready.popleft() if self._ready else None

    def flush(self) -> dict[str, Any] | None:
        """Close the current window now (the job ended) and return the oldest summary waiting."""
        self._close()
        self._bucket = None
        return self.take()

    def _close(self) -> None:
        summary = self._summarize()
        self._steps = {}
        if summary is not None:
            self._ready.append(summary)

    def _summarize(self) -> dict[str, Any] | None:
        """The window's summary over its completed steps; None if none completed."""
        done = sorted((s, a) for s, a in self._steps.items() if a.done)
        if not done or self._bucket is None:
            return None
        steps = [(s, a.gen, a.values()) for s, a in done]
        return window_summary(self._rank, self._node, self._bucket, steps)


def window_summary(
    rank: int | None, node: str | None, window: int, steps: list[tuple[int, int, StepPhases]]
) -> dict[str, Any]:
    """The compact summary of one rank's window: robust means over ``steps`` (step, generation,
    phases).

    The one place the summary's numbers are made, online (``StepSummarizer``)
    and offline (``undying.trace.analyze``).
    """
    if not steps:
        raise ValueError("a window summary needs at least one step")
    steps = sorted(steps, key=lambda item: item[0])
    rows = [p for _, _, p in steps]
    comms = [r.comm for r in rows if r.comm is not None]
    return {
        "rank": rank,
        "node": node,
        "gen": max(g for _, g, _ in steps),
        "window": window,
        "first_step": steps[0][0],
        "last_step": steps[-1][0],
        "steps": len(rows),
        "step": robust_mean([r.step for r in rows]),
        "fp": robust_mean([r.fp for r in rows]),
        "data": robust_mean([r.data for r in rows]),
        "ckpt": robust_mean([r.ckpt for r in rows]),
        "comm": robust_mean(comms) if comms else None,
        "compute": robust_mean([r.compute for r in rows]),
    }


def robust_mean(values: list[float]) -> float:
    """Mean of the middle 60% of ``values`` (their median when fewer than 5), to the microsecond.

    More digits than microseconds are noise, and bytes on the wire.
    """
    if not values:
        raise ValueError("robust_mean of no values")
    if len(values) < 5:
        return round(float(median(values)), 6)
    ordered = sorted(values)
    cut = len(ordered) // 5
    middle = ordered[cut : len(ordered) - cut]
    return round(sum(middle) / len(middle), 6)
