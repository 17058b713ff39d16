"""The manager: one per job, the job's truth and its recovery loop; a router over small parts.

Agents report process exits and forward the workers' messages; the manager
routes each to the part whose concern it is, over one shared core (``core``:
the config, the log, the ranks, the agents, the generations, the job's state
machine and how it ends):

- the ranks' and nodes' comings and goings, and the job's end once every rank
  finished (``comings``, ``membership/comings.py``);
- the workers' word on their steps: commits, progress, saves, done (``steps``,
  ``steps/reports.py``);
- faults the workers report (``faults``, ``recovery/reported.py``), faults the
  manager detects (``detection``), recovery with the pure policy
  (``recoveries``), and the watch of deadlines (``watch``, ``recovery/watch.py``);
- regroups (``regrouping``), planned moves (``migrations``), checkpoints
  (``checkpoints``), preemption (``gasp``), the trace switch (``tracing``),
  fault injection (``injector``), integrity (``divergence``) and the status
  (``views``).

The manager keeps their construction, the two tables (a node's reports, the
workers' messages) and the job's life: its start (``run``), its restore after a
restart, and its end by the user (``stop``), a failure (``fail``) or a SIGTERM
(``preempt``). Everything runs on one asyncio loop, so no handler races another.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import repeat
from pathlib import Path
from typing import Any

from undying.checkpoint.planner import PersistedState, plan_start
from undying.config import JobConfig
from undying.jobfiles.events import EventLog
from undying.jobfiles.records import Incident, JobState, RankInfo
from undying.manager.checkpoints import CheckpointHealth, Checkpoints
from undying.manager.core import JobCore
from undying.manager.injection import Injector
from undying.manager.integrity import Divergence
from undying.manager.membership import Comings
from undying.manager.placement import Migrations
from undying.manager.preemption import Preemption
from undying.manager.recovery import Detection, LeftBehind, Recoveries, ReportedFaults, Watch
from undying.manager.regroup import Regrouping
from undying.manager.restoring import restore_job
from undying.manager.steps import CommitRow, StepReports
from undying.manager.tracing import TraceControl
from undying.manager.trackers import Trackers
from undying.manager.views import RunHistory, job_status
from undying.protocol.codec import Handlers, Message
from undying.protocol.node_wire import NodeStep, SpareEvent
from undying.protocol.seams import AgentHandle
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
    TraceSummary,
)

__all__ = ["Manager", "AgentHandle"]

log = logging.getLogger("undying.manager")


class Manager:
    def __init__(self, config: JobConfig, events: EventLog, *, restoring: bool = False) -> None:
        self.config = config
        self.events = events
        self.core = core = JobCore(config, events)
        # The parts, each given what it needs.
        self.checkpoints = Checkpoints(core)
        self.recoveries = Recoveries(core, self.checkpoints)
        self.detection = Detection(core, self.recoveries)
        self.regrouping = Regrouping(core, self.recoveries, self.checkpoints, self.detection)
        self.gasp = Preemption(core, self.checkpoints)
        self.tracing = TraceControl(core)
        self.injector = Injector(core, self.detection)
        # undying migrate / drain / undrain
        self.migrations = Migrations(
            core, self.recoveries, self.detection,
            busy=lambda: "the job is regrouping" if self.regrouping.active else "")
        # the whole run, bounded: the page's charts, the metrics' histograms
        self.history = RunHistory()
        # a re-run step's batch or a restored state that is another one
        self.divergence = Divergence(core)
        # a survivor gloo never let go: replaced in its round
        left_behind = LeftBehind(core, self.recoveries)
        self.comings = Comings(core, checkpoints=self.checkpoints, recoveries=self.recoveries,
                               detection=self.detection, regrouping=self.regrouping,
                               migrations=self.migrations,
                               divergence=self.divergence, left_behind=left_behind)
        # --trackers: each step every rank committed, its values to each tracker once (a thread
        # each; the cursor in the job dir carries "once" across a manager's restart and a relaunch)
        self.trackers = (Trackers(config.trackers, config.job_id, Path(config.job_dir),
                                  report=self._tracker_dropped)
                         if config.trackers else None)
        self.steps = StepReports(core, history=self.history, checkpoints=self.checkpoints,
                                 recoveries=self.recoveries, detection=self.detection,
                                 regrouping=self.regrouping,
                                 divergence=self.divergence, gasp=self.gasp,
                                 finish=self.comings.finish, tracking=self.trackers)
        self.faults = ReportedFaults(core, detection=self.detection, regrouping=self.regrouping,
                                     moves=self.migrations, left_behind=left_behind)
        self.watch = Watch(core, recoveries=self.recoveries, detection=self.detection,
                           regrouping=self.regrouping, left_behind=left_behind)
        # What a node reports of its own (manager/node_reports.py's NodeEvents), to the part it
        # concerns.
        self.on_exit = self.comings.on_exit
        self.on_spawned = self.comings.on_spawned
        self.on_node_lost = self.comings.on_node_lost
        self.on_node_joined = self.comings.on_node_joined
        self.on_hang = self.detection.on_hang
        self.on_stall = self.detection.on_stall
        self.welcome_trace = self.tracing.message
        self.on_trace_file = self.tracing.on_file
        self.on_trace_file_error = self.tracing.on_file_error
        self.on_standby = self._on_standby
        # Which handler takes each message a worker (or the agent, for its ranks) sends.
        self.handlers = Handlers[None]({
            StepCommitted: self.steps.on_commit,
            NodeStep: lambda message: self.on_messages([message]),
            Progress: self.steps.on_progress, CheckpointSaved: self.steps.on_checkpoint,
            Done: self.steps.on_done,
            Hello: self.comings.on_hello, CommFailure: self.faults.on_comm_failure,
            FaultInjected: self.faults.on_fault_injected, Fatal: self.faults.on_fatal,
            StopProposal: self.gasp.on_stop_proposal, Terminated: self.gasp.on_terminated,
            TraceSummary: self.tracing.on_summary, StepBegun: self.divergence.on_begun,
            SpareEvent: lambda message: events.event(message.what, node=message.node,
                                                     pid=message.pid, **message.detail),
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

    # --- setup ----------------------------------------------------------------

    def start_control_store(self, key: bytes) -> int:
        """Serve the job's stores on --host:--port to processes that prove ``key`` (the job's store
        key)."""
        port = self.core.generations.serve(self.config.port, key)
        self.events.set_job("control_port", port, flush=True)
        return port

    def add_agent(self, agent: AgentHandle) -> None:
        self.core.agents[agent.node] = agent
        agent.set_trace(self.tracing.message())

    async def run(self, *, restored: bool = False,
                  ready: asyncio.Future[None] | None = None) -> JobState:
        """Start every rank in generation 0 (from the latest valid checkpoint, if any) and wait
        until the job ends.

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
            start = plan_start(
                joining=False,
                checkpoint=PersistedState(resume.step, path=resume.url) if resume else None)
            record = core.open_generation("start" if start.source.kind == "fresh"
                                          else f"resume from step {start.step}")
            for info in core.ranks.values():
                core.spawn(info.rank, record, joining=False, resume_from=start.source.path)
            if not self.recoveries.step_api:
                # (its ranks commit no step to say so: started is running)
                core.move(JobState.RUNNING)
        for agent in core.agents.values():
            agent.keep_spares()
        watching = self.watch.start()
        try:
            await core.finished.wait()
        finally:
            for task in watching:
                task.cancel()
            self.detection.cancel()
        return self.state

    def restore(self) -> dict[int, str]:
        """Carry on a job whose manager died: read its state back from the log (``restoring``); the
        sessions."""
        sessions = restore_job(self.core, checkpoints=self.checkpoints, recoveries=self.recoveries,
                               history=self.history, regrouping=self.regrouping,
                               migrations=self.migrations)
        self.comings.sessions = sessions
        return dict(sessions)

    def reopen_generation(self) -> None:
        """After a restart: the control store is new; give it the current generation and the ranks'
        owners."""
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
        try:
            if self.trackers is not None:  # (each sends what is queued, within its bound)
                self.trackers.close(succeeded=self.state is JobState.SUCCEEDED)
        finally:
            self.core.generations.close()
            self.events.close()

    def _tracker_dropped(self, name: str, reason: str) -> None:
        log.warning("tracker %s dropped (the job goes on): %s", name, reason)
        self.events.event("tracker_dropped", tracker=name, reason=reason)

    # --- the workers' messages --------------------------------------------------

    def on_message(self, message: Message) -> None:
        if getattr(message, "rank", 0) not in self.ranks:
            return  # a process numbered before a regroup, its last words
        self.handlers.handle(message)

    def on_messages(self, messages: list[Message]) -> None:
        """Workers' messages that came together (a node's batch), in order, as ``on_message`` takes
        each.

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
                # (NodeStep checked its lists are of one length; the repeats are endless, hence not
                # strict)
                rows += zip(message.ranks, repeat(message.step), repeat(message.generation),
                            message.t, message.metrics, strict=False)
                continue
            if kind is StepCommitted:
                assert isinstance(message, StepCommitted)
                rows.append((message.rank, message.step, message.generation, message.t,
                             message.metrics))
                continue
            if rows:
                self.steps.on_commits(rows)
                rows = []
            self.on_message(message)
        if rows:
            self.steps.on_commits(rows)

    def _on_standby(self, what: str, detail: dict[str, Any]) -> None:
        # a standby parked, given a node, or dropped (manager/standbys/)
        self.events.event(what, **detail)

    # --- the job's end, by the user, a failure or a SIGTERM -----------------------

    def fail(self, reason: str) -> None:
        self.core.fail(reason)

    def stop(self, reason: str) -> None:
        self.core.stop(reason)

    def preempt(self, reason: str, *, rank: int = -1, t: float | None = None) -> None:
        self.gasp.preempt(reason, rank=rank, t=t)

    # --- commands and views -----------------------------------------------------

    def inject(self, kind: str, rank: int, at_step: int | None, phase: str | None,
               how: str | None = None, *, factor: float | None = None) -> dict[str, Any]:
        return self.injector.inject(kind, rank, at_step, phase, how, factor=factor)

    def status(self) -> dict[str, Any]:
        return job_status(self.core, checkpoints=self.checkpoints, preemption=self.gasp,
                          recoveries=self.recoveries, regrouping=self.regrouping,
                          trace=self.tracing, standbys=self.migrations.standby_views())
