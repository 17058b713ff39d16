"""The line between a manager and the agent in its own process: the multi-node conversation, without
a socket.

``undying run`` on one node holds its manager and its agent in one process.
They still speak only in ``protocol/node_wire.py`` messages, as across the
network: each command the manager's slot writes is decoded here and handed to
the agent's table (``agent/commands.py``), each report the agent makes is
encoded and decoded on its way to the manager's table
(``manager/node_reports.py``). Both happen at once, in the caller's turn of the
event loop (nothing to lose, nothing to number or acknowledge), so a spawn's
answer, the new process's PID, is known when the spawn returns, as before.

What the network adds, and this line does not: sessions, numbered reports kept
until logged, beats judged for silence (``manager/nodes.py``, ``agent/remote.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from undying.manager.node_reports import NodeReports
from undying.manager.node_slot import NodeSlot
from undying.protocol.codec import Codec, Message, MessageError
from undying.protocol.node_wire import decode_agent_report, decode_to_agent

__all__ = ["InProcessLine", "InProcessReports"]

log = logging.getLogger("undying.launch")


class InProcessLine:
    """Where the manager's slot of the node writes its commands: each line decoded and handled at
    once."""

    def __init__(self, command: Callable[[Message], None]) -> None:
        self._command = command
        self._closed = False

    def write(self, data: bytes) -> None:
        if self._closed:
            return
        for line in data.splitlines():
            try:
                message = decode_to_agent(line)
            except MessageError as e:
                # a command the agent's wire does not take: the manager's bug, said
                log.error("in-process line: dropped a command the agent cannot read: %s", e)
                continue
            self._command(message)

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    async def drain(self) -> None:
        """(Nothing is buffered: every line was handled as it was written.)"""


class InProcessReports:
    """Where the agent's reports go: each encoded and decoded as on the network, then to the
    manager's table."""

    def __init__(self, reports: NodeReports, slot: NodeSlot) -> None:
        self._reports = reports
        self._slot = slot

    def send(self, message: Message) -> None:
        if self._slot.writer is None or self._slot.writer.is_closing():
            return  # the job is over: the manager hears no more
        self._reports.handle(decode_agent_report(Codec.encode_object(message)), self._slot)
