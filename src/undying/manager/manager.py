"""The manager: one per job, the job's truth and its recovery loop.

It owns membership, the process-group generation, the job's state machine and
every incident with its timeline. Agents report process exits and forward the
workers' messages; the manager asks the policy what to do, opens the next
generation (a fresh TCPStore per generation, announced on the control store)
and has agents start replacement processes. Everything runs on one asyncio
loop, so the handlers below never race each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import statistics
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from undying.checkpoint import (
    Checkpoint,
    CheckpointOfAnotherJobError,
    Measurement,
    check_same_job,
    latest_valid,
    recent_dying_gasp,
)
from undying.checkpoint.planner import (
    Layout,
    LayoutError,
    MissingShardsError,
    PersistedState,
    plan_for_ddp,
    plan_restore,
)
from undying.config import EXIT_SCRIPT_ERROR, SCRIPT_ERROR_FILE, JobConfig
from undying.errors import UsageError
from undying.manager.checkpoint_health import CheckpointHealth
from undying.manager.events import EventLog
from undying.manager.policy import Action, Decision, PolicyContext, decide, stall_culprits
from undying.manager.regroup import LOG_KEY as REGROUP_KEY
from undying.manager.regroup import SAVED_KINDS, Regroup, max_attempts
from undying.manager.state import Incident, JobState, JobStateMachine, RankInfo, RankState
from undying.manager.stores import StoreHandle, StoreServer
from undying.protocol.codec import Message
from undying.protocol.generations import (
    CURRENT_KEY,
    GenerationRecord,
    generation_key,
    rank_owner_key,
)
from undying.protocol.kinds import HangHow as HANG_HOWS
from undying.protocol.kinds import InjectKind as INJECT_KINDS
from undying.protocol.kinds import InjectPhase as INJECT_PHASES
from undying.protocol.kinds import SlowPhase as SLOW_PHASES
from undying.protocol.node_wire import RankProgress, RankSpawned, SpareEvent
from undying.protocol.store_wire import CONTROL_STORE, generation_store
from undying.protocol.worker_wire import (
    ArmFault,
    CheckpointSaved,
    CommFailure,
    Done,
    Fatal,
    FaultInjected,
    Hello,
    Preempt,
    Progress,
    StepCommitted,
    StopAt,
    StopProposal,
    Terminated,
    TraceSet,
    TraceSummary,
)
from undying.trace.detect import Finding, SlowDetector
from undying.trace.switch import TraceSwitch

__all__ = ["Manager", "AgentHandle", "INJECT_KINDS"]

log = logging.getLogger("undying.manager")

# crash: SIGKILL of the rank's process. comm-error: the rank breaks its
# process group's connections, so a real collective fails while every process lives.
# hang: SIGSTOP of the rank's process (found by its missing heartbeats), or with
# `how`, the rank's training thread spins in an endless loop or blocks forever
# while its process lives and beats (found by its missing progress).
# slow: the rank's steps take `factor` times as long from then on, the extra time
# spent in one phase (compute, data or ckpt); found by slow-rank detection, not recovered.
_INJECT_SIGNALS = {"crash": signal.SIGKILL, "hang": signal.SIGSTOP}
# How far ahead a comm-marker switch takes effect (see Manager._comm_switch_step).
_COMM_SWITCH_AHEAD_S = 0.5
_COMM_SWITCH_MIN_STEPS = 5
_COMM_SWITCH_MAX_STEPS = 1000


class AgentHandle(Protocol):
    """What the manager asks of the agent of one node."""

    node: int

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool,
              resume_from: str = "", incarnation: int = 0) -> tuple[int, bool]: ...

    def tell(self, rank: int, message: Message) -> bool: ...

    def live_ranks(self) -> list[int]: ...

    def kill(self, rank: int, sig: signal.Signals) -> bool: ...

    def arm(self, rank: int, fault: ArmFault) -> None: ...

    def abort(self, rank: int, generation: int, reason: str) -> bool: ...

    def keep_spares(self) -> None: ...

    def spares_ready(self) -> int: ...

    async def stop_all(self, grace_s: float) -> None: ...

    def set_trace(self, switch: TraceSet) -> None: ...

    def phases(self) -> dict[int, str]: ...

    def view(self) -> dict[str, Any]: ...

    @property
    def attached(self) -> bool:
        """The node's agent is here (one across the network may be gone; a standalone one always is)."""
        ...

    def drop_waiting(self) -> None:
        """Forget spawns kept for an agent yet to come (the job regroups without them)."""
        ...


@dataclass
class Recovery:
    """One recovery round: the incidents it handles and the generation it forms."""

    id: int
    generation: int
    incidents: list[Incident] = field(default_factory=list)
    replaced: set[int] = field(default_factory=set)
    ready: dict[int, float] = field(default_factory=dict)
    group_rebuilt: dict[int, float] = field(default_factory=dict)
    state_restored: dict[int, float] = field(default_factory=dict)
    first_step: dict[int, float] = field(default_factory=dict)
    restored_step: int = -1
    started: float = field(default_factory=time.time)


class Manager:
    def __init__(self, config: JobConfig, events: EventLog, *, restoring: bool = False) -> None:
        self.config = config
        self.events = events
        self.machine = JobStateMachine()
        self.generation = -1
        # The nodes the job trains on, in rank order (rank r is on _layout_nodes[r // nproc_per_node]):
        # every node of --nnodes, or, for an elastic job, those it has (see _set_layout).
        self._layout_nodes = list(range(config.nnodes))
        self.ranks = {
            r: RankInfo(rank=r, node=r // config.nproc_per_node) for r in range(config.world_size)
        }
        self._regroup: Regroup | None = None
        self.incidents: list[Incident] = []
        self.rerun_steps: set[int] = set()
        self.exit_reason = ""
        self.started_at = time.time()
        self._committed: defaultdict[int, set[int]] = defaultdict(set)
        self._agents: dict[int, AgentHandle] = {}
        self._dirty_ranks: set[int] = set()
        events.before_flush(self._write_dirty_ranks)
        self._incarnations = 0  # the newest process given a rank (see _spawn)
        self.sessions: dict[int, str] = {}  # node -> its agent's session (a restarted manager honours them)
        self._node_lost: dict[int, tuple[int, str, float]] = {}  # pid -> (node, why, when)
        self._one_generation = False
        self._shared_record: GenerationRecord | None = None
        self._stores: StoreServer | None = None
        self._control: StoreHandle | None = None
        self._gen_stores: dict[int, StoreHandle] = {}
        self._recovery: Recovery | None = None
        self._recovery_count = 0
        self._injected: dict[int, tuple[float, str]] = {}
        self._hung: dict[int, tuple[float, float, str]] = {}  # pid -> (last heard, detected, phase)
        self._condemned: dict[int, tuple[Incident, Decision]] = {}  # pid -> what its exit carries on
        self._fatal: dict[int, Fatal] = {}
        self._finished = asyncio.Event()
        self._finished_ranks: set[int] = set()
        self._grace_tasks: set[asyncio.Task[None]] = set()
        # Persistent checkpoints and the dying gasp.
        self.checkpoint_dir = config.checkpoint_dir
        self.resumed_from: dict[str, Any] | None = None
        self.last_checkpoint: dict[str, Any] | None = None
        self.preemption: dict[str, Any] | None = None
        self._restarts = 0
        self._restart_from: Checkpoint | None = None
        self._last_skipped: list[tuple[str, str]] = []
        self._state_bytes = 0
        # How the ranks hold the state (rank 0's state_layout event): {"sharded": False} is DDP's.
        self._state_layout: dict[str, Any] = {"sharded": False}
        self._write_bytes_per_s = 0.0
        self._step_s: deque[float] = deque(maxlen=50)
        self._last_commit_t: dict[int, tuple[int, float]] = {}
        self._proposals: dict[int, int] = {}
        self._gasp: CheckpointSaved | None = None
        self.checkpoint_health = CheckpointHealth(events, self.incidents)  # failed saves as incidents
        self._preempt_task: asyncio.Task[None] | None = None
        # Tracing: the switch every rank follows, and what the job's steps took (every rank committed).
        initial = config.trace.initial
        self.trace = TraceSwitch(step=initial != "off", comm=initial == "comm",
                                 by="start" if initial != "off" else "", t=self.started_at)
        self.trace_error = ""
        self._comm_from_step = 0
        self._detector = SlowDetector(world_size=config.world_size)
        self._step_commits: dict[int, dict[int, float]] = {}  # step -> rank -> commit time
        self._step_done: dict[int, float] = {}  # step -> when its last rank committed it
        self.step_times: deque[tuple[int, float]] = deque(maxlen=200)
        if restoring:
            return  # restore() reads the job back from its log
        events.set_job("job_id", config.job_id)
        events.set_job("checkpoint_dir", self.checkpoint_dir)
        events.set_job("world_size", config.world_size)
        events.set_job("nodes", self._layout_nodes)
        events.set_job("started_at", self.started_at)
        events.set_job("config", config.to_dict())
        self._persist_state()

    # --- setup ----------------------------------------------------------------

    @property
    def state(self) -> JobState:
        return self.machine.state

    def start_control_store(self, key: bytes) -> int:
        """Serve the job's stores on --host:--port to processes that prove ``key`` (the job's store key)."""
        try:
            self._stores = StoreServer(self.config.host, self.config.port, key)
            self._control = self._stores.open(CONTROL_STORE)
        except OSError as e:
            if "in use" in str(e).lower() or "EADDRINUSE" in str(e):
                raise UsageError(
                    f"port {self.config.port} is in use; pass --port with a free port, or --port 0 to pick one"
                ) from e
            raise UsageError(f"cannot listen on {self.config.host}:{self.config.port}: {e}") from e
        port = self._control.port
        self.events.set_job("control_port", port, flush=True)
        return port

    @property
    def world_size(self) -> int:
        """The ranks the job trains on now (an elastic job's layout may hold fewer nodes than --nnodes)."""
        return len(self.ranks)

    @property
    def control_port(self) -> int:
        assert self._control is not None
        return self._control.port

    def add_agent(self, agent: AgentHandle) -> None:
        self._agents[agent.node] = agent
        agent.set_trace(self._trace_message())

    async def run(self, *, restored: bool = False, ready: asyncio.Future[None] | None = None) -> JobState:
        """Start every rank in generation 0 (from the latest valid checkpoint, if any) and wait until the job ends.

        ``ready``: what must complete first (every node joined); ``restored``:
        the job runs already (a restarted manager), nothing is started.
        """
        if ready is not None and not restored:
            try:
                await ready
            except asyncio.CancelledError:
                await self._finished.wait()
                return self.state
        if not restored and self.config.elastic:
            self._set_layout(self._nodes_available()[: self.config.nnodes])
        if not restored:
            resume = await self._find_resume_point()
            record = self._open_generation("start" if resume is None else f"resume from step {resume.step}")
            for info in self.ranks.values():
                self._spawn(info.rank, record, joining=False, resume_from=resume.url if resume else "")
        for agent in self._agents.values():
            agent.keep_spares()
        watchdog = asyncio.create_task(self._watch_recovery())
        flusher = asyncio.create_task(self._flush_periodically())
        try:
            await self._finished.wait()
        finally:
            watchdog.cancel()
            flusher.cancel()
            for task in list(self._grace_tasks):
                task.cancel()
        return self.state

    def restore(self) -> dict[int, str]:
        """Carry on a job whose manager died: read its state back from the log; returns the agents' sessions.

        The generation, every rank (its process, step, owner), every incident
        (one still open belongs to a recovery this manager finishes), the
        committed steps (so a step re-run after the restart is still seen) and
        the checkpoints: what the old manager wrote is what this one knows.
        """
        db = self.events.db
        job = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM job")}
        self.generation = int(job.get("generation", -1))
        self.started_at = float(job.get("started_at", self.started_at))
        self.machine.state = JobState(job.get("state", JobState.RUNNING.value))
        self.resumed_from = job.get("resumed_from")
        self.last_checkpoint = job.get("last_checkpoint")
        self.rerun_steps = set(job.get("rerun_steps", []))
        if "nodes" in job:
            self._set_layout([int(n) for n in job["nodes"]], persist=False)
        for (data,) in db.execute("SELECT data FROM ranks"):
            view = json.loads(data)
            info = self.ranks.get(int(view["rank"]))
            if info is None:
                continue
            info.pid, info.step, info.generation = int(view["pid"]), int(view["step"]), int(view["generation"])
            info.state, info.restarts = RankState(view["state"]), int(view["restarts"])
            info.last_seen, info.incarnation = float(view["last_seen"]), int(view.get("incarnation", 0))
            self._incarnations = max(self._incarnations, info.incarnation)
        for rank, step in db.execute("SELECT rank, step FROM steps"):
            self._committed[rank].add(step)
        for info in self.ranks.values():  # a row is not rewritten per step (see _on_commit): the steps say
            steps = self._committed.get(info.rank)
            if steps:
                info.step = max(info.step, max(steps))
        open_incidents: list[Incident] = []
        for (data,) in db.execute("SELECT data FROM incidents ORDER BY id"):
            view = json.loads(data)
            incident = Incident(
                id=view["id"], kind=view["kind"], rank=view["rank"], step=view["step"], fault_t=view["fault_t"],
                recovery=view["recovery"], action=view["action"], status=view["status"],
                phases={k: view["fault_t"] + v for k, v in view["phases"].items()}, error=view["error"],
                traceback=view["traceback"], detail=view["detail"])
            self.incidents.append(incident)
            self._recovery_count = max(self._recovery_count, incident.recovery)
            if incident.status == "open" and not self.checkpoint_health.adopt(incident):
                open_incidents.append(incident)  # (failing saves are no recovery: CheckpointHealth keeps them)
        if open_incidents:
            self._recovery = Recovery(id=open_incidents[0].recovery, generation=self.generation,
                                      incidents=open_incidents)
        self.sessions = {int(n): str(s) for n, s in job.get("sessions", {}).items()}
        if job.get(REGROUP_KEY):  # a regroup under way: carried on (see undying.manager.regroup)
            self._regroup = Regroup.from_log(job[REGROUP_KEY])
        self.events.event("manager_restarted", generation=self.generation, state=self.state.value,
                          incidents=len(self.incidents), open_incidents=[i.id for i in open_incidents])
        log.warning("job %s: carried on from its log: generation %d, %s, %d incident(s), steps up to %d",
                    self.config.job_id, self.generation, self.state.value, len(self.incidents),
                    max((r.step for r in self.ranks.values()), default=0))
        return dict(self.sessions)

    def reopen_generation(self) -> None:
        """After a restart: the control store is new; give it the current generation and the ranks' owners."""
        assert self._control is not None
        if self.generation < 0:
            return
        assert self._stores is not None
        store = self._stores.open(generation_store(self.generation))
        self._gen_stores[self.generation] = store
        regroup = self._regroup if self._regroup is not None and self._regroup.generation == self.generation else None
        record = GenerationRecord(self.generation, len(regroup.members) if regroup else self.world_size,
                                  self.config.host, store.port, reason="the manager restarted",
                                  members={str(r): m for r, m in regroup.members.items()} if regroup else {},
                                  purpose="regroup" if regroup else "")
        self._control.set(generation_key(self.generation), record.to_json().decode())
        self._control.set(CURRENT_KEY, str(self.generation))
        for info in self.ranks.values():
            if info.incarnation:
                self._control.set(rank_owner_key(info.rank), str(info.incarnation))

    def close(self) -> None:
        self._gen_stores.clear()
        self._control = None
        if self._stores is not None:
            self._stores.close()
        self.events.close()

    # --- generations ----------------------------------------------------------

    def _open_generation(self, reason: str, *, members: dict[int, int] | None = None,
                         purpose: str = "") -> GenerationRecord:
        """The next generation, of every rank of the layout or, for a regroup, of ``members`` (renumbered)."""
        assert self._control is not None and self._stores is not None
        previous = self.generation
        self.generation += 1
        store = self._stores.open(generation_store(self.generation))
        record = GenerationRecord(
            generation=self.generation,
            world_size=len(members) if members is not None else self.world_size,
            store_host=self.config.host,
            store_port=store.port,
            reason=reason,
            members={str(r): m for r, m in (members or {}).items()},
            purpose=purpose,
        )
        self._gen_stores[self.generation] = store
        self._control.set(generation_key(self.generation), record.to_json().decode())
        self._control.set(CURRENT_KEY, str(self.generation))
        if previous >= 0:
            self._supersede(previous, self.generation)
        self.events.event("generation_opened", generation=self.generation, reason=reason, store_port=store.port)
        self.events.set_job("generation", self.generation, flush=True)
        log.info("job %s: generation %d opened (%s)", self.config.job_id, self.generation, reason)
        return record

    def _supersede(self, old: int, new: int) -> None:
        """Fence the old generation: mark it and close its store, so waits on it fail at once."""
        assert self._control is not None
        raw = self._control.get(generation_key(old))
        record = GenerationRecord.from_json(raw)
        superseded = GenerationRecord(**{**record.__dict__, "status": "superseded", "superseded_by": new})
        self._control.set(generation_key(old), superseded.to_json().decode())
        store = self._gen_stores.pop(old, None)
        if store is not None:
            store.close()

    def _spawn(self, rank: int, record: GenerationRecord, *, joining: bool, resume_from: str = "") -> bool:
        """Give ``rank`` a process; True when it was a warm spare."""
        info = self.ranks[rank]
        agent = self._agents[info.node]
        # The rank now belongs to the process about to start: any older one is fenced out of every
        # later generation (it reads the owner before joining), even one on a host cut off meanwhile.
        self._incarnations += 1
        info.incarnation = self._incarnations
        assert self._control is not None
        self._control.set(rank_owner_key(rank), str(info.incarnation))
        pid, warm = agent.spawn(rank, record, joining=joining, resume_from=resume_from,
                                incarnation=info.incarnation)
        info.pid = pid  # 0 for a node across the network until it says which (on_spawned)
        info.state = RankState.STARTING
        info.generation = record.generation
        info.last_seen = time.time()
        if joining:
            info.restarts += 1
        self.events.event("spawned", generation=record.generation, rank=rank, pid=pid, joining=joining, spare=warm)
        self._persist_rank(info)
        return warm

    # --- reports from agents --------------------------------------------------

    def on_exit(self, rank: int, pid: int, returncode: int, t: float) -> None:
        self.events.event("exited", generation=self.generation, rank=rank, pid=pid, returncode=returncode)
        info = self.ranks.get(rank)
        if info is None or pid != info.pid:
            return  # a process already replaced (or numbered before a regroup); its exit is old news
        finished_steps = info.state is RankState.DONE
        info.state = RankState.EXITED
        info.last_seen = t
        self._persist_rank(info)
        if self.state in (JobState.STOPPING,) or self.state.terminal:
            return
        if self._regroup is not None:
            # Members leave once the state is saved; any other process of the old layout is no fault now.
            if rank in self._regroup.members and rank not in self._regroup.left:
                self._regroup_member_left(info, pid, returncode, t)
            return
        # A rank is finished when it exits cleanly, or when the job's final
        # barrier completed on some rank: then this one passed it too.
        if returncode == 0 or finished_steps or any(r.state is RankState.DONE for r in self.ranks.values()):
            if returncode != 0:
                self.events.event("exit_after_done", rank=rank, returncode=returncode)
            info.state = RankState.DONE
            self._finished_ranks.add(rank)
            self._persist_rank(info)
            self._maybe_succeeded()
            return
        condemned = self._condemned.pop(pid, None)
        if condemned is not None:
            self._execute(*condemned)
            return
        fatal = self._fatal.pop(pid, None)
        injected = self._injected.pop(rank, None)
        hung = self._hung.pop(pid, None)
        lost = self._node_lost.pop(pid, None)
        kind = "node-loss" if lost else "hang" if hung else "error" if fatal is not None else "crash"
        if lost:
            detected, error = t, f"node {lost[0]} lost: {lost[1]}"
        elif hung:
            last_heard, detected, phase = hung
            if phase == "step":
                error = f"no progress in step {info.step + 1} for {detected - last_heard:.1f}s (step timeout); killed"
            else:
                error = f"no heartbeat for {detected - last_heard:.1f}s ({phase} timeout); killed"
        else:
            detected, error = t, fatal.error if fatal else _describe_exit(returncode)
        if returncode == EXIT_SCRIPT_ERROR and not (lost or hung):
            kind, error = "script-error", _script_error(self.config.job_dir, rank)
        incident = self._new_incident(
            kind=kind,
            rank=rank,
            step=info.step + 1,
            fault_t=injected[0] if injected else hung[0] if hung else lost[2] if lost else t,
            detected_t=detected,
            error=error,
            traceback=fatal.traceback if fatal else "",
        )
        incident.detail["returncode"] = returncode
        incident.detail["pid"] = pid
        incident.detail["node"] = info.node
        if injected:
            incident.detail["injected"] = True
        self._handle(incident)

    def on_spawned(self, rank: int, pid: int, warm: bool, incarnation: int) -> None:
        """A node across the network started the process of a rank (a spawn returns before it knows)."""
        info = self.ranks[rank]
        if incarnation != info.incarnation:
            return  # a process the rank was taken from since: fenced by the owner key
        info.pid = pid
        self.events.event("started", generation=info.generation, rank=rank, pid=pid, spare=warm,
                          incarnation=incarnation)
        self._persist_rank(info)
        recovery = self._recovery
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
        self.events.event("node_lost", node=node, reason=reason)
        if self.state.terminal or self.state is JobState.STOPPING or node not in self._layout_nodes:
            return  # (a node the job does not train on: an elastic job's extra one)
        lost = [r for r in self.ranks.values()
                if r.node == node and r.state not in (RankState.EXITED, RankState.DONE)]
        previous = self.generation
        for info in lost:
            self._node_lost[info.pid] = (node, reason, t)
        self._one_generation = True  # every rank of the node is replaced in the same new generation
        try:
            for info in lost:
                self.on_exit(info.rank, info.pid, -int(signal.SIGKILL), t)
        finally:
            self._one_generation, self._shared_record = False, None
        for info in self.ranks.values():
            if info.node != node and info.state is not RankState.EXITED and info.generation <= previous:
                self._agents[info.node].abort(info.rank, previous, f"node {node} lost")

    def on_node_joined(self, node: int, session: str, host: str, live: dict[int, int]) -> None:
        self.events.event("node_joined", node=node, session=session, host=host, live=live)
        self.sessions[node] = session
        self.events.set_job("sessions", self.sessions, flush=True)
        agent = self._agents.get(node)  # its welcome carried the trace switch
        if agent is not None and self.state is not JobState.STARTING:
            agent.keep_spares()
        if self._regroup is not None:
            self._maybe_form_world()
        else:
            self._maybe_grow()

    def _maybe_grow(self) -> None:
        """An elastic job below MAX with a node here that it does not train on: regroup to take it in.

        Only while the job runs undisturbed: a node that joins during a recovery
        is taken once it completed; none once a rank finished its last step.
        """
        extra = [n for n in self._nodes_available() if n not in self._layout_nodes]
        if (not self.config.elastic or not extra or self.state is not JobState.RUNNING or self._recovery is not None
                or len(self._layout_nodes) >= self.config.nnodes
                or any(r.state is RankState.DONE for r in self.ranks.values())):
            return
        now = time.time()
        view = self._agents[extra[0]].view()
        incident = self._new_incident(kind="node-joined", rank=-1, step=max(r.step for r in self.ranks.values()),
                                      fault_t=now, detected_t=now,
                                      error=f"node{'s' if len(extra) > 1 else ''} {', '.join(map(str, extra))} "
                                            f"joined ({view.get('host', '')})")
        incident.action = "regroup"
        incident.phases["decided"] = now
        self.events.incident(incident)
        grown = min(self.config.nnodes, len(self._layout_nodes) + len(extra))
        self._begin_regroup(f"node{'s' if len(extra) > 1 else ''} {', '.join(map(str, extra))} joined: the job "
                            f"grows to {grown} nodes")

    def welcome_trace(self) -> TraceSet:
        return self._trace_message()

    def on_message(self, message: Message) -> None:
        if getattr(message, "rank", 0) not in self.ranks:
            return  # a process numbered before a regroup, its last words
        if isinstance(message, StepCommitted):
            self._on_commit(message)
        elif isinstance(message, Hello):
            self._on_hello(message)
        elif isinstance(message, Progress):
            self._on_progress(message)
        elif isinstance(message, CommFailure):
            self._on_comm_failure(message)
        elif isinstance(message, TraceSummary):
            self._on_trace_summary(message)
        elif isinstance(message, FaultInjected):
            if message.kind != "slow":  # a slowdown is no fault a later exit should be timed from
                self._injected[message.rank] = (message.t, message.kind)
            self.events.event("fault_injected", rank=message.rank, kind=message.kind, step=message.step, phase=message.phase)
        elif isinstance(message, Fatal):
            info = self.ranks[message.rank]
            self._fatal[info.pid] = message
            self.events.event("user_error", rank=message.rank, step=message.step, error=message.error, traceback=message.traceback)
        elif isinstance(message, CheckpointSaved):
            self._on_checkpoint(message)
        elif isinstance(message, StopProposal):
            self._proposals[message.rank] = message.step
            self.events.event("stop_proposed", generation=message.generation, rank=message.rank, step=message.step)
        elif isinstance(message, Terminated):
            self.events.event("sigterm", rank=message.rank)
            self.preempt(f"SIGTERM to rank {message.rank}", rank=message.rank, t=message.t)
        elif isinstance(message, RankSpawned):  # a local agent gave the rank another process (a spare stuck)
            self.on_spawned(message.rank, message.pid, message.warm, message.incarnation)
        elif isinstance(message, SpareEvent):
            self.events.event(message.what, node=message.node, pid=message.pid, **message.detail)
        elif isinstance(message, Done):
            info = self.ranks[message.rank]
            info.state = RankState.DONE
            info.digest = message.digest
            info.step = message.step
            self.events.event("done", rank=message.rank, step=message.step, digest=message.digest)
            self._persist_rank(info)
            self._maybe_finish_recovery(message.rank, message.t, message_generation=self.generation)
        else:
            log.warning("unexpected message %r", message)

    def on_messages(self, messages: list[Message]) -> None:
        """Workers' messages that came together (a node's batch), in order, as ``on_message`` takes each.

        A run of commits has its step rows written with one statement, before
        any of them is handled (a log commit made while handling them holds
        them all).
        """
        commits: list[StepCommitted] = []
        for message in messages:
            if isinstance(message, StepCommitted):
                commits.append(message)
                continue
            if commits:
                self._on_commits(commits)
                commits = []
            self.on_message(message)
        if commits:
            self._on_commits(commits)

    def _on_commits(self, commits: list[StepCommitted]) -> None:
        commits = [m for m in commits if m.rank in self.ranks]  # (not a process numbered before a regroup)
        self.events.steps([(m.rank, m.step, m.generation, m.t, m.metrics) for m in commits])
        for message in commits:
            self._on_commit(message, logged=True)
        self.events.changed()  # their ranks rows are due at the next flush, also when one ran in between

    def on_hang(self, rank: int, pid: int, phase: str, last_seen: float, t: float) -> None:
        """A rank fell silent: kill it; its exit is then recovered as a hang (replace)."""
        info = self.ranks[rank]
        if pid != info.pid or self.state is JobState.STOPPING or self.state.terminal:
            return
        if info.state is RankState.DONE:
            return  # finished its steps; a slow interpreter shutdown is not a hang
        if pid in self._hung:
            return  # already being killed
        self._hung[pid] = (last_seen, t, phase)
        self.events.event("hang_detected", generation=self.generation, rank=rank, pid=pid, phase=phase,
                          silent_s=round(t - last_seen, 3), step=info.step + 1)
        self._agents[info.node].kill(rank, signal.SIGKILL)

    def on_stall(self, progress: list[RankProgress], limit: float, t: float) -> None:
        """Ranks beat but make no progress for ``limit`` seconds: kill the ones the others wait for.

        When no rank lags (every one is inside the same collective), no process
        is to blame: it is the link, and the collective is retried in place.
        While a recovery runs, ranks look stuck until they hear of it; then
        only a rank still in a step of the old generation ``limit`` seconds
        after the recovery began is stuck.
        """
        if self.state is JobState.STOPPING or self.state.terminal:
            return
        recovery = self._recovery
        if recovery is not None:
            culprits = sorted(p.rank for p in progress if p.phase == "step" and p.generation < self.generation
                              and t - max(p.progress_t, recovery.started) > limit)
        elif self._hung:
            return  # a stuck rank is being killed; the ones waiting for it are not stuck
        else:
            culprits = stall_culprits(progress)
        by_rank = {p.rank: p for p in progress}
        stuck_ranks = [p for p in progress if p.phase == "step" and p.generation == self.generation]
        if not culprits and (recovery is not None or not stuck_ranks):
            log.debug("stall report explained by the recovery under way: %s", progress)
            return
        self.events.event("stall_detected", generation=self.generation, culprits=culprits, limit_s=round(limit, 3),
                          progress=[dataclasses.asdict(p) for p in progress])
        for rank in culprits:
            stuck = by_rank[rank]
            self.on_hang(rank, stuck.pid, "step", stuck.progress_t, t)
        if culprits:
            return
        first = min(stuck_ranks, key=lambda p: (p.progress_t, p.rank))
        incident = self._new_incident(
            kind="comm-error", rank=first.rank, step=first.step, fault_t=first.progress_t, detected_t=t,
            error=f"every rank is stuck in the same collective (#{first.collectives} of generation "
                  f"{first.generation}) for {t - first.progress_t:.1f}s; no rank lags, so the link is to blame",
        )
        incident.detail["stuck_collective"] = True
        self._handle(incident)

    def _on_hello(self, message: Hello) -> None:
        self.events.event("joined", generation=message.generation, rank=message.rank, pid=message.pid, joining=message.joining)
        info = self.ranks[message.rank]
        info.pid = message.pid
        info.last_seen = message.t
        info.state = RankState.RECOVERING if message.joining else RankState.STARTING
        if self._recovery is not None and message.rank in self._recovery.replaced:
            self._recovery.ready[message.rank] = message.t
        self._persist_rank(info)

    def _on_commit(self, message: StepCommitted, *, logged: bool = False) -> None:
        info = self.ranks[message.rank]
        if message.step in self._committed[message.rank]:
            self.rerun_steps.add(message.step)
            self.events.event("step_rerun", rank=message.rank, step=message.step)
        self._committed[message.rank].add(message.step)
        previous = self._last_commit_t.get(message.rank)
        if previous is not None and previous[0] == message.step - 1:
            self._step_s.append(message.t - previous[1])
        self._last_commit_t[message.rank] = (message.step, message.t)
        self._note_step_time(message)
        # A rank that goes on training changes only its step, which the steps table holds (restore reads
        # it back): its row is rewritten only when its state or generation changes, so a flush after a
        # step of thousands of ranks writes no ranks rows.
        moved = info.state is not RankState.RUNNING or info.generation != message.generation
        info.step = message.step
        info.generation = message.generation
        info.state = RankState.RUNNING
        info.last_seen = message.t
        if not logged:  # (on_messages writes a run's rows together)
            self.events.step(message.rank, message.step, message.generation, message.t, message.metrics)
        if moved:
            self._dirty_ranks.add(info.rank)  # its row is written as the log commits
        if self.state is JobState.STARTING:
            self._move(JobState.RUNNING)
        self._maybe_finish_recovery(message.rank, message.t, message_generation=message.generation)

    def _on_trace_summary(self, message: TraceSummary) -> None:
        """A rank's window of step phases; slow-rank detection runs on them (no raw records here)."""
        for finding in self._detector.add(message.summary):
            self._on_slow(finding)

    def _on_slow(self, finding: Finding) -> None:
        """A slow rank or node: an incident to see and act on; nothing is recovered, the job trains on."""
        now = time.time()
        incident = Incident(
            id=len(self.incidents) + 1, kind=finding.kind, rank=finding.rank, step=finding.since_step,
            fault_t=now, recovery=0, action="report", status="observed", error=finding.describe(),
            detail={**finding.to_dict(), "node": finding.node},
        )
        incident.phases["detected"] = now
        self.incidents.append(incident)
        self.events.incident(incident)
        log.warning("job %s gen %d: %s", self.config.job_id, self.generation, finding.describe())

    def _note_step_time(self, message: StepCommitted) -> None:
        """A step is done when every rank committed it; its time is from the previous step's done."""
        commits = self._step_commits.setdefault(message.step, {})
        commits[message.rank] = message.t
        if len(commits) < self.world_size:
            return
        done = max(commits.values())
        del self._step_commits[message.step]
        previous = self._step_done.get(message.step - 1)
        self._step_done[message.step] = done
        if previous is not None and done > previous:
            self.step_times.append((message.step, round(done - previous, 6)))
        for old in [s for s in self._step_done if s < message.step - 2]:
            del self._step_done[old]
        for old in [s for s in self._step_commits if s < message.step - 100]:
            del self._step_commits[old]

    def _on_progress(self, message: Progress) -> None:
        info = self.ranks[message.rank]
        info.generation = message.generation
        info.last_seen = message.t
        self.events.event(message.phase, generation=message.generation, rank=message.rank, step=message.step, **message.detail)
        if message.phase == "state_size":
            self._state_bytes = int(message.detail.get("bytes", 0))
        elif message.phase == "state_layout":
            self._state_layout = dict(message.detail)
        recovery = self._recovery
        if recovery is None or message.generation != recovery.generation:
            return
        if message.phase in ("shards_restored", "rolled_back") and message.rank == 0:
            # What the ranks did, which the plan made at the incident could only foresee.
            for incident in recovery.incidents:
                incident.detail["restored"] = message.detail.get("plan") or message.detail.get("reason", "")
                incident.detail["lost_steps"] = int(message.detail.get("lost_steps", 0))
                if message.phase == "rolled_back":
                    incident.detail["checkpoint"] = message.detail.get("checkpoint", "")
                self.events.incident(incident)
        if message.phase == "group_rebuilt":
            recovery.group_rebuilt[message.rank] = message.t
        elif message.phase == "state_restored":
            recovery.state_restored[message.rank] = message.t
            recovery.restored_step = message.step

    def _on_comm_failure(self, message: CommFailure) -> None:
        info = self.ranks[message.rank]
        info.state = RankState.RECOVERING
        info.last_seen = message.t
        self.events.event("comm_failure", generation=message.generation, rank=message.rank, step=message.step, error=message.error)
        self._persist_rank(info)
        if self._regroup is not None:  # the regroup's group broke: it re-plans (after the grace), no retry
            self._regroup.group_broke(message.generation, f"rank {message.rank}'s group broke ({message.error})",
                                      self.config.timeouts.comm_error_grace)
            return
        if message.generation < self.generation:
            return  # the manager already moved on; the worker follows
        task = asyncio.get_running_loop().create_task(self._comm_failure_grace(message))
        self._grace_tasks.add(task)
        task.add_done_callback(self._grace_tasks.discard)

    async def _comm_failure_grace(self, message: CommFailure) -> None:
        """A collective failed. If no process exits meanwhile, it was the link: retry."""
        await asyncio.sleep(self.config.timeouts.comm_error_grace)
        # A rank that reported an error in the user's code is on its way out (its interpreter tears
        # down, which takes seconds on a busy machine): its exit, not the link, is what failed.
        patience = time.monotonic() + 10 * self.config.timeouts.comm_error_grace
        while self._fatal and time.monotonic() < patience and self.generation == message.generation:
            await asyncio.sleep(0.05)
        if self.generation != message.generation or self.state not in (JobState.RUNNING, JobState.RECOVERING, JobState.STARTING):
            return
        if any(i.step == message.step for i, _ in self._condemned.values()):
            return  # already escalated: a rank of this failure is being replaced
        # An injected link fault names its rank and time; otherwise the first to report.
        injected = [(t, r) for r, (t, kind) in self._injected.items() if kind == "comm-error"]
        rank, fault_t = message.rank, message.t
        if injected:
            fault_t, rank = min(injected)
            del self._injected[rank]
        incident = self._new_incident(
            kind="comm-error",
            rank=rank,
            step=message.step,
            fault_t=fault_t,
            detected_t=time.time(),
            error=message.error,
        )
        incident.detail["injected"] = bool(injected)
        self._handle(incident)

    # --- decisions ------------------------------------------------------------

    def _new_incident(self, *, kind: str, rank: int, step: int, fault_t: float, detected_t: float,
                      error: str = "", traceback: str = "") -> Incident:
        if self._recovery is None:
            self._recovery_count += 1
            self._recovery = Recovery(id=self._recovery_count, generation=self.generation)
        incident = Incident(
            id=len(self.incidents) + 1,
            kind=kind,
            rank=rank,
            step=step,
            fault_t=min(fault_t, detected_t),
            recovery=self._recovery.id,
            error=error,
            traceback=traceback,
        )
        incident.phases["detected"] = detected_t
        self.incidents.append(incident)
        self._recovery.incidents.append(incident)
        return incident

    def _plan_restore(self, incident: Incident) -> None:
        """Where every rank's state comes from after this incident (the restore planner), for the record.

        Under DDP every survivor holds the whole state, so any one is a peer of
        every rank; with none left the checkpoint is the source and the job
        rolls back to it, or no complete state exists and the planner says so.
        """
        recovery = self._recovery
        replaced = recovery.replaced if recovery else set()
        failed = {r.rank for r in self.ranks.values()
                  if r.rank == incident.rank or r.state is RankState.EXITED or r.rank in replaced}
        ckpt = self._restart_from
        newest = max((r.step for r in self.ranks.values()), default=0)
        if ckpt is not None:
            newest = max(newest, ckpt.step)  # ranks that resumed from it and committed nothing yet report 0
        try:
            if self._state_layout.get("sharded"):
                # Every rank holds a shard of its own (dp=1, tp=world); a ring replica is on rank + offset.
                n, offset = self.world_size, int(self._state_layout.get("offset", 0))
                ring = self._state_layout.get("replicate") == "ring" and offset > 0
                plan = plan_restore(
                    Layout(dp=1, tp=n), failed,
                    replica_of={(r + offset) % n: r for r in range(n)} if ring else None,
                    checkpoint=PersistedState(ckpt.step, path=ckpt.url) if ckpt else None, current_step=newest,
                )
            else:
                plan = plan_for_ddp(self.world_size, failed, ckpt.step if ckpt else None,
                                    current_step=newest, checkpoint_path=ckpt.url if ckpt else "")
        except (MissingShardsError, LayoutError) as e:
            incident.detail["restore_plan"] = str(e)
            return
        except Exception:  # the plan is for the record: a planner bug must never stop a recovery
            log.exception("job %s: the restore planner failed on incident %d", self.config.job_id, incident.id)
            return
        incident.detail["restore_plan"] = plan.describe()

    def _holders_alive(self, excluding: int) -> int:
        recovery = self._recovery
        replaced = recovery.replaced if recovery else set()
        return sum(
            1
            for r in self.ranks.values()
            if r.rank != excluding and r.state is not RankState.EXITED and r.rank not in replaced
        )

    def _handle(self, incident: Incident) -> None:
        holders = self._holders_alive(incident.rank)
        # The restart rung needs the latest valid checkpoint; only looked for when no peer holds the state
        # (sharded state without ring replicas: a lost shard is only there, the ranks roll back to it).
        sharded_alone = self._state_layout.get("sharded") and self._state_layout.get("replicate") != "ring"
        self._restart_from = self._latest_checkpoint() if holders == 0 or sharded_alone else None
        self._plan_restore(incident)
        decision = decide(
            incident,
            self.incidents,
            PolicyContext(self.config.max_restarts, holders, self.config.max_retries,
                          checkpoint_step=self._restart_from.step if self._restart_from else None,
                          restarts=self._restarts),
        )
        incident.action = decision.action.value
        incident.phases["decided"] = time.time()
        incident.detail["reason"] = decision.reason
        self.events.event("decided", rank=incident.rank, incident=incident.id, action=decision.action.value, reason=decision.reason)
        log.warning(
            "job %s gen %d: %s of rank %d at step %d -> %s (%s)",
            self.config.job_id, self.generation, incident.kind, incident.rank, incident.step,
            decision.action.value, decision.reason,
        )
        if decision.action is Action.FAIL:
            incident.status = "failed"
            self.events.incident(incident)
            report = decision.reason
            if incident.traceback:
                report += "\n" + incident.traceback
            self.fail(report)
            return
        self.events.incident(incident)
        self._move(JobState.RECOVERING)
        info = self.ranks[incident.rank]
        if decision.action is Action.REPLACE and info.state is not RankState.EXITED:
            # Escalated from retries: the process lives. Kill it; its exit carries on here.
            self._condemned[info.pid] = (incident, decision)
            self._agents[info.node].kill(incident.rank, signal.SIGKILL)
            return
        self._execute(incident, decision)

    def _execute(self, incident: Incident, decision: Decision) -> None:
        previous = self.generation
        if self._shared_record is not None and decision.action is Action.REPLACE:
            record = self._shared_record
        else:
            record = self._open_generation(f"{incident.kind} of rank {incident.rank}: {decision.action.value}")
            if self._one_generation:
                self._shared_record = record
        if incident.detail.get("stuck_collective"):
            # Nothing failed by itself: every rank is told to leave the stuck group.
            for info in self.ranks.values():
                if info.state is not RankState.EXITED:
                    self._agents[info.node].abort(info.rank, previous, f"stuck collective: {decision.action.value}")
        assert self._recovery is not None
        self._recovery.generation = record.generation
        self._recovery.group_rebuilt.clear()
        self._recovery.state_restored.clear()
        self._recovery.first_step.clear()
        if decision.action is Action.REPLACE:
            self._recovery.replaced.add(incident.rank)
            self._recovery.ready.pop(incident.rank, None)
            warm = self._spawn(incident.rank, record, joining=True)
            incident.detail["replacement"] = "warm spare" if warm else "new process"
            self.events.incident(incident)
        elif decision.action is Action.RESTART:
            self._restart_all(incident, record)

    def _restart_all(self, incident: Incident, record: GenerationRecord) -> None:
        """The restart rung: new processes for every rank, all starting from the latest valid checkpoint.

        Replacements already started for the dead ranks wait for a donor that no
        longer exists: they are killed too. The steps since the checkpoint are
        re-run (and counted as lost).
        """
        assert self._recovery is not None and self._restart_from is not None
        ckpt = self._restart_from
        self._restarts += 1
        newest = max((r.step for r in self.ranks.values()), default=0)
        for info in self.ranks.values():
            if info.state is not RankState.EXITED:
                self._agents[info.node].kill(info.rank, signal.SIGKILL)
        for info in self.ranks.values():
            self._recovery.replaced.add(info.rank)
            self._recovery.ready.pop(info.rank, None)
            self._spawn(info.rank, record, joining=False, resume_from=ckpt.url)
        incident.detail.update({"checkpoint": ckpt.url, "checkpoint_step": ckpt.step,
                                "lost_steps": max(0, newest - ckpt.step), "restart": self._restarts})
        self.events.event("restarted", generation=record.generation, step=ckpt.step, path=ckpt.url,
                          kind=ckpt.kind, lost_steps=max(0, newest - ckpt.step), restart=self._restarts)
        self.events.incident(incident)
        log.warning("job %s gen %d: every rank restarts from %s (step %d); steps %d..%d are re-run",
                    self.config.job_id, record.generation, ckpt.url, ckpt.step, ckpt.step + 1, newest)

    # --- regrouping: the job on another set of nodes ----------------------------

    def _nodes_available(self) -> list[int]:
        """The nodes whose agent is here now, in order (a standalone agent always is)."""
        return sorted(n for n, a in self._agents.items() if a.attached)

    def _lost_nodes(self) -> list[int]:
        """Nodes the job trains on whose agent is gone."""
        available = set(self._nodes_available())
        return [n for n in self._layout_nodes if n not in available]

    def _set_layout(self, nodes: list[int], *, step: int = 0, persist: bool = True) -> None:
        """The job trains on ``nodes`` from now on: its ranks are numbered anew, node by node."""
        per_node = self.config.nproc_per_node
        self._layout_nodes = list(nodes)
        self.ranks = {
            slot * per_node + local: RankInfo(rank=slot * per_node + local, node=node, step=step)
            for slot, node in enumerate(nodes) for local in range(per_node)
        }
        self._detector = SlowDetector(world_size=self.world_size)
        self._step_commits.clear()
        self._last_commit_t.clear()
        if persist:
            self.events.db.execute("DELETE FROM ranks WHERE rank >= ?", (self.world_size,))
            for info in self.ranks.values():
                self._persist_rank(info)
            self.events.set_job("world_size", self.world_size)
            self.events.set_job("nodes", self._layout_nodes, flush=True)

    def _begin_regroup(self, why: str, *, again: Regroup | None = None) -> None:
        """Go on with the nodes the job has now: save the state they hold, then start again from it.

        The live ranks meet in a regroup generation of their own, renumbered,
        agree on one state as in any recovery (the newest step one of them
        holds cleanly) and save it; every one then leaves, and the job starts
        again on the nodes it has from that checkpoint (``_maybe_form_world``):
        no completed step is lost. A new world size changes what every rank's
        script builds (samplers, schedules), hence new processes rather than
        survivors renumbered in place, as torchrun restarts its workers when an
        elastic job's membership changes. A sharded state is not whole on the
        survivors (a lost node's shards and their replicas were there): it
        starts again from the latest persisted checkpoint, its steps since re-run.
        ``again``: the regroup under way broke (a member lost before the state
        was saved): its live members meet in a new regroup generation.
        """
        available = set(self._nodes_available())
        for agent in self._agents.values():
            agent.drop_waiting()  # replacements waiting for a lost node's host: no longer wanted
        live = sorted(r for a in self._agents.values() for r in a.live_ranks()
                      if r in self.ranks and self.ranks[r].node in available
                      and self.ranks[r].state is not RankState.EXITED)
        newest = max((r.step for r in self.ranks.values()), default=0)
        regroup = (again.successor(live, newest) if again is not None
                   else Regroup(why=why, members={r: i for i, r in enumerate(live)}, step=newest, first_members=len(live)))
        self._regroup = regroup
        self._move(JobState.RECOVERING)
        sharded = bool(self._state_layout.get("sharded"))
        if live and not sharded:
            previous = self.generation
            record = self._open_generation(f"regroup: {regroup.cause()}", members=regroup.members, purpose="regroup")
            regroup.generation = record.generation
            for rank in live:
                self._agents[self.ranks[rank].node].abort(rank, previous, why)
        else:
            for rank in live:
                self._agents[self.ranks[rank].node].kill(rank, signal.SIGKILL)
        self.events.event("regroup", why=why, members=live, generation=regroup.generation, step=newest,
                          nodes=sorted(available), sharded=sharded, attempt=regroup.attempt, faults=regroup.faults)
        self._persist_regroup()
        log.warning("job %s: %s; %s", self.config.job_id, regroup.cause(),
                    f"ranks {live} save the state of their newest step, then the job starts again from it"
                    if regroup.generation >= 0 else "the job starts again from its latest checkpoint")
        self._maybe_form_world()

    def _maybe_form_world(self) -> None:
        """Once every member left: start the job on the nodes here from the saved state, or wait for nodes."""
        regroup = self._regroup
        if regroup is None or regroup.remaining():
            return
        if regroup.restored_at and time.time() - regroup.restored_at < self.config.timeouts.heartbeat and not all(
                a.attached for a in self._agents.values()):
            return  # a restarted manager: the agents have their heartbeat timeout to come back (the watch retries)
        if regroup.checkpoint is None:
            # The members saved synchronously before they left: the newest valid checkpoint is theirs.
            regroup.checkpoint = self._latest_checkpoint()
        ckpt = regroup.checkpoint
        nodes = self._nodes_available()[: self.config.nnodes]
        if ckpt is None:
            self.fail(f"{regroup.cause()}: no rank saved the state (exits: {regroup.left or 'none alive'}) and there "
                      f"is no checkpoint in {self.checkpoint_dir} to start from")
            return
        if len(nodes) < self.config.fewest_nodes:
            if not regroup.waiting_since:
                regroup.waiting_since = time.time()
                self._persist_regroup()
                self.events.event("waiting_for_nodes", nodes=nodes, need=self.config.fewest_nodes,
                                  checkpoint=ckpt.url, step=ckpt.step)
                log.warning("job %s: the state of step %d is saved (%s); waiting for %d node(s), %d here: start "
                            "`undying run --node-rank I --manager ...` on a host", self.config.job_id, ckpt.step,
                            ckpt.url, self.config.fewest_nodes, len(nodes))
            return
        lost = max(0, regroup.step - ckpt.step)
        before = (list(self._layout_nodes), self.world_size)
        self._set_layout(nodes, step=ckpt.step)
        record = self._open_generation(f"{len(nodes)} node(s) {nodes}, {self.world_size} ranks, from step {ckpt.step}")
        recovery = self._recovery
        assert recovery is not None  # a regroup starts from an incident (a node lost, or one joining)
        recovery.generation = record.generation
        recovery.replaced = set(self.ranks)
        for phase in (recovery.ready, recovery.group_rebuilt, recovery.state_restored, recovery.first_step):
            phase.clear()
        for info in self.ranks.values():
            self._spawn(info.rank, record, joining=False, resume_from=ckpt.url)
        detail: dict[str, Any] = {"from_nodes": before[0], "from_world_size": before[1], "nodes": nodes,
                  "world_size": self.world_size, "checkpoint": ckpt.url, "checkpoint_step": ckpt.step,
                  "checkpoint_kind": ckpt.kind, "waited_for_nodes_s": round(time.time() - regroup.waiting_since, 3)
                  if regroup.waiting_since else 0.0, "attempts": regroup.attempt, "faults": regroup.faults}
        for incident in recovery.incidents:
            incident.action = "regroup"
            incident.detail["regroup"] = detail
            incident.detail["lost_steps"] = lost
            incident.phases.setdefault("checkpoint_written", time.time())
            self.events.incident(incident)
        self.events.event("regrouped", generation=record.generation, lost_steps=lost, detail=detail)
        log.warning("job %s gen %d: regrouped on node(s) %s (%d ranks, was %d) from %s (step %d)%s",
                    self.config.job_id, record.generation, nodes, self.world_size, before[1], ckpt.url, ckpt.step,
                    f"; steps {ckpt.step + 1}..{regroup.step} are re-run" if lost else ", no step lost")
        self._regroup = None
        self._persist_regroup()

    def _watch_regroup(self, regroup: Regroup) -> None:
        now = time.time()
        if regroup.replan_due(now):  # a second fault broke it before the state was saved
            if regroup.attempt >= max_attempts(regroup.first_members, self.config.max_retries):
                self._fail_recovery(f"{regroup.cause()}; the regroup broke {regroup.attempt} times, its limit")
            else:
                self._begin_regroup(regroup.why, again=regroup)
            return
        for rank in regroup.to_release():  # the state is saved: whoever is left holds nothing more
            regroup.released.append(rank)
            self._persist_regroup()
            self._agents[self.ranks[rank].node].kill(rank, signal.SIGKILL)
        self._maybe_form_world()  # (also what a restarted manager waited for)
        if self._regroup is not regroup:
            return
        if regroup.waiting_since:
            if now - regroup.waiting_since <= self.config.timeouts.rendezvous:
                return
            have = self._nodes_available()
            saved = regroup.checkpoint.url if regroup.checkpoint is not None else regroup.saved
            step = regroup.checkpoint.step if regroup.checkpoint is not None else regroup.step
            self._fail_recovery(
                f"{regroup.cause()}; the job needs {self.config.fewest_nodes} node(s) and has {len(have)} ({have}), "
                f"and none joined within the rendezvous timeout ({self.config.timeouts.rendezvous:.0f}s). The state "
                f"of step {step} is saved in {saved}: start the missing nodes "
                "(`undying run --node-rank I --manager ...`) and run the job again to resume from it")
        elif now - regroup.started > self.config.timeouts.recovery:
            still = sorted(set(regroup.members) - set(regroup.left))
            self._fail_recovery(f"{regroup.cause()}; ranks {still} did not save and leave within the recovery "
                                f"timeout ({self.config.timeouts.recovery:.0f}s)")

    def _regroup_member_left(self, info: RankInfo, pid: int, returncode: int, t: float) -> None:
        """A member of the regroup ended: it left as asked, or a second fault overlapped the regroup.

        A fault is an incident of the regroup's recovery (recovered when the job
        starts again) and makes the regroup re-plan with the members it has left.
        """
        assert self._regroup is not None
        lost, hung = self._node_lost.pop(pid, None), self._hung.pop(pid, None)
        what = (f"node {lost[0]} lost ({lost[1]})" if lost else
                f"rank {info.rank} hung ({hung[2]} timeout)" if hung else f"rank {info.rank} {_describe_exit(returncode)}")
        if self._regroup.member_left(info.rank, returncode, what):
            incident = self._new_incident(kind="node-loss" if lost else "hang" if hung else "crash", rank=info.rank,
                                          step=info.step + 1, fault_t=t, detected_t=t, error=f"{what} during the regroup")
            incident.action = "regroup"
            incident.phases["decided"] = time.time()
            incident.detail.update({"returncode": returncode, "pid": pid, "node": info.node})
            self.events.incident(incident)
            log.warning("job %s gen %d: %s during the regroup; %s", self.config.job_id, self.generation, what,
                        "the state is saved" if self._regroup.saved else
                        "the members left meet again" if self._regroup.remaining() else "no member is left")
        self._persist_regroup()
        self._maybe_form_world()

    def _persist_regroup(self) -> None:
        self.events.set_job(REGROUP_KEY, self._regroup.to_log() if self._regroup is not None else None)

    def _fail_recovery(self, reason: str) -> None:
        if self._recovery is not None:
            for incident in self._recovery.incidents:
                incident.status = "failed"
                self.events.incident(incident)
        self.fail(reason)

    # --- checkpoints ----------------------------------------------------------

    def _latest_checkpoint(self) -> Checkpoint | None:
        """The newest valid checkpoint; every newer one skipped is logged with why."""
        try:
            latest = latest_valid(self.checkpoint_dir)
        except Exception as e:  # an unreachable store is no checkpoint, said once
            self.events.event("checkpoint_unreadable", path=self.checkpoint_dir, error=f"{type(e).__name__}: {e}")
            return None
        self._last_skipped = list(latest.skipped)
        for name, reason in latest.skipped:
            self.events.event("checkpoint_skipped", name=name, reason=reason)
        return latest.checkpoint

    async def _find_resume_point(self) -> Checkpoint | None:
        ckpt = await asyncio.to_thread(self._latest_checkpoint)
        if ckpt is None:
            if self._last_skipped and not self.config.start_fresh:
                # Starting from step 1 silently would throw away a run whose checkpoints only need fixing.
                reasons = "; ".join(f"{name}: {reason}" for name, reason in self._last_skipped)
                error = UsageError(
                    f"every checkpoint in {self.checkpoint_dir} was rejected ({reasons}); fix or move them, or pass "
                    "--start-fresh to train from step 1 (the rejected checkpoints are kept)")
                self.events.event("checkpoints_rejected", path=self.checkpoint_dir,
                                  rejected=[{"name": n, "reason": r} for n, r in self._last_skipped])
                self.events.set_job("exit_reason", str(error), flush=True)
                raise error
            return None
        try:  # another job's checkpoint: refused when --job-id named this job, else resumed and said
            other_job = check_same_job(ckpt, self.config.job_id, self.config.job_id_given)
        except CheckpointOfAnotherJobError as e:
            self.events.event("checkpoint_refused", name=ckpt.name, path=ckpt.url, reason=str(e))
            self.events.set_job("exit_reason", str(e), flush=True)
            raise
        if other_job is not None:
            log.warning("job %s: %s", self.config.job_id, other_job)
        skipped = [{"name": n, "reason": r} for n, r in self._last_skipped]
        of_job = ckpt.manifest.job_id if ckpt.manifest is not None else ""
        self.resumed_from = {"step": ckpt.step, "path": ckpt.url, "kind": ckpt.kind, "skipped": skipped,
                             "job_id": of_job}
        self.events.event("resumed", step=ckpt.step, path=ckpt.url, kind=ckpt.kind, skipped=skipped, job_id=of_job)
        self.events.set_job("resumed_from", self.resumed_from, flush=True)
        log.warning("job %s: resuming from checkpoint %s (step %d, %s)%s", self.config.job_id, ckpt.url, ckpt.step,
                    ckpt.kind, "".join(f"; skipped {d['name']}: {d['reason']}" for d in skipped))
        return ckpt

    def _on_checkpoint(self, message: CheckpointSaved) -> None:
        if message.error:
            self.events.event("checkpoint_failed", rank=message.rank, step=message.step, kind=message.kind,
                              error=message.error, os_error=message.os_error)
            self.checkpoint_health.failed(message)
            log.error("job %s: checkpoint of step %d failed: %s", self.config.job_id, message.step, message.error)
        else:
            self.events.event("checkpoint_saved", rank=message.rank, step=message.step, kind=message.kind,
                              path=message.path, blocking_s=round(message.blocking_s, 6),
                              write_s=round(message.write_s, 6), bytes=message.bytes)
            if message.bytes > 0 and message.write_s > 0:
                self._state_bytes = message.bytes
                self._write_bytes_per_s = message.bytes / message.write_s
            self.last_checkpoint = {"step": message.step, "kind": message.kind, "path": message.path,
                                    "blocking_s": message.blocking_s, "write_s": message.write_s,
                                    "bytes": message.bytes, "t": message.t}
            self.events.set_job("last_checkpoint", self.last_checkpoint)
            self.checkpoint_health.saved(message)
            if self._regroup is not None and message.kind in SAVED_KINDS:
                self._regroup.on_saved(message.path)
                self._persist_regroup()
        if self.preemption is not None and message.kind in ("dying-gasp", "existing"):
            self._gasp = message

    def grace_period(self) -> tuple[float, str]:
        """Seconds from SIGTERM to every process gone, and how the figure was reached."""
        if self.config.checkpoint.grace_period > 0:
            return self.config.checkpoint.grace_period, "--grace-period"
        step_s = max(self._step_s, default=0.0)
        if self._state_bytes and self._write_bytes_per_s:
            m = Measurement(self._state_bytes, self._write_bytes_per_s, "the last checkpoint written")
            return m.grace_period_s() + 2 * step_s, (
                f"{m.bytes} bytes at {m.write_bytes_per_s / 1e6:.1f} MB/s ({m.source}): write {m.write_s:.3f}s, "
                f"x2 margin, at least 5s, plus 2 steps of {step_s:.3f}s")
        return 5.0 + 2 * step_s, "no checkpoint measured yet: 5s plus 2 steps"

    # --- the dying gasp -------------------------------------------------------

    def preempt(self, reason: str, *, rank: int = -1, t: float | None = None) -> None:
        """SIGTERM (to the launcher, or to a worker): agree on a stop step, persist it, leave.

        A second SIGTERM while the dying gasp runs changes nothing: the one under way stands.
        """
        t = time.time() if t is None else t
        if self.preemption is not None:
            self.events.event("sigterm_again", reason=reason)
            log.warning("job %s: %s: the dying gasp under way stands", self.config.job_id, reason)
            return
        if self.state.terminal or self.state is JobState.STOPPING:
            return
        grace, how = self.grace_period()
        self.preemption = {"reason": reason, "t": t, "grace_period_s": round(grace, 3), "grace_basis": how}
        self.exit_reason = f"preempted ({reason})"
        self._move(JobState.STOPPING)
        log.warning("job %s: %s: dying gasp within a grace period of %.1fs (%s)", self.config.job_id, reason, grace, how)
        self._preempt_task = asyncio.get_running_loop().create_task(self._dying_gasp(rank, t, grace))

    async def _dying_gasp(self, rank: int, t0: float, grace: float) -> None:
        assert self.preemption is not None
        newest = max((r.step for r in self.ranks.values()), default=0)
        incident = Incident(id=len(self.incidents) + 1, kind="preempt", rank=rank, step=newest, fault_t=t0,
                            recovery=0, action="dump", error=self.preemption["reason"])
        incident.phases["detected"] = time.time()
        incident.detail["grace_period_s"] = self.preemption["grace_period_s"]
        self.incidents.append(incident)
        self.events.event("preempt", reason=self.preemption["reason"], rank=rank,
                          grace_period_s=self.preemption["grace_period_s"], grace_basis=self.preemption["grace_basis"])
        deadline = t0 + grace
        reused = None
        if self.config.checkpoint.gasp_reuse_s > 0:
            reused = await asyncio.to_thread(recent_dying_gasp, self.checkpoint_dir,
                                             within_s=self.config.checkpoint.gasp_reuse_s)
            if reused is not None and reused.step < newest:
                # Steps were trained since: reusing it would lose them. Write a new one.
                self.events.event("dying_gasp_not_reused", step=reused.step, newest_step=newest)
                reused = None
        live = {r for a in self._agents.values() for r in a.live_ranks()}
        stop_step = -1
        late: list[int] = []
        if reused is not None:
            incident.detail["reused"] = reused.url
            self.events.event("dying_gasp_reused", step=reused.step, path=reused.url,
                              age_s=round(time.time() - (reused.manifest.created_at if reused.manifest else 0), 3))
            await asyncio.gather(*(a.stop_all(self.config.timeouts.stop_grace) for a in self._agents.values()))
        else:
            # Where is every rank? None runs a step past its answer until told the stop step.
            for r in live:
                self._agents[self.ranks[r].node].tell(r, Preempt(self.generation, self.preemption["reason"]))
            answer_by = time.monotonic() + min(2.0, grace / 4)
            while time.monotonic() < answer_by and not live <= set(self._proposals):
                await asyncio.sleep(0.01)
            stop_step = max(self._proposals.values(), default=newest)
            incident.phases["decided"] = time.time()
            self.events.event("stop_step", step=stop_step, proposals=dict(self._proposals),
                              missing=sorted(live - set(self._proposals)))
            for r in live:
                self._agents[self.ranks[r].node].tell(r, StopAt(stop_step, max(0.5, deadline - time.time())))
            while time.time() < deadline and any(a.live_ranks() for a in self._agents.values()):
                await asyncio.sleep(0.02)
            late = sorted(r for a in self._agents.values() for r in a.live_ranks())
            if late:
                # Named before they go: who did not make it, and where each was.
                phases = {r: p for a in self._agents.values() for r, p in a.phases().items()}
                killed = [f"rank {r} ({phases.get(r, '?')}, last committed step {self.ranks[r].step})" for r in late]
                incident.detail["killed_ranks"] = late
                self.events.event("grace_exceeded", grace_period_s=round(grace, 3), step=stop_step, ranks=late,
                                  where=killed)
                log.error("job %s: the grace period of %.1fs passed before every rank finished step %d; killing "
                          "%s", self.config.job_id, grace, stop_step, ", ".join(killed))
                for r in late:  # as Kubernetes would at the deadline: no word, no handler
                    self._agents[self.ranks[r].node].kill(r, signal.SIGKILL)
                await asyncio.gather(*(a.stop_all(0.0) for a in self._agents.values()))
        gasp = self._gasp
        took = round(time.time() - t0, 3)
        if all(r.state is RankState.DONE for r in self.ranks.values()):
            incident.status = "ignored"
            self.events.incident(incident)
            self.exit_reason = "every rank finished its last step (a SIGTERM came at the end)"
            self._end(JobState.SUCCEEDED)
            return
        if reused is not None:
            step, path, what = reused.step, reused.url, f"reused the dying gasp written at most " \
                f"{self.config.checkpoint.gasp_reuse_s:.0f}s earlier"
        elif gasp is not None and gasp.step == stop_step and not gasp.error:
            step, path = gasp.step, gasp.path
            what = (f"dying gasp written in {gasp.write_s:.3f}s, {gasp.t - t0:.3f}s after SIGTERM"
                    if gasp.kind == "dying-gasp" else "the checkpoint of that step already existed")
            incident.phases["checkpoint_written"] = gasp.t
        else:
            latest = await asyncio.to_thread(self._latest_checkpoint)
            if gasp is not None and gasp.error:
                why = gasp.error
            elif late:
                who = f"rank {late[0]}" if len(late) == 1 else f"ranks {', '.join(map(str, late))}"
                why = f"{who} still running when the grace period of {grace:.1f}s ran out, killed"
            else:
                why = f"not written within the grace period of {grace:.1f}s"
            committed = max((r.step for r in self.ranks.values()), default=0)
            if latest is None:
                step, path, what = -1, "", f"the dying gasp of step {stop_step} was not taken ({why}) and there is no checkpoint"
            elif latest.kind == "dying-gasp" and latest.step == stop_step:
                # Written, but its report was cut off by the kill: it stands as a dying gasp.
                step, path = latest.step, latest.url
                what = f"dying gasp {latest.name} found on disk, unreported ({why})"
            else:
                step, path = latest.step, latest.url
                rerun = (f"steps {latest.step + 1}..{committed} will be re-run" if committed > latest.step
                         else "no step is lost")
                taken = "could not be written" if gasp is not None and gasp.error else "was not taken"
                what = (f"the dying gasp of step {stop_step} {taken} ({why}); the latest valid checkpoint "
                        f"{latest.name} ({latest.kind}) stands: {rerun}")
        # What a resume from that checkpoint runs again: every step committed after it (0: nothing lost).
        committed_end = max([stop_step if gasp is not None and gasp.step == stop_step and not gasp.error else -1,
                             *(r.step for r in self.ranks.values())])
        resume_reruns = max(0, committed_end - step) if step >= 0 and reused is None else 0
        if gasp is not None and gasp.error:
            incident.detail["dying_gasp_error"] = gasp.error
        incident.phases["exited"] = time.time()
        incident.status = "dumped" if step >= 0 else "failed"
        incident.detail.update({"checkpoint_step": step, "checkpoint": path, "stop_step": stop_step,
                                "dying_gasp_write_s": gasp.write_s if gasp is not None else None,
                                "sigterm_to_exit_s": took, "resume_reruns": resume_reruns})
        self.events.incident(incident)
        self.preemption.update({"checkpoint_step": step, "checkpoint": path, "stop_step": stop_step,
                                "detail": what, "sigterm_to_exit_s": took, "killed_ranks": late,
                                "dying_gasp_write_s": gasp.write_s if gasp is not None else None,
                                "dying_gasp_error": gasp.error if gasp is not None else "",
                                "resume_reruns": resume_reruns})
        self.exit_reason = (f"preempted, checkpoint at step {step} ({what}); run the same command to resume"
                            if step >= 0 else f"preempted, no checkpoint: {what}")
        self.events.event("preempted", step=step, path=path, detail=what, sigterm_to_exit_s=took,
                          resume_reruns=resume_reruns)
        self.events.set_job("preemption", self.preemption)
        log.warning("job %s: %s", self.config.job_id, self.exit_reason)
        self._end(JobState.PREEMPTED)

    def _maybe_finish_recovery(self, rank: int, t: float, *, message_generation: int) -> None:
        recovery = self._recovery
        if recovery is None or message_generation < recovery.generation or self._regroup is not None:
            return  # (a regroup's recovery ends on the new world's first step)
        recovery.first_step.setdefault(rank, t)
        if len(recovery.first_step) < self.world_size:
            return
        phases = {
            "replacement_ready": max(recovery.ready.values()) if recovery.replaced and recovery.ready else None,
            "group_rebuilt": max(recovery.group_rebuilt.values()) if recovery.group_rebuilt else None,
            "state_restored": max(recovery.state_restored.values()) if recovery.state_restored else None,
            "first_step_done": max(recovery.first_step.values()),
        }
        for incident in recovery.incidents:
            if incident.status != "open":
                continue
            incident.phases.update({k: v for k, v in phases.items() if v is not None})
            incident.status = "recovered"
            incident.detail["generation"] = recovery.generation
            incident.detail["restored_step"] = recovery.restored_step
            self.events.incident(incident)
            log.warning(
                "job %s gen %d: recovered from %s of rank %d in %.3fs (restored step %d)",
                self.config.job_id, recovery.generation, incident.kind, incident.rank,
                incident.mttr_s or -1.0, recovery.restored_step,
            )
        self._recovery = None
        if self.state is JobState.RECOVERING:
            self._move(JobState.RUNNING)
        self._maybe_grow()

    async def _watch_recovery(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            recovery = self._recovery
            if self.state.terminal or self.state is JobState.STOPPING:
                continue
            if self._regroup is not None:
                self._watch_regroup(self._regroup)
                continue
            if recovery is None:
                continue
            lost = self._lost_nodes()
            if lost and any(i.kind == "node-loss" for i in recovery.incidents):
                # Its ranks wait for a host to take them; past --node-wait the job goes on without it.
                if time.time() - recovery.started > self.config.timeouts.node_wait:
                    self._begin_regroup(
                        f"node{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost and not replaced "
                        f"within --node-wait {self.config.timeouts.node_wait:g}s")
                continue
            if time.time() - recovery.started > self.config.timeouts.recovery:
                # (A lost node's ranks never get here: past --node-wait the job regroups without them.)
                self._fail_recovery(
                    f"recovery {recovery.id} did not complete within {self.config.timeouts.recovery:.0f}s "
                    f"(generation {recovery.generation}; ranks with a first step: {sorted(recovery.first_step)})"
                )

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.events.flush()

    # --- ending ---------------------------------------------------------------

    def _maybe_succeeded(self) -> None:
        if len(self._finished_ranks) == len(self.ranks):
            last = self.last_checkpoint["step"] if self.last_checkpoint else \
                self.resumed_from["step"] if self.resumed_from else None
            self.exit_reason = "every rank finished its last step" + self.checkpoint_health.warning(
                max((r.step for r in self.ranks.values()), default=0), last)
            self._move(JobState.STOPPING)
            self._end(JobState.SUCCEEDED)

    def fail(self, reason: str) -> None:
        if self.state.terminal or self.state is JobState.STOPPING:
            return
        self.exit_reason = reason
        log.error("job %s failed: %s", self.config.job_id, reason)
        asyncio.get_running_loop().create_task(self._stop_then(JobState.FAILED))

    def stop(self, reason: str) -> None:
        if self.state.terminal or self.state is JobState.STOPPING:
            return
        self.exit_reason = reason
        asyncio.get_running_loop().create_task(self._stop_then(JobState.STOPPED))

    async def _stop_then(self, final: JobState) -> None:
        self._move(JobState.STOPPING)
        await asyncio.gather(*(a.stop_all(self.config.timeouts.stop_grace) for a in self._agents.values()))
        self._end(final)

    def _end(self, final: JobState) -> None:
        self.checkpoint_health.close()
        # No incident of a failed or stopped job stays open: what was still being handled failed with it.
        # (A preemption's incident stays open on purpose: the relaunch completes it.)
        for incident in self.incidents if final in (JobState.FAILED, JobState.STOPPED) else ():
            if incident.status == "open":
                incident.status = "failed"
                incident.detail.setdefault("closed", f"the job ended ({final.value}) before it was resolved")
                self.events.incident(incident)
        self._move(final)
        self.events.set_job("ended_at", time.time())
        self.events.set_job("exit_reason", self.exit_reason)
        self.events.set_job("rerun_steps", sorted(self.rerun_steps), flush=True)
        self._finished.set()

    def _move(self, new: JobState) -> None:
        if new is self.state and new is not JobState.RECOVERING:
            return
        self.machine.move(new)
        self.events.event("job_state", state=new.value)
        self._persist_state()

    def _persist_state(self) -> None:
        self.events.set_job("state", self.state.value, flush=True)

    def _persist_rank(self, info: RankInfo) -> None:
        self.events.rank(info.rank, info.to_dict())
        self._dirty_ranks.discard(info.rank)

    def _write_dirty_ranks(self) -> None:
        for rank in self._dirty_ranks:
            self.events.rank(rank, self.ranks[rank].to_dict())
        self._dirty_ranks.clear()

    # --- commands -------------------------------------------------------------

    def inject(self, kind: str, rank: int, at_step: int | None, phase: str | None,
               how: str | None = None, *, factor: float | None = None) -> dict[str, Any]:
        """Fault a rank now, or arm it to fault itself when it reaches ``at_step``."""
        if kind not in INJECT_KINDS:
            raise UsageError(f"unknown fault kind {kind!r}; choose one of {', '.join(INJECT_KINDS)}")
        if kind == "slow":
            return self._inject_slow(rank, at_step, phase or "compute", factor)
        if factor is not None:
            raise UsageError("factor applies to slow only (undying inject slow --factor F)")
        if how is not None and (kind != "hang" or how not in HANG_HOWS):
            raise UsageError(f"how={how!r} applies to hang only, as one of {', '.join(HANG_HOWS)}")
        if rank not in self.ranks:
            raise UsageError(
                f"rank {rank} does not exist; this job has ranks 0..{self.world_size - 1}"
            )
        if phase is not None and phase not in INJECT_PHASES:
            raise UsageError(f"unknown phase {phase!r}; choose one of {', '.join(INJECT_PHASES)}")
        if self.state.terminal or self.state is JobState.STOPPING:
            raise UsageError(f"job {self.config.job_id} is {self.state.value}; nothing to inject into")
        info = self.ranks[rank]
        agent = self._agents[info.node]
        if how in ("spin", "block"):
            kind = f"hang:{how}"  # done by the rank's own training thread, at a step
        if at_step is None and phase is None and kind in _INJECT_SIGNALS:
            t = time.time()
            if not agent.kill(rank, _INJECT_SIGNALS[kind]):
                raise UsageError(f"rank {rank} has no running process right now; try again in a moment")
            self._injected[rank] = (t, kind)
            self.events.event("fault_injected", rank=rank, kind=kind, pid=info.pid, phase="now")
            return {"injected": kind, "rank": rank, "pid": info.pid, "when": "now"}
        fault = ArmFault(kind=kind, at_step=at_step if at_step is not None else info.step + 1, phase=phase or "step")
        agent.arm(rank, fault)
        self.events.event("fault_armed", rank=rank, kind=kind, at_step=fault.at_step, phase=fault.phase)
        return {"injected": kind, "rank": rank, "pid": info.pid, "at_step": fault.at_step, "phase": fault.phase}

    # --- the trace switch -------------------------------------------------------

    def _trace_message(self) -> TraceSet:
        return TraceSet(self.trace.step, self.trace.comm, self.trace.by, self.trace.t,
                        comm_from_step=self._comm_from_step)

    def _comm_switch_step(self) -> int:
        """The step from which every rank's DDP has (or drops) the comm hook: far enough ahead to hear of it.

        Ranks of a synchronous job are within a step or two of the newest
        commit; the switch reaches them in milliseconds. Half a second of steps
        (at least 5) ahead leaves a wide margin and still switches within a second.
        """
        newest = max((r.step for r in self.ranks.values()), default=0)
        step_s = statistics.median(self._step_s) if self._step_s else 0.0
        ahead = max(_COMM_SWITCH_MIN_STEPS, math.ceil(_COMM_SWITCH_AHEAD_S / step_s) if step_s > 0 else 0)
        return newest + min(ahead, _COMM_SWITCH_MAX_STEPS)

    def set_trace(self, switch: TraceSwitch) -> dict[str, Any]:
        """Every rank of every node follows ``switch`` (the agents pass it on at once)."""
        previous = self.trace
        self.trace = switch
        self.trace_error = ""
        if (previous.comm and previous.step) != (switch.comm and switch.step):
            self._comm_from_step = self._comm_switch_step()
        self.events.event("trace_switch", step=switch.step, comm=switch.comm, by=switch.by,
                          comm_from_step=self._comm_from_step)
        if (previous.step, previous.comm) != (switch.step, switch.comm):
            log.warning("job %s: tracing %s, by %s", self.config.job_id, switch.describe(), switch.by)
        message = self._trace_message()
        for agent in self._agents.values():
            agent.set_trace(message)
        return self.trace_status()

    def change_trace(self, *, on: bool, comm_only: bool, by: str) -> dict[str, Any]:
        """``undying trace on|off [--comm]``: the change, and a line saying what it did."""
        switch, said = self.trace.changed(on=on, comm_only=comm_only, by=by, t=time.time())
        result = self.set_trace(switch)
        result["message"] = said
        return result

    def on_trace_file(self, switch: TraceSwitch) -> None:
        self.set_trace(switch)

    def on_trace_file_error(self, message: str) -> None:
        """A malformed switch file: reported, ignored; the last good setting stays."""
        self.trace_error = message
        self.events.event("trace_switch_error", error=message)
        log.warning("job %s: %s; the trace switch stays %s", self.config.job_id, message, self.trace.describe())

    def trace_status(self) -> dict[str, Any]:
        return {**self.trace.to_dict(), "error": self.trace_error, "comm_from_step": self._comm_from_step}

    def _inject_slow(self, rank: int, at_step: int | None, phase: str, factor: float | None) -> dict[str, Any]:
        if factor is None or not 1.0 < factor <= 100.0:
            raise UsageError(f"slow needs a factor above 1 and at most 100 (1.2: steps 20% slower), got {factor}")
        if phase not in SLOW_PHASES:
            raise UsageError(f"slow's phase must be one of {', '.join(SLOW_PHASES)}, got {phase!r}")
        if rank not in self.ranks:
            raise UsageError(f"rank {rank} does not exist; this job has ranks 0..{self.world_size - 1}")
        if self.state.terminal or self.state is JobState.STOPPING:
            raise UsageError(f"job {self.config.job_id} is {self.state.value}; nothing to inject into")
        info = self.ranks[rank]
        fault = ArmFault(kind="slow", at_step=at_step if at_step is not None else info.step + 1, phase=phase,
                         factor=factor)
        self._agents[info.node].arm(rank, fault)
        self.events.event("fault_armed", rank=rank, kind="slow", at_step=fault.at_step, phase=phase, factor=factor)
        return {"injected": "slow", "rank": rank, "pid": info.pid, "at_step": fault.at_step, "phase": phase,
                "factor": factor}

    # --- views ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "job_id": self.config.job_id,
            "state": self.state.value,
            "generation": self.generation,
            "world_size": self.world_size,
            "nodes_in_use": list(self._layout_nodes),
            "elastic": {"min_nodes": self.config.fewest_nodes, "max_nodes": self.config.nnodes},
            "regroup": self._regroup.view() if self._regroup is not None else None,
            "started_at": self.started_at,
            "step": min((r.step for r in self.ranks.values()), default=0),
            "rerun_steps": sorted(self.rerun_steps),
            "spares_ready": sum(a.spares_ready() for a in self._agents.values()),
            "exit_reason": self.exit_reason,
            "checkpoints": {
                "dir": self.checkpoint_dir,
                "last": self.last_checkpoint,
                "resumed_from": self.resumed_from,
                "grace_period_s": round(self.grace_period()[0], 3),
                "grace_basis": self.grace_period()[1],
                "restarts": self._restarts,
                "health": self.checkpoint_health.view(),
            },
            "preemption": self.preemption,
            "trace": self.trace_status(),
            "step_times": [list(p) for p in self.step_times],
            "ranks": self._rank_views(),
            "nodes": [a.view() for a in self._agents.values()],
            "incidents": [i.to_dict() for i in self.incidents],
        }


    def _rank_views(self) -> list[dict[str, Any]]:
        """The ranks, each with its phase as its agent last heard it (exited ranks have none)."""
        phases: dict[int, str] = {}
        for agent in self._agents.values():
            phases.update(agent.phases())
        views = []
        for info in self.ranks.values():
            view = info.to_dict()
            if info.state is not RankState.EXITED and info.rank in phases:
                view["phase"] = phases[info.rank]
            views.append(view)
        return views


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _script_error(job_dir: str, rank: int) -> str:
    """The job's failure when a rank's script could not run: the error its first rank left, in one line."""
    try:
        with open(os.path.join(job_dir, SCRIPT_ERROR_FILE), encoding="utf-8", errors="replace") as f:
            told = f.read(2000).strip()
    except OSError:
        told = ""
    where = told or f"rank {rank} exited with a SyntaxError or ImportError (its output says where)"
    return f"the training script could not run: {where}; fix it and run the same command again"
