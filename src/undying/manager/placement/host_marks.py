"""A host as the job sees it: where a rank or a node runs, and a fault policy taking a host out
(quarantine) until it requalifies or an operator puts it back."""

from __future__ import annotations

import logging
import time
from typing import Any

from undying.errors import UsageError
from undying.manager.core import JobCore
from undying.manager.placement.hosts import LOG_KEY, REQUALIFY_PASSES

__all__ = ["quarantine", "host_of", "node_host", "UNTIL"]

log = logging.getLogger("undying.manager")


def quarantine(core: JobCore, *, reason: str, rank: int | None = None, host: str | None = None,
               by: str = "numerics") -> dict[str, Any]:
    """Quarantine a host, named or as the one ``rank`` runs on, with the fault policy's ``reason``.

    The one call a fault policy makes (``manager.integrity.numerics``: a rank found at
    fault twice): the host gets no new ranks until an operator runs
    ``undying undrain HOST``; recorded as ``host_quarantined`` and kept in the
    log. Its ranks train on: moving them is the operator's call (``drain``).
    """
    if host is None:
        if rank is None or rank not in core.ranks:
            raise UsageError(f"quarantine needs a host or a rank of this job, got rank {rank!r}")
        host = host_of(core, rank)
    mark = core.hosts.quarantine(host, reason=reason, by=by, t=time.time())
    core.events.event("host_quarantined", **mark.to_dict(), until=UNTIL)
    core.events.set_job(LOG_KEY, core.hosts.to_log(), flush=True)
    log.warning("job %s: host %s quarantined: %s; %s", core.config.job_id, host, mark.reason, UNTIL)
    return {"host": host, "state": mark.state.value, "reason": mark.reason}


# What clears a quarantined host (manager.placement.hosts.HostBook.verified,
# manager.integrity.verification.on_verified).
UNTIL = (f"no new ranks there until it requalifies ({REQUALIFY_PASSES} steps of its ranks verified "
         "bit for bit in a row, only in a job run with --verify-every) or an operator runs "
         "`undying undrain HOST`")


def host_of(core: JobCore, rank: int) -> str:
    """The host ``rank`` runs on, as its node's agent said it ("" when unknown, e.g. a single-node
    job)."""
    info = core.ranks.get(rank)
    return node_host(core, info.node) if info is not None else ""


def node_host(core: JobCore, node: int) -> str:
    """The host ``node``'s agent said it runs on ("" when the node has no agent)."""
    agent = core.agents.get(node)
    return str(agent.view().get("host", "")) if agent is not None else ""
