"""The manager's side of ``--verify-every``:
a step that differed from its replay becomes an ``sdc`` incident.

Rank 0 reports it once (``worker.verify``), when every rank has agreed to roll
back: the step whose replay on the verifier gave another gradient fingerprint,
the rank whose step it was, the state rolled back to and how many committed
steps run again. The job trains on: the incident is recovered when reported
(the re-run steps are the job's own, logged as any step). The verifier's
other words (``verify_started``, ``verify_overdue``, ``verify_summary``,
``verify_error``) are events, logged as every report is.

Each verdict also comes on its own (``verify_result``: the step, the suspect
rank, passed or not): a quarantined host requalifies on them (``on_verified``,
the rule in ``manager.placement.hosts.HostBook.verified``).
"""

from __future__ import annotations

import logging
from typing import Any, cast

from undying.jobfiles.records import Incident, IncidentDetail, IncidentKind, IncidentStatus
from undying.manager.core import JobCore
from undying.manager.placement import LOG_KEY, HostState, host_of
from undying.protocol.worker_wire import Progress

__all__ = ["on_sdc", "on_verified", "SDC_PHASE", "VERIFIED_PHASE"]

# the worker's phase (worker.verify.SDC_PHASE): the roles share the wire, not each other
SDC_PHASE = "sdc"
VERIFIED_PHASE = "verify_result"  # one verified step's verdict (worker.verify.VERIFIED_PHASE)

log = logging.getLogger("undying.manager")


def on_sdc(core: JobCore, message: Progress) -> None:
    """Record a verification's mismatch as an ``sdc`` incident naming the rank
    (the job rolled back and goes on)."""
    detail: dict[str, Any] = dict(message.detail)
    rank = detail.get("suspect")
    incident = Incident(
        id=len(core.incidents) + 1, kind=IncidentKind.SDC,
        rank=rank if isinstance(rank, int) else -1,
        step=message.step, fault_t=message.t, recovery=0, action="rolled_back",
        status=IncidentStatus.RECOVERED,
        error=str(detail.get("summary", "")), detail=cast(IncidentDetail, detail),
    )
    incident.phases["detected"] = message.t
    # the roll-back is the recovery: the job steps on at once
    incident.phases["first_step_done"] = message.t
    core.incidents.append(incident)
    core.events.incident(incident)


def on_verified(core: JobCore, message: Progress) -> None:
    """Count a verified step for the suspect rank's host when that host is quarantined;
    clear it when requalified.

    Kept in the log at each count, so a restarted manager goes on from it.
    A message that does not name a rank and a verdict is left alone (it is
    logged as an event all the same).
    """
    rank, passed = message.detail.get("suspect"), message.detail.get("passed")
    if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(passed, bool):
        return
    host = host_of(core, rank)
    mark = core.hosts.verified(host, passed=passed, step=message.step) if host else None
    if mark is None:
        return
    if mark.state is HostState.OK:
        # ok, or drained still: an operator's drain was kept under the quarantine
        now = core.hosts.state(host)
        core.events.event("host_requalified", host=host, passes=mark.passes, steps=list(mark.steps),
                          reason=mark.reason, state=now.value)
        log.info("job %s: host %s requalified: %d steps of its ranks verified bit for bit in a row "
                 "(%s)%s",
                 core.config.job_id, host, mark.passes, mark.reason,
                 f"; it stays drained, as an operator asked, until `undying undrain {host}`"
                 if now is HostState.DRAINED else "")
    core.events.set_job(LOG_KEY, core.hosts.to_log(), flush=True)
