"""Goodput: the share of the job's wall time spent on steps that count, and where the rest went.

Google's ML Goodput measure: goodput is productive training time over the
job's total time; what is not productive is *badput*, named by its cause. Here
the wall time (the manager's start to the job's end, or to now) is cut into
pieces that add up to it exactly:

- ``productive``: the time of every step that counts, i.e. of its last
  execution (from the job's previous completed step to this one's);
- ``startup``: from the start to the first completed step (the first step
  included: it warms up, as Google's measure counts it);
- ``checkpoint``: the training loop's stalls for checkpoint copies (the
  ``blocking_s`` of each save);
- per incident, from its timeline: ``detection`` (the fault to its detection),
  ``recovery`` (the decision, a regroup's save, the new group, the state
  restored),
  ``spare_wait`` (the decision to the replacement process being ready),
  ``rerun`` (work thrown away: the step in flight at the fault, and every
  completed step executed again after a roll-back), ``preemption`` (a SIGTERM
  to the launcher's exit);
- ``shutdown``: after the last completed step of a job that ended (the final
  barrier, the last save's write, the processes' exit); ``in_flight``: for a
  running job, the step under way (it will count or be re-run).

Pure: the step ledger is fed the job's completed steps (``StepLedger.done``),
the incidents come as their ``Incident.to_dict`` views, the stalls as
(step, time, seconds). The live manager and a finished job's log feed it alike.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LOSSES", "StepLedger", "Stall", "Goodput", "account"]

# The named losses, in the order a reader meets them in a job's life.
LOSSES = ("startup", "checkpoint", "detection", "recovery", "spare_wait", "rerun", "preemption",
          "shutdown", "in_flight")
# Incidents that stop training until they are recovered (the others are observed only: a slow rank,
# failing saves).
_STOPPING = frozenset({"crash", "error", "hang", "comm-error", "node-loss", "node-joined",
                       "script-error", "left-early"})
# Which overlay wins where two overlap: an incident's own phases, then a checkpoint stall, then lost
# work.
_PHASE, _STALL, _LOST = 3, 2, 1


@dataclass(frozen=True)
class Stall:
    """A checkpoint save's stall of the training loop: after step ``step`` committed,
    ``seconds`` long."""

    step: int
    # When the save was reported (after the stall: it finds the execution of the step it
    # followed).
    t: float
    seconds: float


class StepLedger:
    """The job's completed steps in the order they completed, each execution's interval, what
    counts.

    Each completed step (every rank committed it) owns the time from the
    previous completed step to it. A step completed again (after a roll-back)
    supersedes its earlier execution, whose interval is re-run work. Memory is
    16 bytes per completed step (its time, and where its latest execution is)
    plus one entry per superseded execution.
    """

    def __init__(self) -> None:
        self._times = array("d")  # when each completed step completed, in order (never decreasing)
        self._base = 0  # the step _latest[0] is of (steps are dense from the first one seen)
        # step - _base -> index of its latest execution in _times, -1 for none
        self._latest = array("q")
        # (step, start, end, superseded at)
        self.superseded: list[tuple[int, float, float, float]] = []

    def __len__(self) -> int:
        return len(self._times)

    @property
    def first_t(self) -> float | None:
        return self._times[0] if self._times else None

    @property
    def last_t(self) -> float | None:
        return self._times[-1] if self._times else None

    def done(self, step: int, t: float) -> None:
        """Step ``step`` completed at ``t`` (a clock behind the previous completion is taken as
        equal)."""
        if self._times:
            t = max(t, self._times[-1])
        index = len(self._times)
        previous = self._index_of(step)
        if previous is not None:
            start, end = self._interval(previous)
            self.superseded.append((step, start, end, t))
        self._times.append(t)
        self._set_index(step, index)

    def _index_of(self, step: int) -> int | None:
        slot = step - self._base
        if 0 <= slot < len(self._latest) and self._latest[slot] >= 0:
            return self._latest[slot]
        return None

    def _set_index(self, step: int, index: int) -> None:
        if not self._latest:
            self._base = step
        elif step < self._base:  # (a step before the first one seen: room made in front, rarely)
            self._latest = array("q", [-1] * (self._base - step)) + self._latest
            self._base = step
        slot = step - self._base
        if slot >= len(self._latest):
            self._latest.extend([-1] * (slot + 1 - len(self._latest)))
        self._latest[slot] = index

    def _interval(self, index: int) -> tuple[float, float]:
        end = self._times[index]
        return (self._times[index - 1] if index else end), end

    def last_done_before(self, t: float) -> float | None:
        """When the newest step completed at or before ``t`` (None: none had)."""
        i = bisect_right(self._times, t)
        return self._times[i - 1] if i else None

    def execution_before(self, step: int, t: float) -> float | None:
        """When the newest execution of ``step`` that completed by ``t`` completed."""
        latest = self._index_of(step)
        if latest is not None and self._times[latest] <= t:
            return self._times[latest]
        ends = [end for s, _, end, _ in self.superseded if s == step and end <= t]
        return max(ends) if ends else None


@dataclass(frozen=True)
class Goodput:
    """The account: ``goodput_s`` plus every loss equals ``wall_s``."""

    wall_s: float
    goodput_s: float
    losses: dict[str, float]
    incidents: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.goodput_s / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratio": None if self.ratio is None else round(self.ratio, 4),
            "wall_s": round(self.wall_s, 3),
            "goodput_s": round(self.goodput_s, 3),
            "losses": {k: round(v, 3) for k, v in self.losses.items()},
            "incidents": self.incidents,
        }


@dataclass(frozen=True)
class _Piece:
    start: float
    end: float
    label: str
    priority: int
    order: int  # the incident's place (earlier wins a tie), or the stall's
    incident: int | None


def account(ledger: StepLedger, incidents: Sequence[Mapping[str, Any]], stalls: Iterable[Stall], *,
            start: float, end: float, ended: bool, folded_stall_s: float = 0.0) -> Goodput:
    """Cut [start, end] into goodput and named losses (see the module's docstring).

    ``folded_stall_s``: the stalls of older saves, given as their sum (a long
    job's manager keeps the recent ones only): each lies in a step that counts.
    """
    end = max(end, start)
    pieces = _overlays(ledger, incidents, stalls, end)
    losses = dict.fromkeys(LOSSES, 0.0)
    per_incident: dict[int, dict[str, float]] = {}
    # The base, before overlays: start-up, then the steps (counted or superseded), then the tail.
    first, last = ledger.first_t, ledger.last_t
    first = min(max(first, start), end) if first is not None else end
    last = min(max(last if last is not None else first, first), end)
    counted = max(0.0, (last - first) - sum(min(e, last) - max(s, first)
                                            for _, s, e, _ in ledger.superseded if e > s))
    losses["startup"] = first - start
    tail = "shutdown" if ended else "in_flight"
    losses[tail] = end - last
    for _, s, e, superseded_at in ledger.superseded:
        if e > s:
            losses["rerun"] += e - s
            who = _incident_before(incidents, superseded_at)
            if who is not None:
                _add(per_incident, who, "rerun", e - s)
    supers = [(s, e) for _, s, e, _ in ledger.superseded if e > s]
    for piece in _resolve(pieces, start, end):
        length = piece.end - piece.start
        in_startup = _overlap(piece.start, piece.end, start, first)
        in_tail = _overlap(piece.start, piece.end, last, end)
        in_supers = sum(_overlap(piece.start, piece.end, s, e) for s, e in supers)
        in_counted = max(0.0, _overlap(piece.start, piece.end, first, last) - in_supers)
        losses["startup"] -= in_startup
        losses[tail] -= in_tail
        losses["rerun"] -= in_supers
        counted -= in_counted
        losses[piece.label] += length
        if piece.incident is not None:
            _add(per_incident, piece.incident, piece.label, length)
    views = []
    for incident in incidents:
        spent = per_incident.get(int(incident["id"]))
        if spent:
            views.append({"id": incident["id"], "kind": incident["kind"],
                          **{f"{k}_s": round(v, 3) for k, v in spent.items()}})
    folded = min(folded_stall_s, max(0.0, counted))
    counted -= folded
    losses["checkpoint"] += folded
    return Goodput(wall_s=end - start, goodput_s=max(0.0, counted),
                   losses={k: max(0.0, v) for k, v in losses.items()}, incidents=views)


def _add(table: dict[int, dict[str, float]], incident: int, label: str, seconds: float) -> None:
    spent = table.setdefault(incident, {})
    spent[label] = spent.get(label, 0.0) + seconds


def _overlap(a: float, b: float, c: float, d: float) -> float:
    return max(0.0, min(b, d) - max(a, c))


def _incident_before(incidents: Sequence[Mapping[str, Any]], t: float) -> int | None:
    """The incident whose recovery made a step run again at ``t``: the last one that began
    before."""
    before = [i for i in incidents if i["kind"] in _STOPPING and float(i["fault_t"]) <= t]
    return int(before[-1]["id"]) if before else None


def _overlays(ledger: StepLedger, incidents: Sequence[Mapping[str, Any]], stalls: Iterable[Stall],
              end: float) -> list[_Piece]:
    pieces: list[_Piece] = []
    for order, incident in enumerate(incidents):
        pieces.extend(_incident_pieces(ledger, incident, order, end))
    for order, stall in enumerate(stalls):
        after = ledger.execution_before(stall.step, stall.t)
        if after is not None and stall.seconds > 0:
            pieces.append(_Piece(after, after + stall.seconds, "checkpoint", _STALL, order, None))
    return pieces


def _incident_pieces(ledger: StepLedger, incident: Mapping[str, Any], order: int,
                     end: float) -> list[_Piece]:
    """An incident's timeline as labelled pieces (its phases are seconds after its fault)."""
    kind, ident = incident["kind"], int(incident["id"])
    fault = float(incident["fault_t"])
    phases = {k: fault + float(v)
              for k, v in (incident.get("phases") or {}).items() if v is not None}
    if kind == "preempt":
        return [_Piece(fault, phases.get("exited", end), "preemption", _PHASE, order, ident)]
    if kind not in _STOPPING:
        return []
    open_ = incident.get("status") == "open"
    stop = phases.get("first_step_done", end if open_ else None)
    marks: list[tuple[str, float | None]] = [
        ("detection", phases.get("detected", fault)),
        ("recovery", phases.get("decided")),
        ("recovery", phases.get("checkpoint_written")),  # (a regroup's save)
    ]
    if "replacement_ready" in phases:
        marks.append(("spare_wait", phases["replacement_ready"]))
    restored = [phases[k] for k in ("replacement_ready", "group_rebuilt", "state_restored")
                if k in phases]
    # A regroup (or a whole-job restart) has its own milestones (checkpoint_written, ...): its
    # recovery runs to the last of them; with none at all, to its first step done (that step counted
    # as recovery, not work).
    others = [v for k, v in phases.items() if k not in ("detected", "decided", "first_step_done")]
    if restored:
        marks.append(("recovery", max(restored)))
    elif open_ and "decided" in phases:  # under way: waiting for the replacement, or rebuilding
        marks.append(("spare_wait" if incident.get("action") == "replace" else "recovery", end))
    elif others or stop is not None:
        marks.append(("recovery", max(others) if others else stop))
    pieces = []
    at = fault
    for label, until in marks:
        if until is None:
            continue
        until = max(until, at)
        if stop is not None:
            until = min(until, max(stop, at))
        pieces.append(_Piece(at, until, label, _PHASE, order, ident))
        at = until
    lost_from = ledger.last_done_before(fault)
    if lost_from is not None and lost_from < fault:
        pieces.append(_Piece(lost_from, fault, "rerun", _LOST, order, ident))
    return [p for p in pieces if p.end > p.start]


def _resolve(pieces: list[_Piece], start: float, end: float) -> list[_Piece]:
    """Overlapping pieces made disjoint: where several cover a moment, the highest priority
    (then earliest) wins."""
    clipped = [p for p in pieces if min(p.end, end) > max(p.start, start)]
    bounds = sorted({start, end, *(max(p.start, start) for p in clipped),
                     *(min(p.end, end) for p in clipped)})
    by_start = sorted(clipped, key=lambda p: p.start)
    # (-priority, order, end, index): a heap, stale ends skipped
    active: list[tuple[int, int, float, int]] = []
    out: list[_Piece] = []
    i = 0
    for a, b in zip(bounds, bounds[1:], strict=False):
        while i < len(by_start) and by_start[i].start <= a:
            p = by_start[i]
            heapq.heappush(active, (-p.priority, p.order, p.end, i))
            i += 1
        while active and active[0][2] <= a:
            heapq.heappop(active)
        if not active:
            continue
        # The top may have ended already under a live entry of lower rank: drop stale tops only.
        winner = by_start[active[0][3]]
        piece = _Piece(a, b, winner.label, winner.priority, winner.order, winner.incident)
        if (out and out[-1].end == a
                and (out[-1].label, out[-1].incident) == (piece.label, piece.incident)):
            out[-1] = _Piece(out[-1].start, b, piece.label, piece.priority, piece.order,
                             piece.incident)
        else:
            out.append(piece)
    return out
