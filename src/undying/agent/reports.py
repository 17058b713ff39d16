"""The agent's reports across the network: numbered, and each kept until the manager's log holds it.

The session with the manager (``remote.py``, ``NodeRunner``) connects,
reconnects and judges its manager's silence; what it says on each connection
is kept here, apart from it, so that nothing the agent reports is lost to a
break, a manager's restart or a long outage: the manager's welcome says what
its log holds, and the rest goes again, in order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Iterable, Iterator

from undying.protocol.codec import Codec, Message
from undying.protocol.node_wire import NodeStep, reports_line
from undying.protocol.worker_wire import StepCommitted

__all__ = ["ManagerClient"]

log = logging.getLogger("undying.agent.remote")

# Reports kept while the manager is unreachable are never dropped (each is a step someone trained);
# past every this many the agent says how many it holds, so a long outage shows in its log.
_KEPT_WARN_EVERY = 100_000
# The manager drops a line past 16 MiB: reports beyond this many bytes go on in a next line.
_LINE_BYTES = 1024 * 1024


def _lines(reports: Iterable[tuple[int, bytes]]) -> Iterator[bytes]:
    """Numbered reports (consecutive) as NumberedReports lines: the bytes ``encode`` writes, without
    re-encoding."""
    chunk: list[bytes] = []
    first = size = 0
    for seq, report in reports:
        if chunk and size + len(report) > _LINE_BYTES:
            yield reports_line(first, chunk)
            chunk, size = [], 0
        if not chunk:
            first = seq
        chunk.append(report)
        size += len(report) + 1
    if chunk:
        yield reports_line(first, chunk)


class ManagerClient:
    """Where the agent reports across the network: numbered reports, each kept until the manager
    logged it.

    What the agent reports in one pass of its event loop goes out as one
    ``NumberedReports`` line, written once the pass is over
    (``loop.call_soon``); outside an event loop a report is written at once.
    Its ranks' commits of a step, which arrive in one pass, travel as one
    ``NodeStep``: the manager decodes a record a node, not one a rank. Every
    report has its own numbers in the session (a NodeStep one a commit), and
    is kept from when it is made until an ``Acked`` says the manager's log
    committed it, across breaks and manager restarts: the manager's welcome
    says what it holds, and the rest is sent again in order.
    """

    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None
        self._seq = 0
        # (first number, last number, the report as a JSON object), oldest first, until
        # acknowledged.
        self._kept: deque[tuple[int, int, bytes]] = deque()
        self._unsent = 0  # the newest this many kept reports are not written on this connection yet
        self._flush_due = False
        # this pass's commits, gathered into NodeSteps as it ends
        self._commits: list[StepCommitted] = []

    def send(self, message: Message) -> None:
        """A report for the manager: kept until acknowledged, written as this pass of the loop ends.

        A rank's commit waits for the other commits of its pass (a ``NodeStep``);
        any other report travels as itself (``node_wire.FROM_WORKERS`` tells the
        manager which are its workers').
        """
        if type(message) is StepCommitted:
            self._commits.append(message)
            self._flush_soon()
            return
        self._gather()  # the commits made before it go first
        self._keep(Codec.encode_object(message), 1)  # as it travels inside NumberedReports

    def _gather(self) -> None:
        commits, self._commits = self._commits, []
        for step in NodeStep.gather(commits):
            self._keep(Codec.encode_object(step), step.width)

    def _keep(self, report: bytes, width: int) -> None:
        first = self._seq + 1
        self._seq += width
        self._kept.append((first, self._seq, report))
        if len(self._kept) % _KEPT_WARN_EVERY == 0:
            log.warning("%d reports kept for the manager (unreachable or not acknowledging); "
                        "none is dropped", len(self._kept))
        if self.writer is None:
            return
        self._unsent += 1
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no event loop (a script, a test): nothing to gather, written now
                self.flush()

    def flush(self) -> None:
        """Write the reports made since the last flush, in one line (more past ``_LINE_BYTES``)."""
        self._gather()
        self._flush_due = False
        count, self._unsent = min(self._unsent, len(self._kept)), 0
        writer = self.writer
        if not count or writer is None or writer.is_closing():
            return  # they stay kept: the next connection sends them
        newest = list(itertools.islice(reversed(self._kept), count))
        newest.reverse()
        writer.write(b"".join(_lines((first, report) for first, _, report in newest)))

    def acked(self, seq: int) -> None:
        while self._kept and self._kept[0][1] <= seq:
            self._kept.popleft()

    def connected(self, writer: asyncio.StreamWriter, acked: int) -> int:
        """Now online: what the manager lacks goes first, in order. Returns how many reports were
        resent."""
        self._gather()
        self.acked(acked)
        self.writer = writer
        self._unsent = 0
        if self._kept:
            writer.write(b"".join(_lines((first, report) for first, _, report in self._kept)))
        return len(self._kept)

    def disconnected(self) -> None:
        self.writer = None
        self._unsent = 0

    def has_kept(self) -> bool:
        return bool(self._kept or self._commits)

    def new_session(self) -> None:
        """Fenced: nothing said in the old session counts; the next one numbers from 1."""
        self._kept.clear()
        self._commits.clear()
        self._seq = 0
        self._unsent = 0
