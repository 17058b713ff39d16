"""The manager's side of ``--verify-every``: a step that differed from its replay becomes an ``sdc`` incident.

Rank 0 reports it once (``worker.verify``), when every rank has agreed to roll
back: the step whose replay on the verifier gave another gradient fingerprint,
the rank whose step it was, the state rolled back to and how many committed
steps run again. The job trains on: the incident is recovered when reported
(the re-run steps are the job's own, logged as any step). The verifier's
other words (``verify_started``, ``verify_overdue``, ``verify_summary``,
``verify_error``) are events, logged as every report is.
"""

from __future__ import annotations

from typing import Any, cast

from undying.manager.core import JobCore
from undying.manager.state import Incident, IncidentDetail, IncidentKind, IncidentStatus
from undying.protocol.worker_wire import Progress

__all__ = ["on_sdc", "SDC_PHASE"]

SDC_PHASE = "sdc"  # the worker's phase (worker.verify.SDC_PHASE): the roles share the wire, not each other


def on_sdc(core: JobCore, message: Progress) -> None:
    """Record a verification's mismatch as an ``sdc`` incident naming the rank (the job rolled back and goes on)."""
    detail: dict[str, Any] = dict(message.detail)
    rank = detail.get("suspect")
    incident = Incident(
        id=len(core.incidents) + 1, kind=IncidentKind.SDC, rank=rank if isinstance(rank, int) else -1,
        step=message.step, fault_t=message.t, recovery=0, action="rolled_back", status=IncidentStatus.RECOVERED,
        error=str(detail.get("summary", "")), detail=cast(IncidentDetail, detail),
    )
    incident.phases["detected"] = message.t
    incident.phases["first_step_done"] = message.t  # the roll-back is the recovery: the job steps on at once
    core.incidents.append(incident)
    core.events.incident(incident)
