"""A job in its script's own terms when the script has no steps: its whole-group restarts, and why.

A script that never calls ``job.steps`` (a torchrun script run unchanged)
commits no step, so a step count, a goodput and re-run steps say nothing of it
("step 0", "0.0%"). What it has is its wall time and torchrun's recovery: on a
fault every rank starts again from the script's start (``manager.recovery``'s
whole-group restart). Pure: from the incidents as ``Incident.to_dict`` gives
them (live from the manager, or read back from the log), one ``Round`` per
recovery round, so ``undying run``'s end summary and ``undying status`` say the
same thing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["has_steps", "Round", "rounds", "recovered"]


def has_steps(*, step_api: bool, planned: bool, committed: bool) -> bool:
    """Whether the job has steps to count: the script uses the step API (the launcher saw it import
    undying, or a rank said hello), its loop reported its plan, or a rank committed a step."""
    return step_api or planned or committed


def recovered(incidents: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The incidents the job recovered from: one meaning of "recovered" for every summary (the
    status the manager settled them with; a whole-group restart's has no MTTR, it is recovered
    all the same)."""
    return [i for i in incidents if i.get("status") == "recovered"]


@dataclass(frozen=True)
class Round:
    """One recovery round: the faults that opened it and what became of them.

    ``restart``: the number of the whole-group restart it made (1 for the
    first), None when it made none (the job failed instead, or it is still
    being handled). ``after_s``: from its first fault to every rank's new
    process started. ``t``: when its first fault happened (unix seconds).
    """

    incidents: tuple[Mapping[str, Any], ...]
    restart: int | None
    after_s: float | None
    t: float

    @property
    def status(self) -> str:
        """``recovered`` (every rank started again), ``failed``, or ``open`` (being handled)."""
        statuses = {str(i.get("status")) for i in self.incidents}
        for status in ("open", "failed"):
            if status in statuses:
                return status
        return "recovered" if self.restart is not None else next(iter(sorted(statuses)), "open")


def rounds(incidents: Sequence[Mapping[str, Any]]) -> list[Round]:
    """The recovery rounds of ``incidents``, oldest first (an incident reported only, of no round,
    is none)."""
    grouped: dict[int, list[Mapping[str, Any]]] = {}
    for incident in incidents:
        round_id = int(incident.get("recovery") or 0)
        if round_id > 0:
            grouped.setdefault(round_id, []).append(incident)
    found = []
    for members in grouped.values():
        restart, after = None, None
        for incident in members:
            detail = incident.get("detail") or {}
            if detail.get("restart") is not None and incident.get("action") == "restart":
                restart = int(detail["restart"])
                ready = (incident.get("phases") or {}).get("replacement_ready")
                after = float(ready) if ready is not None else None
        first = min(float(i.get("fault_t") or 0.0) for i in members)
        found.append(Round(tuple(members), restart, after, first))
    return sorted(found, key=lambda r: r.t)
