"""What the slow-rank detector remembers of each rank and node, and the numbers a finding
shows.

A ``Track`` holds one (rank, phase) or (node, phase)'s evidence, its onset and
the sums of the windows that added to it (``trace/detect.py``'s module doc says
how evidence gathers); the functions here turn a track into a finding's numbers,
and ``rank_finding`` and ``node_finding`` into the finding itself.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from undying.trace.finding import Finding, onset

__all__ = [
    "Track", "evidence_of", "factor_of", "onset_of", "step_factor", "rounded",
    "rank_finding", "node_finding",
]

# Windows of history a track keeps for its onset and size (a finding needs a few; 64 is ample).
HISTORY = 64


@dataclass
class Track:
    """What the detector remembers about one (rank, phase) or (node, phase)."""

    evidence: float = 0.0  # accumulated excess, in bars (see trace/detect.py's module doc)
    since: int = 0  # first step of the window where the evidence last rose from 0
    run_sum: float = 0.0  # excess (seconds) summed over the windows since then
    run_n: int = 0
    active: bool = False  # reported and not recovered
    calm: int = 0  # consecutive windows that added no evidence
    deferred: int = 0  # windows this rank's report waited for its node-mates
    # Sums of the numbers shown as evidence, over the windows that added to it.
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    basis: str = ""
    # (first step, bars, seconds) of each window since the evidence last rose from 0,
    # the newest last: where the slowdown began and how large it is are read from these.
    history: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    # The windows' median steps before the evidence rose (the job before the slowdown): a few,
    # as a loaded machine's step time wanders from one window to the next.
    base_steps: deque[float] = field(default_factory=lambda: deque(maxlen=3))

    @property
    def base_step(self) -> float:
        return median(self.base_steps) if self.base_steps else 0.0

    def mean(self, key: str) -> float | None:
        n = self.counts.get(key, 0)
        return self.sums[key] / n if n else None


def evidence_of(track: Track) -> dict[str, Any]:
    """The numbers behind a finding: means over the windows that were slow."""
    ev: dict[str, Any] = {"basis": track.basis}
    for key in ("value", "others_median", "comm", "others_comm", "step", "bar"):
        ev[key] = rounded(track.mean(key))
    ev["windows"] = track.run_n
    ev["evidence"] = round(track.evidence, 3)
    return ev


def factor_of(ev: dict[str, Any]) -> float | None:
    value, others = ev.get("value"), ev.get("others_median")
    if value is None or not others:
        return None
    return round(value / others, 6)


def onset_of(track: Track) -> tuple[int, float]:
    found = onset(track.history)
    return found if found is not None else (track.since, track.run_sum / max(1, track.run_n))


def step_factor(base_step: float, excess: float) -> float | None:
    return round((base_step + excess) / base_step, 4) if base_step > 0 else None


def rounded(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: rounded(x) for k, x in v.items()}
    return v


def rank_finding(rank: int, node: str, phase: str, track: Track) -> Finding:
    """The ``slow_rank`` finding of ``rank`` (on ``node``) in ``phase``, from its track."""
    ev = evidence_of(track)
    # In every slow window: the longest of all ranks in that phase, the shortest collective
    # wait.
    ev["longest"] = track.sums.get("longest", 0.0) == track.counts.get("longest", -1)
    if "shortest_comm" in track.counts:
        ev["shortest_comm"] = track.sums["shortest_comm"] == track.counts["shortest_comm"]
    since, excess = onset_of(track)
    return Finding(
        kind="slow_rank", rank=rank, node=node, ranks=[rank], phase=phase,
        factor=factor_of(ev), excess_s=round(excess, 6), since_step=since,
        step_factor=step_factor(track.base_step, excess), evidence=ev,
    )  # fmt: skip


def node_finding(
    node: str, ranks: list[int], phase: str, nt: Track, tracks: list[Track]
) -> Finding:
    """The ``slow_node`` finding of ``node`` in ``phase``, from its track (``nt``) and its
    ranks' (``tracks``, in the order of ``ranks``)."""
    evs = [evidence_of(t) for t in tracks]

    def mean(key: str) -> float | None:
        xs = [e[key] for e in evs if e.get(key) is not None]
        return rounded(sum(xs) / len(xs)) if xs and len(xs) == len(evs) else None

    ev: dict[str, Any] = {"basis": evs[0]["basis"] or phase}
    for key in ("value", "others_median", "comm", "others_comm", "step", "bar"):
        ev[key] = mean(key)
    ev["windows"] = nt.run_n
    ev["evidence"] = round(nt.evidence, 3)
    ev["per_rank_excess"] = {str(r): rounded(nt.mean(f"rank{r}")) for r in ranks}
    since, excess = onset_of(nt)
    return Finding(
        kind="slow_node", rank=-1, node=node, ranks=list(ranks), phase=phase,
        factor=factor_of(ev), excess_s=round(excess, 6), since_step=since,
        step_factor=step_factor(nt.base_step, excess), evidence=ev,
    )  # fmt: skip
