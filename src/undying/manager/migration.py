"""Planned moves: a rank migrated to another process at a step boundary, hosts drained and put back.

An operator moves a rank off a process before it fails (``undying migrate
--rank R``): the rank is armed to leave at the start of a step, when its last
step is committed and nothing of the next is begun. It exits with
``EXIT_MIGRATED``; this module expects that exit and turns it into a planned
``migration`` incident whose action is the recovery's replacement: the next
generation, a warm spare (or a new process) for the rank, which takes the
committed state from a peer. The peers are told to leave the old generation at
once (they wait in the next step's first collective, which the leaving rank
never joined, so no rank completed it), and every rank runs that step once.
No step is re-run to completion, no state is lost, and the losses are those
of the run without the move (``tests/integration/test_migrate.py``). The
incident carries the timeline (planned, detected, decided, replacement ready,
group rebuilt, state restored, first step done): the stall is the time from
the exit to the first step done.

Hosts: ``drain`` marks a host drained in the one host book (``hosts.py``,
shared with a fault policy's quarantine) and refuses with the reason when a
rank of the job still runs there and there is nowhere to move it; ``undrain``
puts a drained or quarantined host back. Each change is an event and a job
fact in the log, so a restarted manager keeps it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from undying.config import EXIT_MIGRATED
from undying.errors import UsageError
from undying.manager.core import JobCore
from undying.manager.detection import Detection
from undying.manager.hosts import LOG_KEY, HostBook, HostMark, check_host
from undying.manager.policy import Action, Decision
from undying.manager.recovery import Recoveries
from undying.manager.state import IncidentKind, JobState, RankInfo, RankState
from undying.protocol.worker_wire import ArmFault

__all__ = ["Migrations", "LEAD_STEPS", "MOVE_EXAMPLES", "request_move"]

log = logging.getLogger("undying.manager")

# How many steps past the newest committed one the boundary is set: every rank hears the arming
# before it begins the boundary's next step (a late one leaves at the step after: still a boundary).
LEAD_STEPS = 2


# What each POST of the HTTP API takes (manager/http.py): its body's example, for the errors.
MOVE_EXAMPLES = {"migrate": '{"rank": 1, "to": "HOST"}', "drain": '{"host": "HOST"}', "undrain": '{"host": "HOST"}'}
_MAX_RANK = 1 << 20


def request_move(migrations: Migrations, what: str, body: dict[str, Any], by: str) -> dict[str, Any]:
    """``POST /api/<what>`` with its JSON body, checked whole before anything is done; UsageError names the field."""
    example = MOVE_EXAMPLES[what]
    if what == "migrate":
        rank, to = body.get("rank"), body.get("to")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= _MAX_RANK:
            raise UsageError(f'migrate needs a "rank" (a whole number from 0), got {str(rank)[:40]!r}; e.g. {example}')
        if to is not None and not isinstance(to, str):
            raise UsageError(f'"to" must be a host name (a string), got {str(to)[:40]!r}; e.g. {example}')
        return migrations.migrate(rank, to, by=by)
    host = body.get("host")
    if not isinstance(host, str):
        raise UsageError(f'{what} needs a "host" (a string), got {str(host)[:40]!r}; e.g. {example}')
    if what == "drain":
        return migrations.drain(host, by=by, reason=str(body.get("reason") or "")[:500])
    return migrations.undrain(host, by=by)


@dataclass(frozen=True)
class _Pending:
    rank: int
    pid: int
    boundary: int  # the last step the rank commits before it leaves
    host: str
    to: str
    by: str
    t: float  # when it was armed: the incident's "planned" time


class Migrations:
    """The planned moves of one job: armed ranks waiting for their boundary, and the host book."""

    def __init__(self, core: JobCore, recoveries: Recoveries, detection: Detection, *, busy: Any) -> None:
        self.core = core
        self.recoveries = recoveries
        self.detection = detection
        self._busy = busy  # () -> str: why the job cannot move a rank now ("" when it can), e.g. a regroup
        self.pending: dict[int, _Pending] = {}  # pid -> the move it is armed for

    @property
    def hosts(self) -> HostBook:
        return self.core.hosts

    def host_of(self, node: int) -> str:
        agent = self.core.agents.get(node)
        return str(agent.view().get("host", "")) if agent is not None else ""

    # --- the operator's commands ----------------------------------------------------

    def migrate(self, rank: int, to: str | None, *, by: str = "api") -> dict[str, Any]:
        """Arm ``rank`` to leave at the next boundary, for a warm spare of its node (``to``: that node's host)."""
        core = self.core
        if rank not in core.ranks:
            raise UsageError(f"rank {rank} does not exist; this job has ranks 0..{core.book.world_size - 1}")
        info = core.ranks[rank]
        why = self._why_not_now(info)
        if why:
            raise UsageError(f"cannot migrate rank {rank} now: {why}")
        host = self.host_of(info.node)
        target = host if to is None or to in (host, "localhost") else check_host(to)
        if target != host:
            raise UsageError(
                f"rank {rank} runs on node {info.node} (host {host}); a rank moves to a warm spare of its own "
                f"node (leave --to out, or give --to {host}); to take host {host} out, drain it "
                f"(`undying drain {host}`) with a standby agent parked elsewhere")
        if self.hosts.blocked(host):
            raise UsageError(f"host {host} is {self.hosts.state(host).value}: it gets no new ranks; "
                             f"`undying undrain {host}` first")
        boundary = max(info.step, core.book.newest_step()) + LEAD_STEPS
        now = time.time()
        pending = _Pending(rank, info.pid, boundary, host, target, by, now)
        self.pending[info.pid] = pending
        core.agents[info.node].arm(rank, ArmFault(kind="migrate", at_step=boundary + 1, phase="step"))
        spares = core.agents[info.node].spares_ready()
        core.events.event("migration_planned", rank=rank, pid=info.pid, boundary=boundary, host=host, to=target,
                          by=by, spares_ready=spares)
        log.info("job %s: rank %d (pid %d) moves to a %s on %s after step %d", core.config.job_id, rank,
                 info.pid, "warm spare" if spares else "new process", target, boundary)
        return {"migrating": rank, "pid": info.pid, "from": host, "to": target, "boundary_step": boundary,
                "replacement": "warm spare" if spares else "new process"}

    def drain(self, host: str, *, by: str = "api", reason: str = "") -> dict[str, Any]:
        """Mark ``host`` drained; refused, with nothing changed, while a rank of the job runs there."""
        check_host(host)
        on_host = sorted(r.rank for r in self.core.ranks.values()
                         if r.state not in (RankState.EXITED, RankState.DONE) and self.host_of(r.node) == host)
        if on_host:
            nodes = sorted({self.core.ranks[r].node for r in on_host})
            raise UsageError(
                f"host {host} runs rank(s) {', '.join(map(str, on_host))} of node(s) {', '.join(map(str, nodes))} "
                f"and there is nowhere to move them: every other host is full, and moving a whole node to a "
                f"standby is not done by drain yet; stop the job or let it finish, then drain {host}")
        mark = self.hosts.drain(host, by=by, reason=reason, t=time.time())
        self._record("host_drained", mark)
        return {"host": host, "state": mark.state.value, "reason": mark.reason, "moved": []}

    def quarantine(self, host: str, reason: str, *, by: str = "numerics") -> dict[str, Any]:
        """A fault policy takes ``host`` out (e.g. a rank there found at fault twice): no new ranks there."""
        mark = self.hosts.quarantine(host, reason=reason, by=by, t=time.time())
        self._record("host_quarantined", mark)
        log.warning("job %s: host %s quarantined: %s", self.core.config.job_id, host, mark.reason)
        return {"host": host, "state": mark.state.value, "reason": mark.reason}

    def undrain(self, host: str, *, by: str = "api") -> dict[str, Any]:
        """Put a drained or quarantined host back (the one clear surface for both)."""
        mark = self.hosts.clear(host)
        if mark is None:
            raise UsageError(f"host {host} is not drained or quarantined; nothing to undrain "
                             f"(`undying status` lists the hosts that are)")
        self.core.events.event("host_cleared", host=host, was=mark.state.value, by=by)
        self.core.events.set_job(LOG_KEY, self.hosts.to_log(), flush=True)
        return {"host": host, "state": "ok", "was": mark.state.value}

    def restore(self, logged: object) -> None:
        """A restarted manager's host book, read back from the log."""
        self.core.hosts = HostBook.from_log(logged)

    # --- the planned exit ---------------------------------------------------------

    def on_exit(self, info: RankInfo, pid: int, returncode: int, t: float) -> bool:
        """True when this exit was a planned migration's, now carried out as a replacement."""
        pending = self.pending.pop(pid, None)
        if pending is None:
            return False
        if returncode != EXIT_MIGRATED:  # it died before its boundary: a fault like any other
            self.core.events.event("migration_failed", rank=pending.rank, pid=pid, returncode=returncode)
            return False
        core = self.core
        self.detection.injected.pop(info.rank, None)  # (its "migrate" report is no fault to time a crash from)
        incident = self.recoveries.new_incident(kind=IncidentKind.MIGRATION, rank=info.rank, step=info.step,
                                                fault_t=t, detected_t=t,
                                                error=f"planned: rank {info.rank} moved from pid {pid} on "
                                                      f"{pending.host} (by {pending.by})")
        incident.phases["decided"] = time.time()
        incident.detail["migration"] = {"planned_t": pending.t, "boundary_step": info.step, "from": pending.host,
                                        "to": pending.to, "by": pending.by, "pid": pid}
        incident.action = "migrate"
        core.events.event("decided", rank=info.rank, incident=incident.id, action="migrate",
                          reason="planned migration")
        core.move(JobState.RECOVERING)
        previous = core.generations.current
        self.recoveries.execute(incident, Decision(Action.REPLACE, "planned migration"))
        for peer in core.ranks.values():  # they wait in a collective the leaving rank never joins
            if peer.rank != info.rank and peer.state is not RankState.EXITED:
                core.agents[peer.node].abort(peer.rank, previous, f"rank {info.rank} migrated")
        core.events.incident(incident)
        return True

    # --- helpers ------------------------------------------------------------------

    def _why_not_now(self, info: RankInfo) -> str:
        core = self.core
        if core.state is not JobState.RUNNING:
            return f"the job is {core.state.value} (a move starts only while it trains undisturbed)"
        if self.recoveries.current is not None:
            return "a recovery is under way; try again once `undying status` shows the job running"
        if not self.recoveries.step_api:
            return "the script does not use undying's step API, so no step boundary can be agreed"
        busy = self._busy()
        if busy:
            return busy
        if info.state in (RankState.EXITED, RankState.DONE) or not info.pid:
            return f"rank {info.rank} has no running process ({info.state.value})"
        if any(p.rank == info.rank for p in self.pending.values()):
            return f"rank {info.rank} is already being moved"
        return ""

    def _record(self, what: str, mark: HostMark) -> None:
        self.core.events.event(what, **mark.to_dict())
        self.core.events.set_job(LOG_KEY, self.hosts.to_log(), flush=True)
