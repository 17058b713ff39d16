"""What the slow-rank detector finds, in numbers and in words, and where a slowdown began.

Kept apart from the detector (``undying.trace.detect``) because its readers are
many: the manager's incidents, ``undying diagnose``, the status line and the
HTML report all show a ``Finding``; ``onset`` is the one rule for "since which
step, by how much", online over windows and offline as the start of a
step-level search.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

__all__ = ["Finding", "describe_finding", "onset"]

# Names of the phases in sentences.
_PHASE_WORDS = {"compute": "compute", "data": "data-loader wait", "ckpt": "checkpoint stall"}


@dataclass
class Finding:
    """A slow rank or a slow node, with the numbers that show it.

    ``factor`` is the slow one's phase time over the others' median (None when
    the others spend no time at all in that phase); ``excess_s`` is the extra
    time per step since ``since_step``, where the slowdown began (see
    ``onset``); ``step_factor`` is what that excess makes of the job's step as
    it was before (1.5: half a step more).
    """

    kind: str  # "slow_rank" or "slow_node"
    rank: int  # -1 for a node
    node: str
    ranks: list[int]
    phase: str  # "compute", "data" or "ckpt"
    factor: float | None
    excess_s: float
    since_step: int
    # The rank's (or node's) steps over the job's before the slowdown, counting only this
    # phase's excess: 1.5 for a rank whose compute grew by half a step. None when unknown.
    step_factor: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (incident payloads, ``diagnose --json``)."""
        return asdict(self)

    def describe(self) -> str:
        """One sentence a person can act on."""
        return describe_finding(self.to_dict())


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) >= 1:
        return f"{seconds:.2f} s"
    if abs(seconds) < 0.01:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds * 1000:.0f} ms"


def describe_finding(f: dict[str, Any]) -> str:
    """The sentence for a finding given as a dict (a Finding's ``to_dict``, or an incident's
    copy)."""
    phase = f["phase"]
    slow = f"{phase}-slow"
    who = f"rank {f['rank']}" if f["kind"] == "slow_rank" else (
        f"node {f['node']} (ranks {', '.join(str(r) for r in f['ranks'])})"
    )
    ev = f.get("evidence") or {}
    factor = f.get("factor")
    what = "forward pass" if ev.get("basis") == "fp" else _PHASE_WORDS.get(phase, phase)
    if factor is not None:
        size = f"{factor:.2f}x the others' {what}"
    else:
        size = f"{_ms(f['excess_s'])} of {what} per step where the others have none"
    text = f"{who} is {slow}: {size} since step {f['since_step']}"
    extra = [f"+{_ms(f['excess_s'])} per step"]
    if f.get("step_factor"):
        extra[0] += f", {f['step_factor']:.2f}x the step before"
    if ev.get("comm") is not None and ev.get("others_comm") is not None:
        extra.append(f"comm wait {_ms(ev['comm'])} vs {_ms(ev['others_comm'])}")
    if ev.get("basis") == "fp":
        off = ": comm markers off" if ev.get("comm") is None else ""
        extra.append("judged by the forward pass" + off)
    return f"{text} ({'; '.join(extra)})"


def onset(history: Iterable[tuple[int, float, float]]) -> tuple[int, float] | None:
    """Where a slowdown began and how large it is, from a track's windows: (first step, seconds
    per step).

    ``history`` holds (first step, bars, seconds) of each window since the
    evidence last rose from 0, the newest last. Why not simply where the
    evidence rose: a rank a little slow for a while (noise, a busy neighbour,
    a stretch of shorter steps that makes a small excess a bar) starts the
    evidence early, and averaging over all those windows dilutes the size (a
    finding once said "since step 141, +2.4 ms" of a slowdown injected at step
    233 of +7.7 ms). So the windows are split in two where the level changed:
    among the splits whose earlier part stands below half the later part's
    mean, the one that fits two flat levels best (least squares); none such,
    the slowdown began with the evidence. The size is the later part's median:
    the onset's own window is only partly slow, and a window of a loaded
    machine may hold a few long steps more than the trimmed mean drops.
    """
    xs = [x for _, _, x in history]
    starts = [first for first, _, _ in history]
    if not xs:
        return None

    def sse(part: list[float]) -> float:
        m = sum(part) / len(part)
        return sum((x - m) ** 2 for x in part)

    best, best_cost = 0, math.inf
    for i in range(1, len(xs)):
        left, right = xs[:i], xs[i:]
        if sum(left) / len(left) < 0.5 * sum(right) / len(right):
            cost = sse(left) + sse(right)
            if cost < best_cost:
                best, best_cost = i, cost
    return starts[best], median(xs[best:])
