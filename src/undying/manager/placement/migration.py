"""Planned moves: a rank migrated to another process at a step boundary, hosts drained and put back.

An operator moves a rank off a process before it fails (``undying migrate
--rank R``). Its replacement starts at once, on a warm spare of its node, into
the generation the move will open, and waits there while the rank trains on.
The rank is armed to leave at the start of a step (the boundary: its last
step committed, nothing of the next begun), far enough ahead for the
replacement to be ready. There it says so (a ``FaultInjected`` of kind
``migrate``) and exits with ``EXIT_MIGRATED``; this module opens the
generation as a planned ``migration`` incident of the recovery's round and
tells the peers to leave the old one at once (they wait in the next step's
first collective, which the leaving rank never joined, so no rank completed
it). They meet the replacement, which takes the committed state from a peer,
and every rank runs that step once. No step is re-run to completion, no
state is lost, and the losses are those of the run without the move
(``tests/integration/test_migrate.py``). The incident carries the timeline
(detected at the boundary, the replacement ready before it, the group
rebuilt, the state restored, the first step done): the stall. A fault before
the boundary (a recovery round opening, or the moving process's own exit)
cancels the move: the old process, perhaps the last holder of the rank's
state, keeps the rank and is never fenced; the replacement started ahead is
killed (``migration_failed``, with the reason).

A whole node moves (``--node N --to HOST``, and ``drain``) to a standby agent
parked on the target: every rank of the node leaves at one boundary; at the
first one's exit the node's old agent is told it is done and let go, every
rank of the node is replaced in one new generation, and the standby is given
the node's number as it would be for a lost node.

Hosts: the one host book (``hosts.py``) says which hosts are drained (by an
operator) or quarantined (by a fault policy: ``quarantine``); such a host
gets no new ranks until ``undrain``. Each change is an event and a job fact
in the log, so a restarted manager keeps it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from undying.config import EXIT_MIGRATED
from undying.errors import UsageError
from undying.jobfiles.records import Incident, IncidentKind, JobState, RankInfo, RankState
from undying.manager.core import JobCore
from undying.manager.placement.host_marks import node_host, quarantine
from undying.manager.placement.hosts import LOG_KEY, HostBook, check_host, check_job_host
from undying.manager.placement.moves import LEAD_STEPS, PendingMove, boundary_step
from undying.manager.placement.standby_seats import parked_hosts, place_on, standby_on
from undying.manager.recovery import Action, Decision, Detection, Recoveries, describe_exit
from undying.protocol.generations import GenerationRecord
from undying.protocol.node_wire import JobEnded
from undying.protocol.worker_wire import ArmFault, FaultInjected

if TYPE_CHECKING:
    from undying.manager.nodes import AgentServer

__all__ = ["Migrations"]

log = logging.getLogger("undying.manager")


class Migrations:
    """The planned moves of one job: armed ranks waiting for their boundary, and the host book."""

    def __init__(self, core: JobCore, recoveries: Recoveries, detection: Detection, *,
                 busy: Any) -> None:
        self.core = core
        self.recoveries = recoveries
        self.detection = detection
        # () -> str: why the job cannot move a rank now ("" when it can), e.g. a regroup
        self._busy = busy
        self.pending: dict[int, PendingMove] = {}  # pid -> the move it is armed for
        # the agents' server (a multi-node job): standbys, slots
        self.server: AgentServer | None = None
        # a recovery before a rank's boundary cancels its move
        recoveries.round_opened.append(self._overtaken)

    @property
    def hosts(self) -> HostBook:
        return self.core.hosts

    def host_of(self, node: int) -> str:
        return node_host(self.core, node)

    # --- the operator's commands ----------------------------------------------------

    def migrate(self, rank: int, to: str | None, *, by: str = "api") -> dict[str, Any]:
        """Arm ``rank`` to leave at the next boundary, for a warm spare of its node (``to``: that
        node's host)."""
        core = self.core
        if rank not in core.ranks:
            raise UsageError(
                f"rank {rank} does not exist; this job has ranks 0..{core.book.world_size - 1}")
        info = core.ranks[rank]
        why = self._why_not_now(info)
        if why:
            raise UsageError(f"cannot migrate rank {rank} now: {why}")
        host = self.host_of(info.node)
        target = host if to is None or to in (host, "localhost") else check_host(to)
        if target != host and sum(1 for r in core.ranks.values() if r.node == info.node) == 1:
            # the node's one rank: the node moves
            return self.migrate_node(info.node, target, by=by)
        if target != host:
            raise UsageError(
                f"rank {rank} runs on node {info.node} (host {host}) with other ranks; one of them "
                f"moves to a warm spare of its own node (leave --to out, or give --to {host}), or "
                f"the whole node moves to a standby on {target} (`undying migrate --node "
                f"{info.node} --to {target}`)")
        if refused := self.hosts.refusal(host):
            raise UsageError(refused)
        old_pid, agent = info.pid, core.agents[info.node]
        holder = (info.incarnation, info.state, info.generation, info.restarts)
        spares = agent.spares_ready()
        boundary = boundary_step(core, max(info.step, core.book.newest_step()), warm=spares > 0)
        now = time.time()
        # (before the spawn: the old one)
        agent.arm(rank, ArmFault(kind="migrate", at_step=boundary + 1, phase="step"))
        # The replacement starts now, while the rank trains on: it waits for the generation the
        # boundary opens.
        generations = core.generations
        ahead = GenerationRecord(generation=generations.current + 1,
                                 world_size=core.book.world_size,
                                 store_host=generations.host, store_port=generations.store_port(),
                                 reason=f"migration of rank {rank} (opened at the boundary)")
        # (a node across the network says later)
        warm = core.spawn(rank, ahead, joining=True) or spares > 0
        self.pending[old_pid] = PendingMove(rank, old_pid, boundary, host, target, by, now,
                                            generation=ahead.generation, warm=warm, holder=holder)
        core.events.event("migration_planned", rank=rank, pid=old_pid, boundary=boundary, host=host,
                          to=target, by=by, replacement="warm spare" if warm else "new process")
        log.info("job %s: rank %d (pid %d) moves to a %s on %s after step %d", core.config.job_id,
                 rank, old_pid, "warm spare" if warm else "new process", target, boundary)
        return {"migrating": rank, "pid": old_pid, "from": host, "to": target,
                "boundary_step": boundary, "replacement": "warm spare" if warm else "new process"}

    def migrate_node(self, node: int, to: str | None, *, by: str = "api") -> dict[str, Any]:
        """Arm every rank of ``node`` to leave at the next boundary; a standby parked on ``to``
        takes the node."""
        core = self.core
        if node not in core.agents or node not in core.book.nodes:
            raise UsageError(f"node {node} is not a node of this job; it trains on nodes "
                             f"{', '.join(map(str, core.book.nodes))}")
        ranks = [r for r in core.ranks.values() if r.node == node]
        for info in ranks:
            why = self._why_not_now(info)
            if why:
                raise UsageError(f"cannot move node {node} now: {why}")
        host = self.host_of(node)
        standby = standby_on(self.server, self.hosts, to, avoid={host})
        boundary = max(max(r.step for r in ranks), core.book.newest_step()) + LEAD_STEPS
        now = time.time()
        for info in ranks:
            self.pending[info.pid] = PendingMove(info.rank, info.pid, boundary, host, standby, by,
                                                 now, node=node)
            core.agents[node].arm(info.rank, ArmFault(kind="migrate", at_step=boundary + 1,
                                                      phase="step"))
        core.events.event("migration_planned", node=node, ranks=[r.rank for r in ranks],
                          boundary=boundary, host=host, to=standby, by=by)
        log.info("job %s: node %d (%s) moves to the standby on %s after step %d",
                 core.config.job_id, node, host, standby, boundary)
        return {"migrating_node": node, "ranks": [r.rank for r in ranks], "from": host,
                "to": standby, "boundary_step": boundary, "replacement": "standby agent"}

    def drain(self, host: str, *, by: str = "api", reason: str = "") -> dict[str, Any]:
        """Mark ``host`` drained and move every node of the job on it to a standby parked elsewhere.

        Refused, with nothing changed, when there are fewer standbys (not on a
        drained or quarantined host) than nodes to move.
        """
        check_job_host(host, [*map(self.host_of, self.core.agents), *parked_hosts(self.server),
                              *self.hosts.blocked_hosts()],
                       others_may_join=self.server is not None)
        nodes = sorted({r.node for r in self.core.ranks.values()
                        if r.state not in (RankState.EXITED, RankState.DONE)
                        and self.host_of(r.node) == host})
        free = [h for h in parked_hosts(self.server) if h != host and not self.hosts.blocked(h)]
        if len(free) < len(nodes):
            raise UsageError(
                f"host {host} runs node(s) {', '.join(map(str, nodes))} of the job and there is "
                f"nowhere to move {'them' if len(nodes) > 1 else 'it'}: {len(free)} standby "
                "agent(s) parked on other hosts (`undying run --standby ...` on a host that is not "
                f"drained); start one, or stop the job, then drain {host}")
        for info in self.core.ranks.values():  # checked whole first: a refusal changes nothing
            if info.node in nodes and (why := self._why_not_now(info)):
                raise UsageError(f"cannot drain host {host} now: {why}")
        mark = self.hosts.drain(host, by=by, reason=reason, t=time.time())
        self._record("host_drained", mark.to_dict())
        moved = [self.migrate_node(node, free[i], by=by) for i, node in enumerate(nodes)]
        return {"host": host, "state": mark.state.value, "reason": mark.reason, "moved": moved}

    def quarantine(self, host: str, reason: str, *, by: str = "numerics") -> dict[str, Any]:
        """A fault policy takes ``host`` out (e.g. a rank there found at fault twice): no new ranks
        there."""
        return quarantine(self.core, host=host, reason=reason, by=by)

    def undrain(self, host: str, *, by: str = "api") -> dict[str, Any]:
        """Put a drained or quarantined host back (the one clear surface for both)."""
        mark = self.hosts.clear(host)
        if mark is None:
            raise UsageError(f"host {host} is not drained or quarantined; nothing to undrain "
                             f"(`undying status` lists the hosts that are)")
        self._record("host_cleared", {"host": host, "was": mark.state.value, "by": by})
        return {"host": host, "state": "ok", "was": mark.state.value}

    def restore(self, logged: object) -> None:
        """A restarted manager's host book, read back from the log."""
        self.core.hosts = HostBook.from_log(logged)

    # --- the planned exit ---------------------------------------------------------

    def on_exit(self, info: RankInfo, pid: int, returncode: int, t: float) -> bool:
        """True when this exit was a planned migration's, now carried out as a replacement."""
        pending = self.pending.get(pid)
        if pending is None or pending.node is None:  # (a moved rank's old process: see before_exit)
            return False
        del self.pending[pid]
        if returncode != EXIT_MIGRATED:  # it died before its boundary: a fault like any other
            self.core.events.event("migration_failed", rank=pending.rank, pid=pid,
                                   returncode=returncode)
            return False
        core = self.core
        previous = core.generations.current
        core.move(JobState.RECOVERING)
        self._move_node(info, pending, t)
        for peer in core.ranks.values():  # they wait in a collective the leaving rank never joins
            if peer.state is not RankState.EXITED and peer.generation <= previous:
                core.agents[peer.node].abort(peer.rank, previous, f"rank {info.rank} migrated")
        return True

    def before_exit(self, pid: int, returncode: int) -> None:
        """Any process's exit, before it is judged: a moving rank's old process that ended before
        its boundary cancels the move (the rank is that process's again, so its exit is the rank's
        fault, handled as such)."""
        pending = self.pending.get(pid)
        # (EXIT_MIGRATED: it left at its boundary, and said so on its channel, which may be read
        # after this)
        if pending is not None and pending.node is None and returncode != EXIT_MIGRATED:
            self._cancel(pending, f"rank {pending.rank}'s process {pid} "
                                  f"{describe_exit(returncode)} before the move's boundary (step "
                                  f"{pending.boundary}); its exit is handled as the fault it is")

    def _overtaken(self, incident: Incident) -> None:
        """A recovery round opens while ranks wait for their boundaries: each move is cancelled
        first.

        The rank's old process holds its state (perhaps the last one that
        does: every other holder may be the fault), so the rank is given back
        to it (its owner key, its process) and the replacement started ahead
        is killed; the old process stays at its boundary (worker.commands). The
        recovery then plans with the old process as the rank's holder.
        """
        why = (f"a recovery took the job on first ({incident.kind} of rank {incident.rank} at step "
               f"{incident.step})")
        for pending in [p for p in self.pending.values() if p.node is None]:
            self._cancel(pending, f"{why} before the move's boundary (step {pending.boundary}); "
                                  f"rank {pending.rank} stays on pid {pending.pid}")
        for node in sorted({p.node for p in self.pending.values() if p.node is not None}):
            # A whole node's move: its ranks stay too (worker.commands); nothing was started ahead
            # for it.
            ranks = sorted(p.rank for p in self.pending.values() if p.node == node)
            self.pending = {pid: p for pid, p in self.pending.items() if p.node != node}
            self.core.events.event("migration_failed", node=node, ranks=ranks, returncode=None,
                                   reason=f"{why} before the move's boundary; node {node} stays "
                                          "where it is (move it again once the job runs)")

    def _cancel(self, pending: PendingMove, reason: str) -> None:
        """A rank's move is off: the rank is its old process's again, the replacement started ahead
        is killed."""
        del self.pending[pending.pid]
        core = self.core
        info = core.ranks[pending.rank]
        ahead = info.pid
        assert pending.holder is not None
        info.incarnation, info.state, info.generation, info.restarts = pending.holder
        info.pid = pending.pid
        # (the one started ahead is fenced, not it)
        core.generations.set_owner(info.rank, info.incarnation)
        core.book.persist(info)
        # the node's newest process of the rank: the one started ahead (agent: the old one is the
        # rank's worker again once it is gone)
        core.kill(info.rank)
        core.events.event("migration_failed", rank=pending.rank, pid=pending.pid, returncode=None,
                          replacement_pid=ahead, reason=reason)
        log.warning("job %s: the move of rank %d is cancelled: %s", core.config.job_id,
                    pending.rank, reason)

    def on_spawned(self, rank: int, warm: bool) -> None:
        """A node across the network says what it started for ``rank``: a moved rank's replacement's
        kind."""
        for pending in self.pending.values():
            if pending.rank == rank and pending.node is None:
                pending.warm = warm

    def on_hello(self, rank: int, t: float) -> None:
        """A process of ``rank`` said hello: a moved rank's replacement is ready (its old process
        said it long ago)."""
        for pending in self.pending.values():
            if pending.rank == rank and pending.node is None and not pending.ready_t:
                pending.ready_t = t

    def on_left(self, message: FaultInjected) -> bool:
        """A moved rank says it leaves at its boundary: open the generation its replacement waits
        for.

        The old process exits right after saying so (its exit is old news: the
        rank is the replacement's); the peers, waiting in the next step's first
        collective, are told to leave the old generation. A move cancelled
        since (a recovery overtook it) is not carried out: the process stays.
        """
        pending = next((p for p in self.pending.values() if p.rank == message.rank
                        and p.node is None), None)
        core = self.core
        if pending is None:
            if any(p.rank == message.rank for p in self.pending.values()):
                return False  # (a whole node's move: its ranks' exits carry it out)
            # A move cancelled since (a recovery overtook it): the process stays at its boundary
            # (worker.commands).
            core.events.event("fault_injected", rank=message.rank, kind=message.kind,
                              step=message.step, phase=message.phase, cancelled=True)
            return True
        del self.pending[pending.pid]
        core.events.event("fault_injected", rank=message.rank, kind=message.kind, step=message.step,
                          phase=message.phase)
        previous, info, now = core.generations.current, core.ranks[message.rank], time.time()
        core.move(JobState.RECOVERING)
        incident = self._incident(info, pending, message.t, now, step=message.step - 1)
        record = core.open_generation(f"migration of rank {info.rank}: replace")
        recovery = self.recoveries.current
        assert recovery is not None
        recovery.renew(record.generation)
        recovery.replaced.add(info.rank)
        if pending.ready_t:  # the replacement said hello before the boundary: ready and waiting
            recovery.ready[info.rank] = pending.ready_t
        incident.detail["replacement"] = "warm spare" if pending.warm else "new process"
        core.events.incident(incident)
        # The peers wait in a collective the leaving rank never joins: told to leave it
        # (recovery.rounds), and one that never does is judged stuck like any survivor.
        self.recoveries.tell_to_leave(previous, f"rank {info.rank} migrated", abort=True)
        return True

    def _incident(self, info: RankInfo, pending: PendingMove, t: float, now: float, *,
                  step: int) -> Incident:
        """The planned ``migration`` incident of a rank that left at its boundary (``step``)."""
        # (its "migrate" report is no fault to time a crash from)
        self.detection.injected.pop(info.rank, None)
        incident = self.recoveries.new_incident(kind=IncidentKind.MIGRATION, rank=info.rank,
                                                step=step, fault_t=t, detected_t=now,
                                                error=f"planned: rank {info.rank} moved from pid "
                                                      f"{pending.pid} on {pending.host} (by "
                                                      f"{pending.by})")
        incident.phases["decided"] = now
        incident.detail["migration"] = {"planned_t": pending.t, "boundary_step": step,
                                        "from": pending.host,
                                        "to": pending.to, "by": pending.by, "pid": pending.pid,
                                        **({"node": pending.node} if pending.node is not None
                                           else {})}
        incident.action = "migrate"
        self.core.events.event("decided", rank=info.rank, incident=incident.id, action="migrate",
                               reason="planned migration")
        return incident

    def _replace(self, info: RankInfo, pending: PendingMove, t: float) -> None:
        """The planned incident of one rank, carried out as the recovery's replacement."""
        core = self.core
        incident = self._incident(info, pending, t, t, step=info.step)
        self.recoveries.execute(incident, Decision(Action.REPLACE, "planned migration"))
        core.events.incident(incident)

    def _move_node(self, first: RankInfo, pending: PendingMove, t: float) -> None:
        """The node's first rank left at its boundary: the node's agent is let go, every rank of it
        is replaced in one new generation, and the standby on the target host is given the node."""
        core, node = self.core, pending.node
        assert node is not None and self.server is not None
        slot = self.server.slots[node]
        slot.send(JobEnded("moved", f"node {node} moved to a standby on {pending.to} "
                                    f"({self.hosts.state(pending.host).value} host "
                                    f"{pending.host}); this agent is done", 0))
        slot.detach(f"moved to {pending.to}")
        self.recoveries.one_generation = True
        try:
            for info in sorted(core.ranks.values(), key=lambda r: r.rank):
                if info.node != node:
                    continue
                mine = pending if info is first else self.pending.pop(info.pid, None)
                if info is not first and info.state not in (RankState.EXITED, RankState.DONE):
                    # its process goes with its agent (fenced if it lingers)
                    info.state = RankState.EXITED
                    core.book.persist(info)
                self._replace(info, mine or pending, t)
        finally:
            self.recoveries.end_shared_generation()
        place_on(self.server, self.hosts, pending.to)

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
        if any(p.rank == info.rank and (p.node is not None
                                        or p.generation > core.generations.current)
               for p in self.pending.values()):
            return f"rank {info.rank} is already being moved"
        return ""

    def standby_views(self) -> list[dict[str, Any]]:
        """The standby agents parked with no node yet (a multi-node job's): where a node can move or
        fail over to."""
        return self.server.standbys.views() if self.server is not None else []

    def _record(self, what: str, detail: dict[str, Any]) -> None:
        """A change of the host book: its event, and the book as the job fact a restarted manager
        reads."""
        self.core.events.event(what, **detail)
        self.core.events.set_job(LOG_KEY, self.hosts.to_log(), flush=True)
