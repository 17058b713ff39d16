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
import signal
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from undying.agent.children import Orphans, become_subreaper, kill_tree, release_subreaper
from undying.agent.environment import WorkerEnvironment
from undying.agent.hang_watch import HangWatch
from undying.agent.life import AgentLife, Event, LifeMachine
from undying.agent.ranks import LocalRanks
from undying.agent.spares import SparePool, signal_group
from undying.agent.spawner import Spawner, report_crash
from undying.agent.worker_channel import WorkerChannel
from undying.agent.zygote import ZygoteKeeper, start_mode
from undying.config import JobConfig
from undying.protocol.channel_key import new_key
from undying.protocol.codec import Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.node_wire import AgentState, SpareEvent, TraceFileError, TraceFileSet
from undying.protocol.worker_wire import ArmFault, TraceSet
from undying.trace.switch import SwitchFileWatcher

__all__ = ["Agent"]

log = logging.getLogger("undying.agent")


class Agent:
    """The node's processes, composed of named parts, each given what it needs here:

    its life (``life.py``: one state, its moves in one table), its ranks (``ranks.py``: which
    process holds each and the words to them), the workers' channel (``worker_channel.py``), the
    spare pool (``spares.py``), the zygote keeper (``zygote.py``), the process starting
    (``spawner.py``), the workers' environment (``environment.py``), the hang watch
    (``hang_watch.py``) and the orphan sweep (``children.py``). What is left here is what the
    manager's commands call, and the agent's life.
    """

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
        """``manager_host``: the manager's address as this node reaches it, when it is on another
        host; ``extra_env``: what this node's processes get beside undying's own (the job's derived
        keys, the interface toward the manager); ``spares``: how many spares to keep warm (default
        ``--spares``)."""
        self.config = config
        self.node = node
        self._report = report  # each report to the manager, as a message
        self.control_port = control_port
        self.worker_port = 0  # the workers' channel's, once it serves
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._life = LifeMachine()
        self.ranks = LocalRanks()
        self.manager_host = manager_host  # ("": the manager is in this process)
        # What a local process must show on the worker channel (undying.protocol.channel_key).
        self.environment = WorkerEnvironment(
            self, key=new_key(), manager_host=manager_host,
            extra_env=dict(extra_env or {}))  # e.g. GLOO_SOCKET_IFNAME
        self.spares = SparePool(node, config,
                                start=lambda: self._spawner.start_process(self.environment.base(),
                                                                          spare=True),
                                report=self._spare_event, stopping=lambda: self._life.stopping,
                                want=config.spares if spares is None else spares)
        # Durations of this node's recent steps: what an automatic step timeout is derived from.
        step_times: deque[float] = deque(maxlen=100)
        self._trace: TraceSet | None = None  # the switch every worker of this node follows
        # Workers forked from one process that imported torch (agent/zygote.py), unless
        # UNDYING_WORKER_START=spawn.
        self._zygotes = ZygoteKeeper(node, self.environment.base, config.timeouts.init_timeout,
                                     enabled=start_mode() == "zygote", step_api=config.step_api)
        self._orphans = Orphans()  # what a rank started and no longer holds (agent/children.py)
        # The workers' lines to this agent (agent/worker_channel.py): their reports go to the
        # manager.
        self._channel = WorkerChannel(node, self.environment.key, self.ranks.by_pid, self.spares,
                                      step_times, trace=lambda: self._trace, forward=report)
        self._spawner = Spawner(self, script=script, script_args=script_args, life=self._life,
                                ranks=self.ranks, spares=self.spares, zygotes=self._zygotes,
                                environment=self.environment, tasks=self._tasks, report=report,
                                spare_event=self._spare_event)
        self.watch = HangWatch(self, self.ranks, self._life, zygotes=self._zygotes,
                               spares=self.spares, orphans=self._orphans, step_times=step_times,
                               report=report)

    @property
    def life(self) -> AgentLife:
        return self._life.state

    async def start(self, *, join_first: bool = False) -> None:
        """Serve this node's workers and start its zygote; ``join_first``: a node of a multi-node
        job, whose zygote imports while the agent joins its manager (a standby waits for it here:
        its spares are forked from it)."""
        self._server = await asyncio.start_server(self._channel.serve, "127.0.0.1", 0)
        self.worker_port = self._server.sockets[0].getsockname()[1]
        self._life.move(Event.SERVE)
        # Every worker is this process's child, and what a rank leaves behind comes here
        # (agent/children.py).
        if not become_subreaper():
            log.warning("node %d: no child subreaper on this platform: a process a rank starts "
                        "in a session of its own may outlive the rank", self.node)
        if join_first:
            # A node of a multi-node job joins its manager first (joining late can cost it its place
            # under --node-wait); the zygote imports meanwhile, and its node's workers wait for it
            # (zygote_ready).
            self._zygotes.begin()
        else:
            await self._zygotes.start()  # the manager in this process opens generation 0 after this
        self._run(self.watch.run())
        if self.config.trace.trace_switch_file:
            report = self._report
            # Where a mounted Kubernetes ConfigMap lands on this node; the manager spreads a change
            # to every node.
            watcher = SwitchFileWatcher(
                self.config.trace.trace_switch_file,
                lambda switch: report(TraceFileSet(switch.step, switch.comm, switch.by, switch.t)),
                lambda message: report(TraceFileError(message)))
            self._run(watcher.run())

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(report_crash)

    def zygote_pending(self) -> bool:
        """Whether this node's zygote is importing torch, or was let go while the node was idle."""
        return self._life.serving and self._zygotes.pending

    async def zygote_ready(self) -> None:
        """Until the zygote (started again if let go) serves or gives up: a fork costs no second
        torch import."""
        if self.zygote_pending():
            await self._zygotes.ready()

    def own_pids(self) -> set[int]:
        """Every process this agent started itself (never an orphan of a rank's)."""
        zygote = self._zygotes.zygote
        return {*self.ranks.pids(), *self.spares.spares, *(() if zygote is None else (zygote.pid,))}

    def set_trace(self, switch: TraceSet) -> None:
        """Every worker of this node, and every later one, follows this trace switch."""
        self._trace = switch
        self.ranks.set_trace(switch)

    def follow(self, control_port: int, job_dir: str = "") -> None:
        """What the manager's welcome says of the job: its control store's port, and (when given)
        the job dir its ranks write to, the manager's (one job dir on a shared filesystem)."""
        self.control_port = control_port
        if job_dir and job_dir != self.config.job_dir:
            self.config = dataclasses.replace(self.config, job_dir=job_dir)

    def become(self, node: int) -> None:
        """A standby given node ``node``: its ranks, reports and spares go by that number, and it
        keeps the job's ``--spares`` from now on (it kept a whole node's worth while it had
        none)."""
        self.node = node
        self.config = dataclasses.replace(self.config, node_rank=node)
        self.spares.become(node, self.config.spares)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._zygotes.close()
        self._life.move(Event.CLOSE)
        for task in list(self._tasks):
            task.cancel()
        await self._orphans.end_all(self.own_pids())  # nothing a rank started outlives the job
        release_subreaper()

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool,
              resume_from: str = "", incarnation: int = 0) -> tuple[int, bool]:
        """Give ``rank`` a process (called on the loop): a warm spare if one is ready.

        ``resume_from``: a checkpoint the new process starts from;
        ``incarnation``: the manager's number for it (the rank's owner key).
        Returns the PID and whether it was a spare.
        """
        return self._spawner.spawn(rank, record, joining=joining, resume_from=resume_from,
                                   incarnation=incarnation)

    def _spare_event(self, what: str, pid: int, **detail: Any) -> None:
        """Tell the manager's log what happened to a spare (its PID included: the job's record of
        spares)."""
        try:
            self._report(SpareEvent(self.node, pid, what, time.time(), detail))
        except Exception:  # a report must never stop the agent's own care of its spares
            log.exception("node %d: reporting %s of spare pid %d failed", self.node, what, pid)

    def keep_spares(self) -> None:
        """Start spares until ``config.spares`` are ready or warming up (``SparePool``)."""
        self.spares.keep()

    def spares_ready(self) -> int:
        return self.spares.ready()

    def kill(self, rank: int, sig: signal.Signals) -> bool:
        return self.ranks.kill(rank, sig)

    def abort(self, rank: int, generation: int, reason: str, at_step_start: bool = False,
              from_step: int = 0) -> bool:
        """Have ``rank`` leave ``generation`` (now, or at its next step's start): it rejoins."""
        return self.ranks.abort(rank, generation, reason, at_step_start, from_step)

    def tell(self, rank: int, message: Message) -> bool:
        """Send a command to ``rank``'s worker (queued until it says hello); False if it has no
        process."""
        return self.ranks.tell(rank, message)

    def arm(self, rank: int, fault: ArmFault) -> None:
        self.ranks.arm(rank, fault)

    def live_pids(self) -> dict[int, int]:
        return self.ranks.live_pids()

    def phases(self) -> dict[int, str]:
        """Each live rank's phase from its latest heartbeat (init, step, recovery, done)."""
        return self.ranks.phases()

    def state(self) -> AgentState:
        """The node's beat to its manager: its live ranks, their phases, its warm spares, its
        zygote."""
        return AgentState(node=self.node, live={str(r): p for r, p in self.live_pids().items()},
                          phases={str(r): p for r, p in self.phases().items()},
                          spares_ready=self.spares_ready(), t=time.time(),
                          zygote_pid=self._zygotes.pid or 0)

    def resume_after_stop(self) -> None:
        """Accept new workers again after ``stop_all`` (a fenced node joins afresh)."""
        self._life.move(Event.RESUME)

    async def stop_all(self, grace_s: float) -> None:
        """SIGTERM every worker's process group, SIGKILL what is left after ``grace_s``; spares go
        at once."""
        self._life.move(Event.STOP)
        self.spares.kill_all()
        live = [w.process for w in self.ranks.live()]
        self.ranks.say_stop()  # first: the SIGTERM that follows is a stop, not a preemption
        for process in live:
            signal_group(process.pid, signal.SIGTERM)
            # a stopped process acts on SIGTERM only once continued
            signal_group(process.pid, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for process in live:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(process.wait(), remaining)
            except asyncio.TimeoutError:
                kill_tree(process.pid)  # its group, and what it started in sessions of their own
                await process.wait()
        await self.spares.wait_all()
