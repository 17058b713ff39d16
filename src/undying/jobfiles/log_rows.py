"""The event log's rows as Python reads them: a commit, an event, what a restarted manager reads
back.

``events`` (the one module that speaks SQL) writes and reads them; these say
what a row holds and how a rank's and an incident's rows turn back into
records (a commit's row: ``step_rows``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from undying.jobfiles.records import Incident, RankInfo, RankState

__all__ = ["Commit", "LoggedEvent", "SavedJob", "rank_from_row", "incident_from_row"]


@dataclass(frozen=True)
class Commit:
    """One rank's commit of one step, as logged (a step re-run after a fault is logged again)."""

    rank: int
    step: int
    generation: int
    t: float
    metrics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "generation": self.generation, "t": self.t,
                "metrics": self.metrics}


@dataclass(frozen=True)
class LoggedEvent:
    """One row of the events table: what happened, when, to which rank, with its details."""

    id: int
    t: float
    generation: int | None
    rank: int | None
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True)
class SavedJob:
    """What a restarted manager reads back to carry on the job (``EventLog.saved_job``).

    ``facts`` is the job table (state, generation, layout, sessions, ...);
    ``ranks`` each rank as last written, by rank (a row is not rewritten per
    step: ``newest_steps`` says how far each rank got); ``incidents`` every
    incident as last written, oldest first, its phases absolute times again.
    """

    facts: dict[str, Any]
    ranks: list[RankInfo]
    newest_steps: dict[int, int]  # rank -> the newest step it committed
    incidents: list[Incident]
    # What the step clock is fed again (progress, goodput): every commit (rank, step, time) in time
    # order, read as it is taken (once: the log is not held in memory), and the plan and checkpoint
    # reports (kind, time, data) in order.
    commits: Iterable[tuple[int, int, float]] = ()
    reports: list[tuple[str, float, dict[str, Any]]] = dataclasses.field(default_factory=list)


def rank_from_row(view: dict[str, Any]) -> RankInfo:
    """The inverse of ``RankInfo.to_dict`` (what ``EventLog.rank`` is given to write)."""
    return RankInfo(rank=int(view["rank"]), node=int(view["node"]), pid=int(view["pid"]),
                    state=RankState(view["state"]), step=int(view["step"]),
                    generation=int(view["generation"]),
                    restarts=int(view["restarts"]), last_seen=float(view["last_seen"]),
                    incarnation=int(view.get("incarnation", 0)))


def incident_from_row(view: dict[str, Any]) -> Incident:
    """The inverse of ``Incident.to_dict`` (what ``EventLog.incident`` writes): phases back to
    absolute times."""
    return Incident(id=view["id"], kind=view["kind"], rank=view["rank"], step=view["step"],
                    fault_t=view["fault_t"], recovery=view["recovery"], action=view["action"],
                    status=view["status"],
                    phases={k: view["fault_t"] + v for k, v in view["phases"].items()},
                    error=view["error"], traceback=view["traceback"], detail=view["detail"])
