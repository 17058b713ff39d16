"""The manager: one per job, the job's truth and its recovery loop; a router over small parts.

Agents report process exits and forward the workers' messages; the manager
routes each to the part whose concern it is: the membership book and its step
clock (``book``, ``step_clock``), generations (``generations``), detection of
faults (``detection``), recovery with the pure policy (``recovery``,
``policy``), regroups (``regrouping``), checkpoints (``checkpoints``),
preemption (``preemption``), the trace switch (``trace_control``), fault
injection (``commands``) and the status (``views``), all over one shared
core (``core``). Everything runs on one asyncio loop, so no handler races another.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Mapping
from itertools import repeat
from typing import Any

from undying.checkpoint.planner import PersistedState, plan_start
from undying.config import JobConfig
from undying.jobfiles.events import EventLog
from undying.jobfiles.records import (
    Incident,
    IncidentKind,
    JobState,
    RankInfo,
    RankState,
)
from undying.manager.checkpoints import CheckpointHealth, Checkpoints
from undying.manager.core import JobCore
from undying.manager.injection import Injector
from undying.manager.integrity import (
    NUMERIC_PHASE,
    SDC_PHASE,
    VERIFIED_PHASE,
    Divergence,
    on_numeric_fault,
    on_sdc,
    on_verified,
)
from undying.manager.placement import Migrations
from undying.manager.preemption import Preemption
from undying.manager.recovery import LEFT_BEHIND_PHASE, Detection, Recoveries
from undying.manager.regroup import Regrouping
from undying.manager.restoring import restore_job
from undying.manager.tracing import TraceControl
from undying.manager.views import RunHistory, job_status
from undying.protocol.codec import Handlers, Message
from undying.protocol.judge_clock import JudgeClock
from undying.protocol.node_wire import NodeStep, RankProgress, SpareEvent
from undying.protocol.seams import AgentHandle
from undying.protocol.trace_switch import TraceSwitch
from undying.protocol.worker_wire import (
    CheckpointSaved,
    CommFailure,
    Done,
    Fatal,
    FaultInjected,
    Hello,
    Progress,
    StepBegun,
    StepCommitted,
    StopProposal,
    Terminated,
    TraceSet,
    TraceSummary,
    float_metrics,
)

__all__ = ["Manager", "AgentHandle"]

log = logging.getLogger("undying.manager")

# A commit as the log's steps table takes it: rank, step, generation, time, metrics.
CommitRow = tuple[int, int, int, float, Mapping[str, float | str]]  # ("inf", "nan": as the wire carries them)
_WATCH_S = 0.5  # the watch of deadlines: a pass every half second


class Manager:
    def __init__(self, config: JobConfig, events: EventLog, *, restoring: bool = False) -> None:
        self.config = config
        self.events = events
        self.core = core = JobCore(config, events)
        self.checkpoints = Checkpoints(core)
        self.recoveries = Recoveries(core, self.checkpoints)
        self.detection = Detection(core, self.recoveries)
        self.regrouping = Regrouping(core, self.recoveries, self.checkpoints, self.detection)
        self.gasp = Preemption(core, self.checkpoints)
        self.tracing = TraceControl(core)
        self.injector = Injector(core, self.detection)
        self.migrations = Migrations(core, self.recoveries, self.detection,  # undying migrate / drain / undrain
                                     busy=lambda: "the job is regrouping" if self.regrouping.active else "")
        self.history = RunHistory()  # the whole run, bounded: the page's charts, the metrics' histograms
        self.divergence = Divergence(core)  # a re-run step's batch or a restored state that is another one
        self.sessions: dict[int, str] = {}  # node -> its agent's session (a restarted manager honours them)
        # The watch's deadlines (--node-wait, the recovery and rendezvous timeouts) count only while this manager
        # ran (protocol/judge_clock.py): after a stall of its own, the joins and reports it did not read come first.
        self.deadlines = JudgeClock(_WATCH_S, config.timeouts.heartbeat_timeout, "the manager's deadlines")
        self.deadlines.tick()  # (from its start: a manager paused before its watch first ran still sees that stall)
        # Which handler takes each message a worker (or the agent, for its ranks) sends.
        self.handlers = Handlers[None]({
            StepCommitted: self._on_commit, NodeStep: self._on_node_step, Hello: self._on_hello,
            Progress: self._on_progress, CommFailure: self._on_comm_failure, TraceSummary: self.tracing.on_summary,
            FaultInjected: self._on_fault_injected, Fatal: self._on_fatal, CheckpointSaved: self._on_checkpoint,
            StopProposal: self._on_stop_proposal, Terminated: self._on_terminated,
            SpareEvent: self._on_spare_event, Done: self._on_done,
            StepBegun: self.divergence.on_begun,
        }, otherwise=lambda message: log.warning("unexpected message %r", message))
        if restoring:
            return  # restore() reads the job back from its log
        for key, value in (("job_id", config.job_id), ("checkpoint_dir", config.checkpoint_dir),
                           ("world_size", config.world_size), ("nodes", core.book.nodes),
                           ("started_at", core.started_at), ("config", config.to_dict())):
            events.set_job(key, value)
        core.persist_state()

    # --- what the rest of the project reads -------------------------------------

    @property
    def state(self) -> JobState:
        return self.core.state

    @property
    def ranks(self) -> dict[int, RankInfo]:
        return self.core.ranks

    @property
    def world_size(self) -> int:
        return self.core.book.world_size

    @property
    def generation(self) -> int:
        return self.core.generations.current

    @property
    def incidents(self) -> list[Incident]:
        return self.core.incidents

    @property
    def rerun_steps(self) -> set[int]:
        return self.core.book.rerun_steps

    @property
    def exit_reason(self) -> str:
        return self.core.exit_reason

    @property
    def preemption(self) -> dict[str, Any] | None:
        return self.gasp.view

    @property
    def checkpoint_health(self) -> CheckpointHealth:
        return self.core.health

    @property
    def control_port(self) -> int:
        return self.core.generations.control_port

    # --- setup ----------------------------------------------------------------

    def start_control_store(self, key: bytes) -> int:
        """Serve the job's stores on --host:--port to processes that prove ``key`` (the job's store key)."""
        port = self.core.generations.serve(self.config.port, key)
        self.events.set_job("control_port", port, flush=True)
        return port

    def add_agent(self, agent: AgentHandle) -> None:
        self.core.agents[agent.node] = agent
        agent.set_trace(self.tracing.message())

    async def run(self, *, restored: bool = False, ready: asyncio.Future[None] | None = None) -> JobState:
        """Start every rank in generation 0 (from the latest valid checkpoint, if any) and wait until the job ends.

        ``ready``: what must complete first (every node joined); ``restored``:
        the job runs already (a restarted manager), nothing is started.
        """
        core = self.core
        if ready is not None and not restored:
            try:
                await ready
            except asyncio.CancelledError:
                await core.finished.wait()
                return self.state
        if not restored and self.config.elastic:
            core.set_layout(core.nodes_available()[: self.config.nnodes])
        if not restored:
            resume = await self.checkpoints.find_resume_point()
            start = plan_start(joining=False, checkpoint=PersistedState(resume.step, path=resume.url) if resume else None)
            record = core.open_generation("start" if start.source.kind == "fresh" else f"resume from step {start.step}")
            for info in core.ranks.values():
                core.spawn(info.rank, record, joining=False, resume_from=start.source.path)
            if not self.recoveries.step_api:
                core.move(JobState.RUNNING)  # (its ranks commit no step to say so: started is running)
        for agent in core.agents.values():
            agent.keep_spares()
        watchdog = asyncio.create_task(self._watch())
        flusher = asyncio.create_task(self._flush_periodically())
        try:
            await core.finished.wait()
        finally:
            watchdog.cancel()
            flusher.cancel()
            self.detection.cancel()
        return self.state

    def restore(self) -> dict[int, str]:
        """Carry on a job whose manager died: read its state back from the log (``restoring``); the sessions."""
        self.sessions = restore_job(self.core, checkpoints=self.checkpoints, recoveries=self.recoveries,
                                    history=self.history, regrouping=self.regrouping, migrations=self.migrations)
        return dict(self.sessions)

    def reopen_generation(self) -> None:
        """After a restart: the control store is new; give it the current generation and the ranks' owners."""
        regroup = self.regrouping.regroup
        if regroup is not None and regroup.generation != self.generation:
            regroup = None
        self.core.generations.reannounce(len(regroup.members) if regroup else self.world_size,
                                         members=regroup.members if regroup else None,
                                         purpose="regroup" if regroup else "")
        if self.generation < 0:
            return
        for info in self.ranks.values():
            if info.incarnation:
                self.core.generations.set_owner(info.rank, info.incarnation)

    def close(self) -> None:
        self.core.generations.close()
        self.events.close()

    # --- reports from agents --------------------------------------------------

    def on_exit(self, rank: int, pid: int, returncode: int, t: float) -> None:
        core = self.core
        self.events.event("exited", generation=self.generation, rank=rank, pid=pid, returncode=returncode)
        self.migrations.before_exit(pid, returncode)  # a moving rank's old process: the rank is its again
        info = self.ranks.get(rank)
        if info is None or pid != info.pid:
            return  # a process already replaced (or numbered before a regroup); its exit is old news
        finished_steps = info.state is RankState.DONE
        info.state = RankState.EXITED
        info.last_seen = t
        core.book.persist(info)
        if core.winding_down:
            return
        if self.regrouping.active:
            self.regrouping.member_exited(info, pid, returncode, t)
            return
        if self.migrations.on_exit(info, pid, returncode, t):
            return  # a planned move: its replacement is under way
        # A rank is finished when it exits cleanly, or when the job's final
        # barrier completed on some rank: then this one passed it too. A clean
        # exit before its last step is held: it may have left early (manager.leaving).
        if self.detection.finished(returncode, finished_steps):
            if returncode == 0 and not finished_steps and self.detection.leavers.on_clean_exit(info, pid, t):
                self._finish(*self.detection.leavers.all_left())
                return
            if returncode != 0:
                self.events.event("exit_after_done", rank=rank, returncode=returncode)
            self._finish(info)
            return
        condemned = self.recoveries.condemned.pop(pid, None)
        if condemned is not None:
            self.recoveries.execute(*condemned)
            return
        self.detection.on_fault_exit(info, pid, returncode, t)

    def on_spawned(self, rank: int, pid: int, warm: bool, incarnation: int) -> None:
        """A node across the network started the process of a rank (a spawn returns before it knows)."""
        info = self.ranks[rank]
        if incarnation != info.incarnation:
            return  # a process the rank was taken from since: fenced by the owner key
        info.pid = pid
        self.events.event("started", generation=info.generation, rank=rank, pid=pid, spare=warm,
                          incarnation=incarnation)
        self.core.book.persist(info)
        self.migrations.on_spawned(rank, warm)  # (a moved rank's replacement on another host: what it was)
        recovery = self.recoveries.current
        if recovery is not None:  # (a stuck spare's rank goes to another spare or a new process: said as it is)
            for incident in recovery.incidents:
                if incident.rank == rank and "replacement" in incident.detail:
                    incident.detail["replacement"] = "warm spare" if warm else "new process"

    def on_node_lost(self, node: int, reason: str, t: float) -> None:
        """Every process of ``node`` is gone or out of reach: its ranks are recovered like crashed ones.

        The survivors may be blocked on a peer that will never answer (a
        link cut rather than a process killed sends no reset), so every rank
        elsewhere is told to leave the old generation at once.
        """
        core = self.core
        self.events.event("node_lost", node=node, reason=reason)
        if core.winding_down or node not in core.book.nodes:
            return  # (a node the job does not train on: an elastic job's extra one)
        lost = [r for r in self.ranks.values()
                if r.node == node and r.state not in (RankState.EXITED, RankState.DONE)]
        previous = self.generation
        for info in lost:
            self.detection.node_lost[info.pid] = (node, reason, t)
        self.recoveries.one_generation = True  # every rank of the node is replaced in the same new generation
        try:
            for info in lost:
                self.on_exit(info.rank, info.pid, -int(signal.SIGKILL), t)
        finally:
            self.recoveries.end_shared_generation()
        for info in self.ranks.values():
            if info.node != node and info.state is not RankState.EXITED and info.generation <= previous:
                core.agents[info.node].abort(info.rank, previous, f"node {node} lost")

    def on_node_joined(self, node: int, session: str, host: str, live: dict[int, int]) -> None:
        self.events.event("node_joined", node=node, session=session, host=host, live=live)
        self.sessions[node] = session
        self.events.set_job("sessions", self.sessions, flush=True)
        agent = self.core.agents.get(node)  # its welcome carried the trace switch
        if agent is not None and self.state is not JobState.STARTING:
            agent.keep_spares()
        if self.regrouping.active:
            self.regrouping.maybe_form_world()
        else:
            self.regrouping.maybe_grow()

    def on_hang(self, rank: int, pid: int, phase: str, last_seen: float, t: float) -> None:
        self.detection.on_hang(rank, pid, phase, last_seen, t)

    def on_stall(self, progress: list[RankProgress], limit: float, t: float) -> None:
        self.detection.on_stall(progress, limit, t)

    def welcome_trace(self) -> TraceSet:
        return self.tracing.message()

    def on_standby(self, what: str, detail: dict[str, Any]) -> None:
        self.events.event(what, **detail)  # a standby parked, given a node, or dropped (manager/standbys.py)

    def on_message(self, message: Message) -> None:
        if getattr(message, "rank", 0) not in self.ranks:
            return  # a process numbered before a regroup, its last words
        self.handlers.handle(message)

    def on_messages(self, messages: list[Message]) -> None:
        """Workers' messages that came together (a node's batch), in order, as ``on_message`` takes each.

        Commits (one rank's ``StepCommitted``, or a node's ``NodeStep`` of a
        step) are taken as rows, not message objects: a run of them has its
        step rows written with one statement before any is handled (a log
        commit made while handling them holds them all).
        """
        rows: list[CommitRow] = []
        for message in messages:
            kind = type(message)
            if kind is NodeStep:
                assert isinstance(message, NodeStep)
                # (NodeStep checked its lists are of one length; the repeats are endless, hence not strict)
                rows += zip(message.ranks, repeat(message.step), repeat(message.generation), message.t,
                            message.metrics, strict=False)
                continue
            if kind is StepCommitted:
                assert isinstance(message, StepCommitted)
                rows.append((message.rank, message.step, message.generation, message.t, message.metrics))
                continue
            if rows:
                self._on_commits(rows)
                rows = []
            self.on_message(message)
        if rows:
            self._on_commits(rows)

    # --- the workers' messages --------------------------------------------------

    def _on_commits(self, rows: list[CommitRow]) -> None:
        ranks = self.ranks
        numbers = [(rank, step, generation, t, float_metrics(metrics)) for rank, step, generation, t, metrics in rows
                   if rank in ranks]  # (not a process numbered before a regroup)
        self.events.steps(numbers)
        self.history.commits(numbers, self.world_size)
        for rank, step, generation, t, metrics in numbers:
            self._commit(rank, step, generation, t, metrics)
        self.events.changed()  # their ranks rows are due at the next flush, also when one ran in between

    def _on_commit(self, message: StepCommitted) -> None:
        metrics = float_metrics(message.metrics)
        self.events.step(message.rank, message.step, message.generation, message.t, metrics)
        self.history.commit(message.rank, message.step, message.t, metrics, self.world_size)
        self._commit(message.rank, message.step, message.generation, message.t, metrics)

    def _commit(self, rank: int, step: int, generation: int, t: float, metrics: dict[str, float]) -> None:
        core = self.core
        if core.book.commit(rank, step, generation, t):
            self.events.event("step_rerun", rank=rank, step=step)
        if self.detection.leavers.pending:
            self.detection.leavers.on_commit(rank, step)  # a rank that exited 0 before this step left early
        core.clock.committed(rank, step, t, metrics)
        if core.machine.state is JobState.STARTING:
            core.move(JobState.RUNNING)
        self._maybe_finish_recovery(rank, t, generation)

    def _on_node_step(self, message: NodeStep) -> None:
        self.on_messages([message])

    def _on_hello(self, message: Hello) -> None:
        self.events.event("joined", generation=message.generation, rank=message.rank, pid=message.pid,
                          joining=message.joining)
        info = self.ranks[message.rank]
        info.pid = message.pid
        info.last_seen = message.t
        info.state = RankState.RECOVERING if message.joining else RankState.STARTING
        self.recoveries.on_joined(message.rank, message.t)
        self.migrations.on_hello(message.rank, message.t)  # (a moved rank's replacement, started ahead, is ready)
        self.core.book.persist(info)

    def _on_progress(self, message: Progress) -> None:
        info = self.ranks[message.rank]
        info.generation = message.generation
        info.last_seen = message.t
        self.events.event(message.phase, generation=message.generation, rank=message.rank, step=message.step,
                          **message.detail)
        self.checkpoints.on_state_reported(message.phase, message.detail)
        self.core.clock.reported(message.phase, message.detail)
        self.divergence.on_progress(message)
        self.recoveries.on_progress(message.rank, message.generation, message.step, message.phase,
                                    message.detail, message.t)
        if message.phase == NUMERIC_PHASE:  # a step's numeric check, replayed: its verdict (manager.numerics)
            on_numeric_fault(self.core, message, self.recoveries)
        elif message.phase == SDC_PHASE:  # a step that differed from its replay (manager.verification)
            on_sdc(self.core, message)
        elif message.phase == VERIFIED_PHASE:  # a verified step's verdict: a quarantined host may requalify
            on_verified(self.core, message)

    def _on_comm_failure(self, message: CommFailure) -> None:
        info = self.ranks[message.rank]
        info.state = RankState.RECOVERING
        info.last_seen = message.t
        self.events.event("comm_failure", generation=message.generation, rank=message.rank, step=message.step,
                          error=message.error)
        self.core.book.persist(info)
        if self.regrouping.active:  # the regroup's group broke: it re-plans (after the grace), no retry
            self.regrouping.on_group_broke(message.generation, f"rank {message.rank}'s group broke ({message.error})")
            return
        self.detection.on_comm_failure(message)

    def _on_fault_injected(self, message: FaultInjected) -> None:
        if message.kind == "migrate" and self.migrations.on_left(message):
            return  # a moved rank at its boundary (manager.migration)
        if message.kind != "slow":  # a slowdown is no fault a later exit should be timed from
            self.detection.injected[message.rank] = (message.t, message.kind)
        self.events.event("fault_injected", rank=message.rank, kind=message.kind, step=message.step,
                          phase=message.phase)

    def _on_fatal(self, message: Fatal) -> None:
        self.detection.fatal[self.ranks[message.rank].pid] = message
        self.events.event("user_error", rank=message.rank, step=message.step, error=message.error,
                          traceback=message.traceback)

    def _on_checkpoint(self, message: CheckpointSaved) -> None:
        self.checkpoints.on_saved(message)
        self.history.checkpoint(message)
        if not message.error:
            self.core.clock.saved(message.step, message.t, message.blocking_s)
            self.regrouping.on_saved(message.kind, message.path)
        self.gasp.on_saved(message)

    def _on_stop_proposal(self, message: StopProposal) -> None:
        self.gasp.proposals[message.rank] = message.step
        self.events.event("stop_proposed", generation=message.generation, rank=message.rank, step=message.step)

    def _on_terminated(self, message: Terminated) -> None:
        holder = self.ranks[message.rank].pid  # (0: its replacement has not started yet)
        if message.pid and message.pid != holder:
            # A process the rank was taken from (its host cut off, fenced, its agent stopping it): old news.
            self.events.event("sigterm_stale", rank=message.rank, pid=message.pid, holder=holder)
            return
        self.events.event("sigterm", rank=message.rank)
        self.preempt(f"SIGTERM to rank {message.rank}", rank=message.rank, t=message.t)

    def _on_spare_event(self, message: SpareEvent) -> None:
        self.events.event(message.what, node=message.node, pid=message.pid, **message.detail)

    def _on_done(self, message: Done) -> None:
        info = self.ranks[message.rank]
        info.state = RankState.DONE
        info.digest = message.digest
        info.step = message.step
        self.events.event("done", rank=message.rank, step=message.step, digest=message.digest)
        self.core.book.persist(info)
        if self.detection.leavers.on_done(message.rank):  # (its exit came first: it finished after all)
            self._finish(info)
            return
        self._maybe_finish_recovery(message.rank, message.t, self.generation)

    # --- the recovery's clock ---------------------------------------------------

    def _maybe_finish_recovery(self, rank: int, t: float, generation: int) -> None:
        if self.regrouping.active:
            return  # (a regroup's recovery ends on the new world's first step)
        if self.recoveries.maybe_finish(rank, t, message_generation=generation):
            self.regrouping.maybe_grow()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_S)
            self.deadlines.tick()
            resumed = self.deadlines.resumed_wall  # its return from its latest stall (0.0: it never stalled)
            if self.core.winding_down:
                continue
            if self.regrouping.active:
                self.regrouping.watch(resumed)
                continue
            recovery = self.recoveries.current
            if recovery is None:
                continue
            lost = self.regrouping.lost_nodes()
            if lost and any(i.kind is IncidentKind.NODE_LOSS for i in recovery.incidents):
                # Its ranks wait for a host to take them; past --node-wait the job goes on without it.
                node_wait = self.config.timeouts.node_wait
                if time.time() - max(recovery.started, resumed) > node_wait:
                    self.regrouping.begin(f"node{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost "
                                          f"and not replaced within --node-wait {node_wait:g}s")
                continue
            overdue = self.recoveries.overdue(time.time(), resumed)
            if overdue:
                self.recoveries.fail(overdue)
                continue
            for info in self.recoveries.stuck(time.time(), resumed):  # (recovery.py: a wait gloo never ends)
                self.detection.on_hang(info.rank, info.pid, LEFT_BEHIND_PHASE, recovery.told_to_leave, time.time())

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.events.flush()

    # --- ending ---------------------------------------------------------------

    def _finish(self, *ranks: RankInfo) -> None:
        """These ranks' part of the job is done (then ranks held as perhaps early leavers may be too)."""
        for info in ranks:
            info.state = RankState.DONE
            self.core.book.finished.add(info.rank)
            self.core.book.persist(info)
        if ranks and self.detection.leavers.pending:
            self._finish(*self.detection.leavers.all_left())
        self._maybe_succeeded()

    def _maybe_succeeded(self) -> None:
        core = self.core
        if len(core.book.finished) == len(self.ranks):
            last = self.checkpoints.last["step"] if self.checkpoints.last else \
                self.checkpoints.resumed_from["step"] if self.checkpoints.resumed_from else None
            core.exit_reason = "every rank finished its last step" + core.health.warning(core.book.newest_step(),
                                                                                          last) + self.divergence.warning()
            core.move(JobState.STOPPING)
            core.end(JobState.SUCCEEDED)

    def fail(self, reason: str) -> None:
        self.core.fail(reason)

    def stop(self, reason: str) -> None:
        self.core.stop(reason)

    def preempt(self, reason: str, *, rank: int = -1, t: float | None = None) -> None:
        self.gasp.preempt(reason, rank=rank, t=t)

    def grace_period(self) -> tuple[float, str]:
        return self.gasp.grace_period()

    # --- commands and views -----------------------------------------------------

    def inject(self, kind: str, rank: int, at_step: int | None, phase: str | None,
               how: str | None = None, *, factor: float | None = None) -> dict[str, Any]:
        return self.injector.inject(kind, rank, at_step, phase, how, factor=factor)

    def set_trace(self, switch: TraceSwitch) -> dict[str, Any]:
        return self.tracing.set(switch)

    def change_trace(self, *, on: bool, comm_only: bool, by: str) -> dict[str, Any]:
        return self.tracing.change(on=on, comm_only=comm_only, by=by)

    def on_trace_file(self, switch: TraceSwitch) -> None:
        self.tracing.set(switch)

    def on_trace_file_error(self, message: str) -> None:
        self.tracing.on_file_error(message)

    def trace_status(self) -> dict[str, Any]:
        return self.tracing.status()

    def status(self) -> dict[str, Any]:
        return job_status(self.core, checkpoints=self.checkpoints, preemption=self.gasp, recoveries=self.recoveries,
                          regrouping=self.regrouping, trace=self.tracing, standbys=self.migrations.standby_views())

