"""What the manager does with each of an agent's reports: the manager's half of the one
conversation.

Every agent reports in ``protocol/node_wire.py`` messages, over the network
(``manager/nodes.py`` reads each node's connection; ``NodeReports.take``
takes its lines of reports in order, each once) or from the manager's own
process (``launch/in_process.py``); either way each report comes here, to one
table. Its workers' messages (and the agent's word on its spares) go to the
manager in runs (``on_messages``); the agent's own reports, each to its
handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from undying.manager.node_slot import NodeSlot
from undying.protocol.codec import Handlers, Message, MessageError
from undying.protocol.node_wire import (
    FROM_WORKERS,
    AgentState,
    NodeLeaving,
    NodeStep,
    NodeStopped,
    NumberedReports,
    RankExited,
    RankHung,
    RankProgress,
    RankSpawned,
    RanksStalled,
    TraceFileError,
    TraceFileSet,
    decode_agent_report,
    width,
)
from undying.protocol.trace_switch import TraceSwitch
from undying.protocol.worker_wire import TraceSet

__all__ = ["NodeEvents", "NodeReports", "NODE_REPORTS"]

log = logging.getLogger("undying.manager.nodes")

# Every report of an agent's own the table takes (a test checks it has a handler for each).
NODE_REPORTS = (AgentState, RankExited, RankSpawned, RankHung, RanksStalled, NodeStopped,
                NodeLeaving, TraceFileSet, TraceFileError)


class NodeEvents(Protocol):
    """What the manager hears from its nodes: their reports, and their comings and goings."""

    def on_messages(self, messages: list[Message]) -> None: ...

    def on_exit(self, rank: int, pid: int, returncode: int, t: float) -> None: ...

    def on_spawned(self, rank: int, pid: int, warm: bool, incarnation: int) -> None: ...

    def on_hang(self, rank: int, pid: int, phase: str, last_seen: float, t: float) -> None: ...

    def on_stall(self, progress: list[RankProgress], limit: float, t: float) -> None: ...

    def on_trace_file(self, switch: TraceSwitch) -> None: ...

    def on_trace_file_error(self, message: str) -> None: ...

    def on_node_lost(self, node: int, reason: str, t: float) -> None: ...

    def on_node_joined(self, node: int, session: str, host: str, live: dict[int, int]) -> None: ...

    def welcome_trace(self) -> TraceSet: ...

    def on_standby(self, what: str, detail: dict[str, Any]) -> None: ...


class NodeReports:
    """The table from an agent's report to the manager's act (``events`` once the manager
    exists)."""

    def __init__(self, events: Callable[[], NodeEvents],
                 lose: Callable[[NodeSlot, str], None]) -> None:
        self._events = events
        self._lose = lose
        self.table = Handlers[None]({
            AgentState: lambda message, slot: slot.on_state(message),
            RankExited: self._on_exited,
            RankSpawned: self._on_spawned,
            RankHung: lambda m, slot: self._events().on_hang(
                m.rank, m.pid, m.phase, m.last_seen, m.t),
            RanksStalled: lambda m, slot: self._events().on_stall(m.progress, m.limit, m.t),
            NodeStopped: lambda message, slot: slot.stopped(message.seq),
            NodeLeaving: lambda m, slot: self._lose(
                slot, f"node {slot.node} ({slot.host}) is leaving: {m.reason}"),
            TraceFileSet: lambda m, slot: self._events().on_trace_file(
                TraceSwitch(m.step, m.comm, m.by, m.t)),
            TraceFileError: lambda message, slot: self._events().on_trace_file_error(
                message.message),
        }, otherwise=lambda message, slot: log.warning(
            "node %d: unexpected message %r", slot.node, message))

    @staticmethod
    def is_workers(message: Message | None) -> bool:
        """A worker's message (or the agent's word on its spares, or a step's commits): taken in
        runs."""
        return isinstance(message, NodeStep) or type(message) in FROM_WORKERS

    def handle(self, message: Message, slot: NodeSlot) -> None:
        """One report of the node's, as it came (a worker's message in a run of one)."""
        if self.is_workers(message):
            self._events().on_messages([message])
        else:
            self.table.handle(message, slot)

    def workers(self, messages: list[Message]) -> None:
        """A run of the node's workers' messages, in order."""
        self._events().on_messages(messages)

    def take(self, slot: NodeSlot, session: str, writer: asyncio.StreamWriter,
             line: NumberedReports, received: dict[int, int]) -> None:
        """A line of reports, in order; each taken once, however often it is sent (by its number).

        The line (``session``, over ``writer``) speaks for the node only while
        it is the slot's. The node's position (``received``, the agents'
        server's) moves to a report before it is handled, so a log commit made
        while it is handled counts it. A run of workers' messages (a NodeStep's
        commits among them) goes to the manager in one call (``on_messages``),
        the position moved past all of them first.
        """
        node = slot.node
        last = line.first - 1  # the number of the report before this one
        run: list[Message] = []
        for body in line.reports:
            try:
                message: Message | None = decode_agent_report(body)
            except MessageError as e:
                log.warning("node %d: dropped a bad report: %s", node, e)
                message = None
            first, last = last + 1, last + width(message)
            taken = received.get(node, 0)
            if last <= taken:
                # sent again after a break or a manager restart; this manager has it already
                continue
            # its commits, those this manager lacks, in one record
            if isinstance(message, NodeStep):
                run.append(message.after(taken - first + 1))
                received[node] = last
                continue
            if self.is_workers(message):
                assert message is not None
                run.append(message)
                received[node] = last
                continue
            if run:
                self.workers(run)
                run = []
                if not (slot.session == session and slot.writer is writer):
                    return
            received[node] = last
            if message is not None:
                self.table.handle(message, slot)
                if not (slot.session == session and slot.writer is writer):
                    return  # the node left, or was lost: the rest of its line is stale
        if run:
            self.workers(run)

    def _on_exited(self, message: RankExited, slot: NodeSlot) -> None:
        slot.live.pop(message.rank, None)
        self._events().on_exit(message.rank, message.pid, message.returncode, message.t)

    def _on_spawned(self, message: RankSpawned, slot: NodeSlot) -> None:
        slot.answered(message)
        self._events().on_spawned(message.rank, message.pid, message.warm, message.incarnation)
