"""What an agent does with each of its manager's commands: the agent's half of the one conversation.

The manager speaks to every agent in ``protocol/node_wire.py`` messages, over
the network (``agent/remote.py``) or in its own process
(``launch/in_process.py``); either way each command comes here, to one table.
What the agent answers (the process it gave a rank, a node stopped) goes back
as a report of its own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from undying.agent.agent import Agent
from undying.protocol.codec import Handlers, Message
from undying.protocol.node_wire import (
    AbortRank,
    ArmRank,
    KeepSpares,
    KillRank,
    NodeStopped,
    RankSpawned,
    SpawnRank,
    StopNode,
    TellRank,
)
from undying.protocol.worker_wire import TraceSet

__all__ = ["NodeCommands", "NODE_COMMANDS", "report_state"]

log = logging.getLogger("undying.agent")

# Every command the table takes (a test checks it has a handler for each).
NODE_COMMANDS = (SpawnRank, KillRank, TellRank, ArmRank, AbortRank, KeepSpares, TraceSet, StopNode)


class NodeCommands:
    """The table from a manager's command to the agent's act; answers go to ``report``."""

    def __init__(self, agent: Agent, report: Callable[[Message], None]) -> None:
        self.agent = agent
        self._report = report
        self._tasks: set[asyncio.Task[None]] = set()
        # ranks waiting for the zygote (``_spawn``), oldest first
        self._deferred: dict[int, SpawnRank] = {}
        self.table = Handlers[object]({
            SpawnRank: self._spawn,
            KillRank: lambda message: agent.kill(message.rank, signal.Signals(message.signal)),
            TellRank: lambda message: agent.tell(message.rank, message.command),
            ArmRank: lambda message: agent.arm(message.rank, message.fault),
            AbortRank: lambda message: agent.abort(message.rank, message.generation,
                                                   message.reason, message.at_step_start,
                                                   message.from_step),
            KeepSpares: lambda message: agent.keep_spares(),
            TraceSet: lambda message: agent.set_trace(message),
            StopNode: self._start_stop,
        })

    def handle(self, message: Message) -> None:
        self.table.handle(message)

    def cancel(self) -> None:
        """The connection's session is over: what waited for the zygote or a stop is dropped."""
        self._deferred.clear()
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, message: SpawnRank) -> None:
        """Give the rank a process; while the node's zygote imports torch, once it serves.

        A fresh interpreter started beside the importing zygote doubled the
        CPU of every multi-node start and regroup (each node's ranks and its
        zygote importing torch side by side), for a process no sooner up. The
        PID reaches the manager in RankSpawned whenever it is known. A warm
        spare is taken at once.
        """
        agent = self.agent
        if self._deferred or (agent.zygote_pending()
                              and not (message.joining and agent.spares_ready())):
            if not self._deferred:
                self._run(self._spawn_when_ready())
            self._deferred.pop(message.rank, None)
            # a later SpawnRank of the same rank supersedes it
            self._deferred[message.rank] = message
            return
        pid, warm = agent.spawn(message.rank, message.record, joining=message.joining,
                                resume_from=message.resume_from, incarnation=message.incarnation)
        self._report(RankSpawned(message.rank, pid, warm, message.incarnation))

    async def _spawn_when_ready(self) -> None:
        await self.agent.zygote_ready()  # bounded: the zygote gives up at the init timeout
        deferred, self._deferred = self._deferred, {}
        for message in deferred.values():
            self._spawn(message)

    def _start_stop(self, message: StopNode) -> None:
        self._deferred.clear()  # a rank not started yet is stopped already
        self._run(self._stop(message))

    async def _stop(self, message: StopNode) -> None:
        await self.agent.stop_all(message.grace_s)
        self.agent.resume_after_stop()
        self._report(NodeStopped(message.seq))

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def report_state(agent: Agent, send: Callable[[Message], None], every_s: float) -> None:
    """The node's beat to its manager while a session lasts (``Agent.state``)."""
    while True:
        send(agent.state())
        await asyncio.sleep(every_s)
