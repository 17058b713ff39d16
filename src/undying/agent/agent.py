"""The agent: one per node. Starts and watches the node's workers.

It starts each worker (forked from its zygote, agent/zygote.py, or a fresh
interpreter) with the torchrun environment plus undying's own, sees a
worker exit the moment it happens (an asyncio child watch), relays the
workers' reports to the manager, and carries out the manager's commands: kill
a rank, arm a fault, stop everything.

It speaks to its manager only in ``protocol/node_wire.py`` messages: what it
reports goes to ``report`` (a message each), and the manager's commands reach
it through one table (``agent/commands.py``). Whether the manager is in this
process (``undying run`` on one node) or across the network is the line's
business, not the agent's (``launch/in_process.py``, ``agent/remote.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from undying.agent.children import Orphans, become_subreaper, kill_tree, release_subreaper
from undying.agent.exits import heard_to_the_end, returned_exit
from undying.agent.liveness import (
    has_exited,
    is_stalled,
    judge_silence,
    process_state,
    step_timeout,
    watch_clock,
)
from undying.agent.popen import PopenProcess
from undying.agent.spares import Process, SparePool, Take, signal_group
from undying.agent.torchrun_env import TorchrunEnv
from undying.agent.worker_channel import LocalWorker, WorkerChannel
from undying.agent.zygote import ZygoteKeeper, start_mode
from undying.config import EXIT_REGROUPED, JobConfig
from undying.protocol import env as names
from undying.protocol.channel_key import new_key
from undying.protocol.codec import Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.keys import DERIVED_KEY_ENVS, child_environment
from undying.protocol.kinds import InjectPhase
from undying.protocol.node_wire import (
    AgentState,
    RankExited,
    RankHung,
    RankSpawned,
    RanksStalled,
    SpareEvent,
    TraceFileError,
    TraceFileSet,
)
from undying.protocol.worker_wire import (
    Abort,
    ArmFault,
    Assign,
    Stop,
    TraceSet,
    encode,
)
from undying.trace.switch import SwitchFileWatcher

__all__ = ["Agent"]

log = logging.getLogger("undying.agent")

# A worker or spare shows the key at once; a connection silent this long is dropped.
_KEY_WAIT_S = 10.0


class Agent:
    def __init__(
        self,
        config: JobConfig,
        *,
        node: int,
        script: str,
        script_args: list[str],
        report: Callable[[Message], None],
        control_port: int,
        manager_host: str = "",
        extra_env: Mapping[str, str] | None = None,
        spares: int | None = None,
    ) -> None:
        """``manager_host``: the manager's address as this node reaches it, when it is on another host;
        ``extra_env``: what this node's processes get beside undying's own (the job's derived keys, the
        interface toward the manager); ``spares``: how many spares to keep warm (default ``--spares``)."""
        self.config = config
        self.node = node
        self._script = script
        self._script_args = script_args
        self._report = report  # each report to the manager, as a message
        self.control_port = control_port
        self._workers: dict[int, LocalWorker] = {}
        self._by_pid: dict[int, LocalWorker] = {}
        self._server: asyncio.AbstractServer | None = None
        self._port = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.spares = SparePool(node, config, start=lambda: self._start_process(self._base_environment(), spare=True),
                                report=self._spare_event, stopping=lambda: self._stopping,
                                want=config.spares if spares is None else spares)
        self._stopping = False
        # Durations of this node's recent steps: what an automatic step timeout is derived from.
        self._step_times: deque[float] = deque(maxlen=100)
        self._for_replacement: dict[int, list[ArmFault]] = {}  # faults armed for a rank's next replacement
        self._armed_early: dict[int, list[ArmFault]] = {}  # faults armed before the rank had a process
        self._trace: TraceSet | None = None  # the switch every worker of this node follows
        self.manager_host = manager_host  # ("": the manager is in this process)
        self.extra_env: dict[str, str] = dict(extra_env or {})  # e.g. GLOO_SOCKET_IFNAME toward the manager
        self._key = new_key()  # what a local process must show on the worker channel (undying.protocol.channel_key)
        # Workers forked from one process that imported torch (agent/zygote.py), unless UNDYING_WORKER_START=spawn.
        self._zygotes = ZygoteKeeper(node, self._base_environment, config.timeouts.init_timeout,
                                     enabled=start_mode() == "zygote", step_api=config.step_api)
        self._orphans = Orphans()  # what a rank started and no longer holds (agent/children.py)
        self._regrouping = False  # an elastic job's worker left for a regroup: the job comes back at once
        # The workers' lines to this agent (agent/worker_channel.py): their reports go to the manager.
        self._channel = WorkerChannel(node, self._key, self._by_pid, self.spares, self._step_times,
                                      trace=lambda: self._trace, forward=report)
        self._torchrun = TorchrunEnv(self)  # torchrun's variables, from this agent's config and node

    async def start(self, *, join_first: bool = False) -> None:
        """Serve this node's workers and start its zygote; ``join_first``: a node of a multi-node job,
        whose zygote imports while the agent joins its manager (a standby waits for it here: its spares
        are forked from it)."""
        self._server = await asyncio.start_server(self._channel.serve, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]
        # Every worker is this process's child, and what a rank leaves behind comes here (agent/children.py).
        if not become_subreaper():
            log.warning("node %d: no child subreaper on this platform: a process a rank starts in a session of "
                        "its own may outlive the rank", self.node)
        if join_first:
            # A node of a multi-node job joins its manager first (joining late can cost it its place under
            # --node-wait); the zygote imports meanwhile, and its node's workers wait for it (zygote_ready).
            self._zygotes.begin()
        else:
            await self._zygotes.start()  # the manager in this process opens generation 0 after this
        task = asyncio.get_running_loop().create_task(self._watch_heartbeats())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_report_crash)
        if self.config.trace.trace_switch_file:
            report = self._report
            # Where a mounted Kubernetes ConfigMap lands on this node; the manager spreads a change to every node.
            watcher = SwitchFileWatcher(
                self.config.trace.trace_switch_file,
                lambda switch: report(TraceFileSet(switch.step, switch.comm, switch.by, switch.t)),
                lambda message: report(TraceFileError(message)))
            task = asyncio.get_running_loop().create_task(watcher.run())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(_report_crash)

    def zygote_pending(self) -> bool:
        """Whether this node's zygote is importing torch, or was let go while the node was idle."""
        return bool(self._port) and self._zygotes.pending

    async def zygote_ready(self) -> None:
        """Until the zygote (started again if let go) serves or gives up: a fork costs no second torch import."""
        if self.zygote_pending():
            await self._zygotes.ready()

    def _own_pids(self) -> set[int]:
        """Every process this agent started itself (never an orphan of a rank's)."""
        zygote = self._zygotes.zygote
        return {*self._by_pid, *(w.pid for w in self._workers.values()), *self.spares.spares,
                *(() if zygote is None else (zygote.pid,))}

    def set_trace(self, switch: TraceSet) -> None:
        """Every worker of this node, and every later one, follows this trace switch."""
        self._trace = switch
        for worker in self._workers.values():
            if worker.writer is not None and worker.process.returncode is None:
                worker.writer.write(encode(switch))

    def follow(self, control_port: int, job_dir: str = "") -> None:
        """What the manager's welcome says of the job: its control store's port, and (when given) the
        job dir its ranks write to, the manager's (one job dir on a shared filesystem)."""
        self.control_port = control_port
        if job_dir and job_dir != self.config.job_dir:
            self.config = dataclasses.replace(self.config, job_dir=job_dir)

    def become(self, node: int) -> None:
        """A standby given node ``node``: its ranks, reports and spares go by that number, and it keeps
        the job's ``--spares`` from now on (it kept a whole node's worth while it had none)."""
        self.node = node
        self.config = dataclasses.replace(self.config, node_rank=node)
        self.spares.become(node, self.config.spares)

    def step_timeout(self) -> float:
        return step_timeout(self.config.timeouts.step_timeout, max(self._step_times, default=None))

    async def _watch_heartbeats(self) -> None:
        """Watch every rank's beats and progress; tell the manager of hangs and stalls.

        A rank silent past its timeout is hung (stopped, or its interpreter
        stuck); a rank beating without progress past its step timeout is
        stalled (an endless loop, a deadlock, a collective that never
        completes). Beats stay here: the manager hears of hangs and stalls, not
        of every beat, so its load grows with nodes rather than ranks.
        """
        timeouts = self.config.timeouts
        clock = watch_clock(self.node, timeouts)  # silence counts only while this agent ran (agent/liveness.py)
        while True:
            await asyncio.sleep(clock.period_s)
            clock.tick()
            self._orphans.sweep(self._own_pids())
            if self._stopping:
                continue
            self._zygotes.check()
            now = time.time()
            self.spares.check(now, clock)
            stalled: list[LocalWorker] = []
            for worker in list(self._workers.values()):
                if worker.hang_reported or worker.process.returncode is not None:
                    continue
                silence = judge_silence(now, worker.started, worker.last_seen, timeouts, self.config.step_api, clock)
                if silence is not None and not has_exited(worker.pid):
                    worker.hang_reported = True
                    log.warning("node %d: rank %d (pid %d, state %s) silent for %.1fs (%s timeout %.1fs)", self.node,
                                worker.rank, worker.pid, process_state(worker.pid), silence.silent_s, silence.phase,
                                silence.limit_s)
                    self._report(RankHung(worker.rank, worker.pid, silence.phase,
                                          worker.last_seen or worker.started, now))
                elif (beat := worker.beat) is not None and beat.progress_t != worker.stall_reported_t \
                        and is_stalled(beat, self.step_timeout(), timeouts):
                    stalled.append(worker)
            if stalled:
                self._report_stall(stalled, now)

    def _report_stall(self, stalled: list[LocalWorker], now: float) -> None:
        """Report every local rank's progress: the manager picks the one the others wait for."""
        for worker in stalled:
            assert worker.beat is not None
            worker.stall_reported_t = worker.beat.progress_t
            log.warning("node %d: rank %d (pid %d) made no progress for %.1fs in %s of step %d "
                        "(%d collectives entered)", self.node, worker.rank, worker.pid,
                        now - worker.beat.progress_t, worker.beat.phase, worker.beat.step,
                        worker.beat.collectives)
        live = [w for w in self._workers.values() if w.process.returncode is None and not w.hang_reported]
        self._report(RanksStalled([w.progress() for w in live], self.step_timeout(), now))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._zygotes.close()
        for task in list(self._tasks):
            task.cancel()
        await self._orphans.end_all(self._own_pids())  # nothing a rank started outlives the job
        release_subreaper()

    # --- processes ------------------------------------------------------------

    def _base_environment(self) -> dict[str, str]:
        # Never the token, never a derived key inherited from the user: only those this agent hands on.
        env = child_environment(os.environ, {k: v for k, v in self.extra_env.items() if k in DERIVED_KEY_ENVS})
        env.update(
            {
                names.JOB_ID_ENV: self.config.job_id,
                names.JOB_DIR_ENV: self.config.job_dir,
                names.AGENT_ADDR_ENV: f"127.0.0.1:{self._port}",
                names.AGENT_PID_ENV: str(os.getpid()),
                names.AGENT_KEY_ENV: self._key,
                # What traces name this node by: its host, and with several nodes its rank too
                # (two agents may share a host name: pods of one node, test hosts).
                names.NODE_NAME_ENV: socket.gethostname() if self.config.nnodes == 1
                else f"{socket.gethostname()}/{self.node}",
            }
        )
        env.update(self.config.timeout_env())
        env.update(self.config.checkpoint.env(self.config.job_dir))
        env.update(self.config.trace.env(self.config.job_dir))
        for key, value in self.extra_env.items():
            env.setdefault(key, value)
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # gloo's warnings on a dead peer are expected
        env.update(self._torchrun.base(env))
        return env

    def _rank_environment(self, rank: int, record: GenerationRecord, joining: bool,
                          resume_from: str = "", incarnation: int = 0) -> dict[str, str]:
        """What makes a process rank ``rank`` of ``record``'s generation: torchrun's variables and undying's."""
        return {
            **self._torchrun.rank(rank, record, incarnation, self.manager_host),
            names.INCARNATION_ENV: str(incarnation),
            names.RESUME_FROM_ENV: resume_from,
            # The generation's store lives in the manager: across hosts, where this agent reached it.
            names.STORE_ADDR_ENV: f"{self.manager_host or record.store_host}:{record.store_port}",
            names.CONTROL_ADDR_ENV: f"{self.manager_host or self.config.host}:{self.control_port}",
            names.GENERATION_ENV: str(record.generation),
            names.JOINING_ENV: "1" if joining else "0",
            names.BACKEND_ENV: self.config.backend,
            # (again: a standby's spare started before the manager gave its agent a node)
            names.NODE_NAME_ENV: self._base_environment()[names.NODE_NAME_ENV],
        }

    def _start_process(self, env: dict[str, str], *, spare: bool) -> Process:
        """A worker: forked by the zygote when there is one, else a fresh interpreter (agent/zygote.py)."""
        launch = self.config.launch
        kind = ["-m"] if launch.module else ["--no-python"] if launch.no_python else []
        args = [*(["--spare"] if spare else []), *kind, self._script, *self._script_args]
        process: Process | None = None
        self._regrouping = False
        if self._port:
            process = self._zygotes.spawn(args, env, os.getcwd())
        if process is None:
            popen = subprocess.Popen(
                [sys.executable, "-u", "-m", "undying.worker.boot", *args],
                env=env,
                start_new_session=True,  # Ctrl-C reaches the launcher only; it stops workers in order
            )
            process = PopenProcess(popen)
        task = asyncio.get_running_loop().create_task(self._watch(process))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return process

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool,
              resume_from: str = "", incarnation: int = 0) -> tuple[int, bool]:
        """Give ``rank`` a process (called on the loop): a warm spare if one is ready.

        ``resume_from``: a checkpoint the new process starts from;
        ``incarnation``: the manager's number for it (the rank's owner key).
        Returns the PID and whether it was a spare.
        """
        rank_env = self._rank_environment(rank, record, joining, resume_from, incarnation)
        process, warm = self._give_rank(rank, rank_env, incarnation, spare_ok=joining)
        worker = LocalWorker(rank=rank, process=process, started=time.time(), incarnation=incarnation,
                         pending=[*self._armed_early.pop(rank, []),
                                  *(self._for_replacement.pop(rank, []) if joining else [])])
        old = self._workers.get(rank)
        if old is not None and old.process.returncode is not None:  # (a live one, a planned move's, stays watched)
            self._by_pid.pop(old.pid, None)
        self._workers[rank] = worker
        self._by_pid[process.pid] = worker
        log.info("node %d: rank %d is pid %d (generation %d%s)", self.node, rank, process.pid,
                 record.generation, ", a warm spare" if warm else ", replacement" if joining else "")
        return process.pid, warm

    def _give_rank(self, rank: int, rank_env: dict[str, str], incarnation: int, *,
                   spare_ok: bool) -> tuple[Process, bool]:
        """A process for ``rank``: a fresh warm spare (watched until it answers), else a new process."""
        spare = self.spares.take() if spare_ok else None
        if spare is None:
            return self._start_process({**self._base_environment(), **rank_env}, spare=False), False
        assert spare.writer is not None
        spare.writer.write(encode(Assign(env=rank_env)))
        self.spares.taking[spare.pid] = Take(rank, rank_env, incarnation, time.time())
        task = asyncio.get_running_loop().create_task(self._watch_take(spare.pid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_report_crash)
        self.keep_spares()
        return spare.process, True

    async def _watch_take(self, pid: int) -> None:
        """A spare that has not answered its Assign within --spare-take-timeout is killed; the rank goes on.

        Stopped (SIGSTOP), wedged or swapped out, it would otherwise hold the
        recovery for the whole init timeout. The rank is given to another warm
        spare (watched the same way) or a new process, with the same
        environment and owner number; the manager hears the new PID.
        """
        await asyncio.sleep(self.config.timeouts.spare_take_timeout)
        take = self.spares.taking.pop(pid, None)
        if take is None or self._stopping:
            return
        worker = self._workers.get(take.rank)
        if worker is None or worker.pid != pid or worker.process.returncode is not None:
            return  # the rank moved on, or the spare died: its exit is handled as the rank's
        self._by_pid.pop(pid, None)  # its exit is no rank's crash: the rank has another process
        signal_group(pid, signal.SIGKILL)
        process, warm = self._give_rank(take.rank, take.env, take.incarnation, spare_ok=True)
        waited = round(time.time() - take.given_t, 3)
        log.warning("node %d: spare pid %d did not take rank %d within %.1fs (--spare-take-timeout); killed, "
                    "rank %d is now pid %d (%s)", self.node, pid, take.rank, waited, take.rank, process.pid,
                    "another warm spare" if warm else "a new process")
        self._spare_event("spare_stuck", pid, for_rank=take.rank, waited_s=waited, replaced_by=process.pid,
                          replacement="warm spare" if warm else "new process")
        replacement = LocalWorker(rank=take.rank, process=process, started=time.time(), pending=worker.pending,
                              incarnation=take.incarnation)
        self._workers[take.rank] = replacement
        self._by_pid[process.pid] = replacement
        self._report(RankSpawned(take.rank, process.pid, warm, take.incarnation))

    def _spare_event(self, what: str, pid: int, **detail: Any) -> None:
        """Tell the manager's log what happened to a spare (its PID included: the job's record of spares)."""
        try:
            self._report(SpareEvent(self.node, pid, what, time.time(), detail))
        except Exception:  # a report must never stop the agent's own care of its spares
            log.exception("node %d: reporting %s of spare pid %d failed", self.node, what, pid)

    # --- hot spares -----------------------------------------------------------

    def keep_spares(self) -> None:
        """Start spares until ``config.spares`` are ready or warming up (``SparePool``)."""
        self.spares.keep()

    def spares_ready(self) -> int:
        return self.spares.ready()

    async def _watch(self, process: Process) -> None:
        returncode = await process.wait()
        t = time.time()
        await heard_to_the_end(lambda: getattr(self._by_pid.get(process.pid), "writer", None) is not None)
        if not self.spares.exited(process.pid, returncode):
            worker = self._by_pid.pop(process.pid, None)
            if worker is not None and self._workers.get(worker.rank) is worker:  # the rank's newest process ended
                self._workers.update({w.rank: w for w in self._by_pid.values() if w.rank == worker.rank})  # while an
            if worker is not None:  # older one runs (a cancelled move, manager.placement.migration): that one holds it again
                # A script that returned is done, whatever its exit took (agent/exits.py).
                returncode = returned_exit(self.config, worker.rank, worker.incarnation, worker.pid, returncode,
                                           self._spare_event)
                self._report(RankExited(worker.rank, worker.pid, returncode, t))
                self._regrouping |= returncode == EXIT_REGROUPED and self.config.elastic
        self._zygote_idle()

    def _zygote_idle(self) -> None:
        """A node with no worker and no spare holds no process but its agent: the zygote goes too.

        (A job waiting for nodes, a node stopped.) The next worker wanted starts it again and waits
        for it (``zygote_ready``). Kept when an elastic job's regroup member leaves (EXIT_REGROUPED).
        """
        if self._regrouping or any(w.process.returncode is None for w in self._workers.values()) or any(
                s.process.returncode is None for s in self.spares.spares.values()):
            return
        self._zygotes.idle()

    def kill(self, rank: int, sig: signal.Signals) -> bool:
        worker = self._workers.get(rank)
        if worker is None or worker.process.returncode is not None:
            return False
        try:
            os.kill(worker.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def abort(self, rank: int, generation: int, reason: str) -> bool:
        """Have ``rank`` leave ``generation`` now: its stuck collective fails, it rejoins."""
        worker = self._workers.get(rank)
        if worker is None or worker.writer is None or worker.process.returncode is not None:
            return False
        worker.writer.write(encode(Abort(generation, reason)))
        return True

    def tell(self, rank: int, message: Message) -> bool:
        """Send a command to ``rank``'s worker (queued until it says hello); False if it has no process."""
        worker = self._workers.get(rank)
        if worker is None or worker.process.returncode is not None:
            return False
        if worker.writer is None:
            worker.pending.append(message)
        else:
            worker.writer.write(encode(message))
        return True

    def live_pids(self) -> dict[int, int]:
        return {r: w.pid for r, w in self._workers.items() if w.process.returncode is None}

    def state(self) -> AgentState:
        """The node's beat to its manager: its live ranks, their phases, its warm spares, its zygote."""
        return AgentState(node=self.node, live={str(r): p for r, p in self.live_pids().items()},
                          phases={str(r): p for r, p in self.phases().items()}, spares_ready=self.spares_ready(),
                          t=time.time(), zygote_pid=self._zygotes.pid or 0)

    def phases(self) -> dict[int, str]:
        """Each live rank's phase from its latest heartbeat (init, step, recovery, done)."""
        return {r: w.progress().phase for r, w in self._workers.items() if w.process.returncode is None}

    def arm(self, rank: int, fault: ArmFault) -> None:
        if fault.phase == InjectPhase.REJOIN:  # for the rank's next replacement process, not this one
            self._for_replacement.setdefault(rank, []).append(fault)
            return
        worker = self._workers.get(rank)
        if worker is None:  # armed before the rank's first process exists: it gets it when spawned
            self._armed_early.setdefault(rank, []).append(fault)
            return
        if worker.writer is None:
            worker.pending.append(fault)
        else:
            worker.writer.write(encode(fault))

    def resume_after_stop(self) -> None:
        """Accept new workers again after ``stop_all`` (a fenced node joins afresh)."""
        self._stopping = False

    async def stop_all(self, grace_s: float) -> None:
        """SIGTERM every worker's process group, SIGKILL what is left after ``grace_s``; spares go at once."""
        self._stopping = True
        self.spares.kill_all()
        live = [w.process for w in self._workers.values() if w.process.returncode is None]
        for worker in self._workers.values():
            if worker.writer is not None and worker.process.returncode is None:
                # Said first: the SIGTERM that follows is a stop, not a preemption to take a dying gasp for.
                worker.writer.write(encode(Stop("stopped by the agent")))
        for process in live:
            signal_group(process.pid, signal.SIGTERM)
            signal_group(process.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        deadline = time.monotonic() + grace_s
        for process in live:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(process.wait(), remaining)
            except asyncio.TimeoutError:
                kill_tree(process.pid)  # its group, and what it started in sessions of their own
                await process.wait()
        await self.spares.wait_all()


def _report_crash(task: asyncio.Task[None]) -> None:
    """A watch task that dies takes the job's hang detection with it: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("agent task %s died", task.get_name(), exc_info=task.exception())
