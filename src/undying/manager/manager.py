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
import logging
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from undying.config import JobConfig
from undying.errors import UsageError
from undying.manager.events import EventLog
from undying.manager.policy import Action, Decision, PolicyContext, decide, stall_culprits
from undying.manager.state import Incident, JobState, JobStateMachine, RankInfo, RankState
from undying.messages import (
    INJECT_PHASES,
    ArmFault,
    CommFailure,
    Done,
    Fatal,
    FaultInjected,
    Hello,
    Message,
    Progress,
    RankProgress,
    StepCommitted,
)
from undying.rendezvous import CURRENT_KEY, GenerationRecord, generation_key

__all__ = ["Manager", "AgentHandle", "INJECT_KINDS"]

log = logging.getLogger("undying.manager")

# crash: SIGKILL of the rank's process. comm-error: the rank breaks its
# process group's connections, so a real collective fails while every process lives.
# hang: SIGSTOP of the rank's process (found by its missing heartbeats), or with
# `how`, the rank's training thread spins in an endless loop or blocks forever
# while its process lives and beats (found by its missing progress).
INJECT_KINDS = ("crash", "hang", "comm-error")
HANG_HOWS = ("stop", "spin", "block")
_INJECT_SIGNALS = {"crash": signal.SIGKILL, "hang": signal.SIGSTOP}


class AgentHandle(Protocol):
    """What the manager asks of the agent of one node."""

    node: int

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool) -> tuple[int, bool]: ...

    def kill(self, rank: int, sig: signal.Signals) -> bool: ...

    def arm(self, rank: int, fault: ArmFault) -> None: ...

    def abort(self, rank: int, generation: int, reason: str) -> bool: ...

    def keep_spares(self) -> None: ...

    def spares_ready(self) -> int: ...

    async def stop_all(self, grace_s: float) -> None: ...


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
    def __init__(self, config: JobConfig, events: EventLog) -> None:
        self.config = config
        self.events = events
        self.machine = JobStateMachine()
        self.generation = -1
        self.ranks = {
            r: RankInfo(rank=r, node=r // config.nproc_per_node) for r in range(config.world_size)
        }
        self.incidents: list[Incident] = []
        self.rerun_steps: set[int] = set()
        self.exit_reason = ""
        self.started_at = time.time()
        self._committed: dict[int, set[int]] = {r: set() for r in range(config.world_size)}
        self._agents: dict[int, AgentHandle] = {}
        self._control: dist.TCPStore | None = None
        self._gen_stores: dict[int, dist.TCPStore] = {}
        self._recovery: Recovery | None = None
        self._recovery_count = 0
        self._injected: dict[int, tuple[float, str]] = {}
        self._hung: dict[int, tuple[float, float, str]] = {}  # pid -> (last heard, detected, phase)
        self._condemned: dict[int, tuple[Incident, Decision]] = {}  # pid -> what its exit carries on
        self._fatal: dict[int, Fatal] = {}
        self._finished = asyncio.Event()
        self._finished_ranks: set[int] = set()
        self._grace_tasks: set[asyncio.Task[None]] = set()
        events.set_job("job_id", config.job_id)
        events.set_job("world_size", config.world_size)
        events.set_job("started_at", self.started_at)
        self._persist_state()

    # --- setup ----------------------------------------------------------------

    @property
    def state(self) -> JobState:
        return self.machine.state

    def start_control_store(self) -> int:
        try:
            self._control = dist.TCPStore(
                self.config.host,
                self.config.port,
                None,
                True,
                timeout=timedelta(seconds=self.config.timeouts.rendezvous),
                wait_for_workers=False,
            )
        except (RuntimeError, dist.DistError) as e:
            if "in use" in str(e).lower() or "EADDRINUSE" in str(e):
                raise UsageError(
                    f"port {self.config.port} is in use; pass --port with a free port, or --port 0 to pick one"
                ) from e
            raise UsageError(f"cannot listen on {self.config.host}:{self.config.port}: {e}") from e
        port = self._control.port
        self.events.set_job("control_port", port, flush=True)
        return port

    @property
    def control_port(self) -> int:
        assert self._control is not None
        return self._control.port

    def add_agent(self, agent: AgentHandle) -> None:
        self._agents[agent.node] = agent

    async def run(self) -> JobState:
        """Start every rank in generation 0 and wait until the job ends."""
        record = self._open_generation("start")
        for info in self.ranks.values():
            self._spawn(info.rank, record, joining=False)
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

    def close(self) -> None:
        self._gen_stores.clear()  # the last references: their servers stop
        self._control = None
        self.events.close()

    # --- generations ----------------------------------------------------------

    def _open_generation(self, reason: str) -> GenerationRecord:
        assert self._control is not None
        previous = self.generation
        store = dist.TCPStore(
            self.config.host, 0, None, True,
            timeout=timedelta(seconds=self.config.timeouts.connect), wait_for_workers=False,
        )
        self.generation += 1
        record = GenerationRecord(
            generation=self.generation,
            world_size=self.config.world_size,
            store_host=self.config.host,
            store_port=store.port,
            reason=reason,
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
        del store

    def _spawn(self, rank: int, record: GenerationRecord, *, joining: bool) -> bool:
        """Give ``rank`` a process; True when it was a warm spare."""
        info = self.ranks[rank]
        agent = self._agents[info.node]
        pid, warm = agent.spawn(rank, record, joining=joining)
        info.pid = pid
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
        info = self.ranks[rank]
        self.events.event("exited", generation=self.generation, rank=rank, pid=pid, returncode=returncode)
        if pid != info.pid:
            return  # a process already replaced; its exit is old news
        finished_steps = info.state is RankState.DONE
        info.state = RankState.EXITED
        info.last_seen = t
        self._persist_rank(info)
        if self.state in (JobState.STOPPING,) or self.state.terminal:
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
        kind = "hang" if hung else "error" if fatal is not None else "crash"
        if hung:
            last_heard, detected, phase = hung
            if phase == "step":
                error = f"no progress in step {info.step + 1} for {detected - last_heard:.1f}s (step timeout); killed"
            else:
                error = f"no heartbeat for {detected - last_heard:.1f}s ({phase} timeout); killed"
        else:
            detected, error = t, fatal.error if fatal else _describe_exit(returncode)
        incident = self._new_incident(
            kind=kind,
            rank=rank,
            step=info.step + 1,
            fault_t=injected[0] if injected else hung[0] if hung else t,
            detected_t=detected,
            error=error,
            traceback=fatal.traceback if fatal else "",
        )
        incident.detail["returncode"] = returncode
        incident.detail["pid"] = pid
        if injected:
            incident.detail["injected"] = True
        self._handle(incident)

    def on_message(self, message: Message) -> None:
        if isinstance(message, StepCommitted):
            self._on_commit(message)
        elif isinstance(message, Hello):
            self._on_hello(message)
        elif isinstance(message, Progress):
            self._on_progress(message)
        elif isinstance(message, CommFailure):
            self._on_comm_failure(message)
        elif isinstance(message, FaultInjected):
            self._injected[message.rank] = (message.t, message.kind)
            self.events.event("fault_injected", rank=message.rank, kind=message.kind, step=message.step, phase=message.phase)
        elif isinstance(message, Fatal):
            info = self.ranks[message.rank]
            self._fatal[info.pid] = message
            self.events.event("user_error", rank=message.rank, step=message.step, error=message.error, traceback=message.traceback)
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

    def _on_commit(self, message: StepCommitted) -> None:
        info = self.ranks[message.rank]
        if message.step in self._committed[message.rank]:
            self.rerun_steps.add(message.step)
            self.events.event("step_rerun", rank=message.rank, step=message.step)
        self._committed[message.rank].add(message.step)
        info.step = message.step
        info.generation = message.generation
        info.state = RankState.RUNNING
        info.last_seen = message.t
        self.events.step(message.rank, message.step, message.generation, message.t, message.metrics)
        self.events.rank(info.rank, info.to_dict())
        if self.state is JobState.STARTING:
            self._move(JobState.RUNNING)
        self._maybe_finish_recovery(message.rank, message.t, message_generation=message.generation)

    def _on_progress(self, message: Progress) -> None:
        info = self.ranks[message.rank]
        info.generation = message.generation
        info.last_seen = message.t
        self.events.event(message.phase, generation=message.generation, rank=message.rank, step=message.step, **message.detail)
        recovery = self._recovery
        if recovery is None or message.generation != recovery.generation:
            return
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
        if message.generation < self.generation:
            return  # the manager already moved on; the worker follows
        task = asyncio.get_running_loop().create_task(self._comm_failure_grace(message))
        self._grace_tasks.add(task)
        task.add_done_callback(self._grace_tasks.discard)

    async def _comm_failure_grace(self, message: CommFailure) -> None:
        """A collective failed. If no process exits meanwhile, it was the link: retry."""
        await asyncio.sleep(self.config.timeouts.comm_error_grace)
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

    def _holders_alive(self, excluding: int) -> int:
        recovery = self._recovery
        replaced = recovery.replaced if recovery else set()
        return sum(
            1
            for r in self.ranks.values()
            if r.rank != excluding and r.state is not RankState.EXITED and r.rank not in replaced
        )

    def _handle(self, incident: Incident) -> None:
        decision = decide(
            incident,
            self.incidents,
            PolicyContext(self.config.max_restarts, self._holders_alive(incident.rank),
                          self.config.max_retries),
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
        record = self._open_generation(f"{incident.kind} of rank {incident.rank}: {decision.action.value}")
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

    def _maybe_finish_recovery(self, rank: int, t: float, *, message_generation: int) -> None:
        recovery = self._recovery
        if recovery is None or message_generation < recovery.generation:
            return
        recovery.first_step.setdefault(rank, t)
        if len(recovery.first_step) < self.config.world_size:
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

    async def _watch_recovery(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            recovery = self._recovery
            if recovery is None or self.state.terminal or self.state is JobState.STOPPING:
                continue
            if time.time() - recovery.started > self.config.timeouts.recovery:
                for incident in recovery.incidents:
                    incident.status = "failed"
                    self.events.incident(incident)
                self.fail(
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
            self.exit_reason = "every rank finished its last step"
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

    # --- commands -------------------------------------------------------------

    def inject(self, kind: str, rank: int, at_step: int | None, phase: str | None,
               how: str | None = None) -> dict[str, Any]:
        """Fault a rank now, or arm it to fault itself when it reaches ``at_step``."""
        if kind not in INJECT_KINDS:
            raise UsageError(f"unknown fault kind {kind!r}; choose one of {', '.join(INJECT_KINDS)}")
        if how is not None and (kind != "hang" or how not in HANG_HOWS):
            raise UsageError(f"how={how!r} applies to hang only, as one of {', '.join(HANG_HOWS)}")
        if rank not in self.ranks:
            raise UsageError(
                f"rank {rank} does not exist; this job has ranks 0..{self.config.world_size - 1}"
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

    # --- views ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "job_id": self.config.job_id,
            "state": self.state.value,
            "generation": self.generation,
            "world_size": self.config.world_size,
            "started_at": self.started_at,
            "step": min((r.step for r in self.ranks.values()), default=0),
            "rerun_steps": sorted(self.rerun_steps),
            "spares_ready": sum(a.spares_ready() for a in self._agents.values()),
            "exit_reason": self.exit_reason,
            "ranks": [r.to_dict() for r in self.ranks.values()],
            "incidents": [i.to_dict() for i in self.incidents],
        }


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"
