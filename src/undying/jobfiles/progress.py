"""How far the job is: step of total, epoch, rate, ETA and the last values given to ``step.log``.

Pure: it takes what the manager already keeps (the job's completed steps with
their times and values, and the plan rank 0 reports when its loop starts) and
returns a typed value. The live manager (``StepClock``) and a finished job's
log (``undying status`` after the launcher is gone, the end summary) feed it
the same way, so both say the same thing.

A step of the job is done when every rank committed it (``JobSteps``); its
values are the mean over the ranks of what each rank gave ``step.log`` (the
loss of a data-parallel job is the mean of the ranks' losses).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PLAN_EVENT", "Plan", "Progress", "JobSteps", "RATE_WINDOW", "compute", "mean_values"]

# The worker's report (a Progress phase, logged as an event of this kind) of how many steps it runs,
# in which epochs.
PLAN_EVENT = "steps_planned"

# Completed steps the rate (and so the ETA) is measured over: recent enough to follow a change of
# pace, long enough that one slow step (a checkpoint's stall) does not swing it.
RATE_WINDOW = 32


@dataclass(frozen=True)
class Plan:
    """What rank 0's loop reports when it starts (the ``steps_planned`` event): how many steps,
    in which epochs.

    ``origin`` is the data position a resumed job carries over (``worker.data``):
    step ``s`` reads batch ``origin[1] + s - origin[0]`` of the data, counted from 1.
    ``batch_size`` is one rank's batch (its loader's), None when the loader has none.
    """

    total_steps: int
    steps_per_epoch: int | None = None
    origin: tuple[int, int] = (0, 0)
    batch_size: int | None = None

    @classmethod
    def from_detail(cls, detail: Mapping[str, Any]) -> Plan | None:
        """The plan from the event's detail; None for a detail that is not one (an older worker's,
        a damaged row)."""
        try:
            total = int(detail["total_steps"])
            per_epoch = detail.get("steps_per_epoch")
            origin = detail.get("origin") or (0, 0)
            batch = detail.get("batch_size")
            plan = cls(total, int(per_epoch) if per_epoch else None,
                       (int(origin[0]), int(origin[1])), int(batch) if batch else None)
        except (KeyError, TypeError, ValueError, IndexError):
            return None
        return plan if plan.total_steps >= 0 else None

    def epoch_of(self, step: int) -> int | None:
        """The epoch (from 0) step ``step`` reads from, as ``worker.data.DataCursor.epoch_of``
        counts it."""
        if not self.steps_per_epoch:
            return None
        position = self.origin[1] + max(step, 1) - self.origin[0]
        return max(0, (position - 1) // self.steps_per_epoch)

    @property
    def epochs(self) -> int | None:
        """How many epochs the job's steps reach into (the last one's number plus one)."""
        last = self.epoch_of(self.total_steps)
        return None if last is None else last + 1


@dataclass(frozen=True)
class Progress:
    """The job's progress as ``undying status``, ``/api/status`` and the page show it
    (``to_dict``)."""

    step: int
    total_steps: int | None
    fraction: float | None
    epoch: int | None
    epochs: int | None
    steps_per_s: float | None
    samples_per_s: float | None
    eta_s: float | None
    values_step: int | None
    values: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "total_steps": self.total_steps,
            "fraction": _round(self.fraction, 4),
            "epoch": self.epoch, "epochs": self.epochs,
            "steps_per_s": _round(self.steps_per_s, 4),
            "samples_per_s": _round(self.samples_per_s, 2), "eta_s": _round(self.eta_s, 1),
            "values_step": self.values_step, "values": self.values,
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def compute(step: int, plan: Plan | None, recent: Sequence[tuple[int, float]], *, world_size: int,
            values: tuple[int, dict[str, float]] | None = None, running: bool = True) -> Progress:
    """The progress at ``step`` (the slowest rank's committed step) from the recent completed steps.

    ``recent``: (step, when every rank had committed it), oldest first; the
    rate is the steps advanced over the time they took, so a checkpoint stall
    or a recovery in the window slows it as it slows the job. Samples per
    second count ``batch_size`` per rank per step (each rank reads its own
    batch, as a ``DistributedSampler`` gives it). ``running`` False (the job
    ended): no rate and no ETA.
    """
    rate = _rate(recent) if running else None
    total = plan.total_steps if plan is not None else None
    fraction = min(1.0, step / total) if total else (1.0 if total == 0 else None)
    eta = max(0, total - step) / rate if rate and total is not None else None
    samples = (rate * plan.batch_size * world_size
               if rate and plan is not None and plan.batch_size else None)
    return Progress(
        step=step, total_steps=total, fraction=fraction,
        epoch=plan.epoch_of(step) if plan is not None else None,
        epochs=plan.epochs if plan is not None else None,
        steps_per_s=rate, samples_per_s=samples, eta_s=eta,
        values_step=values[0] if values is not None else None,
        values=dict(values[1]) if values is not None else {},
    )


def _rate(recent: Sequence[tuple[int, float]]) -> float | None:
    if len(recent) < 2:
        return None
    (first_step, first_t), (last_step, last_t) = recent[0], recent[-1]
    if last_t <= first_t or last_step <= first_step:
        return None  # (a window of re-run steps only: no forward progress to measure)
    return (last_step - first_step) / (last_t - first_t)


def mean_values(per_rank: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Each name's mean over the ranks that gave it (a NaN loss stays NaN: it is news)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics in per_rank:
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + float(value)
            counts[name] = counts.get(name, 0) + 1
    return {name: (total / counts[name] if math.isfinite(total) else total)
            for name, total in sums.items()}


class JobSteps:
    """From the ranks' commits to the job's completed steps: a step is done when every rank
    committed it.

    ``commit`` returns (when the step was done, its values) for the commit that
    completed it, else None. A step committed again after a recovery starts
    over and completes again (a re-run). Steps far behind are forgotten, so the
    memory stays bounded however long the job runs.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._commits: dict[int, dict[int, tuple[float, Mapping[str, float]]]] = {}
        self.recent: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)
        self.last_values: tuple[int, dict[str, float]] | None = None

    def reset(self, world_size: int) -> None:
        """A new layout: steps in flight are of the old one."""
        self.world_size = world_size
        self._commits.clear()

    def commit(self, rank: int, step: int, t: float,
               metrics: Mapping[str, float] | None = None) -> tuple[float, dict[str, float]] | None:
        commits = self._commits.setdefault(step, {})
        commits[rank] = (t, metrics or {})
        if len(commits) < self.world_size:
            return None
        del self._commits[step]
        done = max(c[0] for c in commits.values())
        values = mean_values(c[1] for c in commits.values())
        self.recent.append((step, done))
        if values:
            self.last_values = (step, values)
        for old in [s for s in self._commits if s < step - 100]:
            del self._commits[old]
        return done, values
