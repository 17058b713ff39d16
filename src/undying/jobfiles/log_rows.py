"""The event log's rows as Python reads them: a commit, an event, what a restarted manager reads
back.

``events`` (the one module that speaks SQL) writes and reads them; these say
what a row holds and how a rank's and an incident's rows turn back into
records, and how a commit's metrics are kept as JSON text.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from undying.jobfiles.records import Incident, RankInfo, RankState

__all__ = ["Commit", "LoggedEvent", "SavedJob", "rank_from_row", "incident_from_row",
           "metrics_json"]


_ENCODE_JSON = msgspec.json.Encoder().encode


def metrics_json(metrics: Mapping[str, float | str]) -> str:
    """A commit's metrics as the steps table keeps them (JSON text), on the path of every rank's
    every step.

    msgspec writes it 30x faster than ``json.dumps``; but it writes NaN and
    infinities as null, and a NaN loss must read back as NaN (the oracle
    compares losses), so those rare rows take ``json.dumps``, which keeps them.
    """
    if all(not isinstance(v, str) and math.isfinite(v) for v in metrics.values()):
        return _ENCODE_JSON(metrics).decode()
    # ("inf", "nan": how the wire carries them)
    return json.dumps({k: float(v) for k, v in metrics.items()})


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
    step: ``committed`` says how far each rank got); ``incidents`` every
    incident as last written, oldest first, its phases absolute times again.
    """

    facts: dict[str, Any]
    ranks: list[RankInfo]
    committed: dict[int, set[int]]
    incidents: list[Incident]
    # What the step clock is fed again (progress, goodput): every commit (rank, step, time) in time
    # order, and the plan and checkpoint reports (kind, time, data) in order.
    commits: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
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
