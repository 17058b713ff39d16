"""The workers' channel: each local process's line to its agent, and what the agent does with each
report.

A worker, a warm spare or the verifier connects to the agent's loopback port
and first shows the agent's key (``protocol/channel_key.py``); a connection
that does not, within ``_KEY_WAIT_S``, is closed and counted (the first ten
logged: a flood of strangers cannot grow the log). Then each line is one typed
report (``protocol/worker_wire.py``): a ``Hello`` makes the line that rank's
(the commands held for it go out, and the node's trace switch), beats stay
here (the agent judges hangs and stalls from them, agent/liveness.py), a
commit also feeds the node's step times (the automatic step timeout), a spare's
reports go to the spare pool, and every other report goes to the manager as it
is. A handler's False closes the line.

The channel is one named part of the agent, given at construction what it
reads and feeds (the agent's processes by PID, its spare pool, its step times,
its trace switch, and where reports go); it keeps no state of its own but the
count of refused connections.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from undying.agent.spares import Process, SparePool
from undying.protocol.channel_key import shows_key
from undying.protocol.codec import Handlers, Message, MessageError
from undying.protocol.kinds import WorkerPhase
from undying.protocol.node_wire import RankProgress
from undying.protocol.worker_wire import (
    Heartbeat,
    Hello,
    SpareReady,
    SpareTaken,
    StepCommitted,
    TraceSet,
    decode_from_worker,
    encode,
)

__all__ = ["LocalWorker", "WorkerChannel"]

log = logging.getLogger("undying.agent")

# A worker or spare shows the key at once; a connection silent this long is dropped.
_KEY_WAIT_S = 10.0


@dataclass
class LocalWorker:
    """One process of this node holding a rank: what the agent knows of it and its line to it."""

    rank: int
    process: Process
    writer: asyncio.StreamWriter | None = None
    pending: list[Message] = field(default_factory=list)  # commands held until its Hello
    started: float = field(default_factory=time.time)
    last_seen: float = 0.0  # the last message of any kind; 0 before the first
    hang_reported: bool = False
    beat: Heartbeat | None = None  # the latest, with the rank's progress
    stall_reported_t: float = 0.0  # the progress time of the stall last reported
    stall_reported_at: float = 0.0  # when (a stall that lasts is reported again each limit)
    last_commit: tuple[int, int, float] = (-1, -1, 0.0)  # generation, step, time
    incarnation: int = 0  # the manager's number for this process as the rank's holder

    def progress(self) -> RankProgress:
        beat = self.beat
        if beat is None:
            return RankProgress(self.rank, self.pid, -1, WorkerPhase.INIT, 0, -1, self.started)
        return RankProgress(self.rank, self.pid, beat.generation, beat.phase, beat.step,
                            beat.collectives, beat.progress_t)

    @property
    def pid(self) -> int:
        return self.process.pid


class WorkerChannel:
    """The agent's loopback server's handler: one ``serve`` per local connection."""

    def __init__(self, node: int, key: str, by_pid: dict[int, LocalWorker], spares: SparePool,
                 step_times: deque[float], *, trace: Callable[[], TraceSet | None],
                 forward: Callable[[Message], None]) -> None:
        self.node = node
        self._key = key
        self._by_pid = by_pid
        self.spares = spares
        self._step_times = step_times
        self._trace = trace
        self._send = forward
        self._refused = 0
        self._handlers = self._build_handlers()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = _Line(writer)
        try:
            if not shows_key(await asyncio.wait_for(reader.readline(), _KEY_WAIT_S), self._key):
                self._refused += 1
                if self._refused <= 10:  # bounded: a flood of strangers cannot grow the log
                    log.warning("node %d: refused a local connection without the agent's key",
                                self.node)
                return
            while True:
                data = await reader.readline()
                if not data:
                    return
                try:
                    message = decode_from_worker(data)
                except MessageError as e:
                    log.warning("node %d: dropped a bad message from a worker: %s", self.node, e)
                    continue
                if not self._handlers.handle(message, line):
                    return  # not ours, or already let go: closing the line ends it
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            return
        finally:
            worker = line.worker
            if worker is not None and worker.writer is writer:
                worker.writer = None
            writer.close()

    def _build_handlers(self) -> Handlers[bool]:
        """What the agent does with each report on a worker's line; a handler's False closes the
        line."""
        return Handlers({
            SpareReady: lambda message, line: self.spares.on_ready(message, line.writer),
            SpareTaken: lambda message, line: self.spares.on_taken(message),
            Hello: self._on_hello,
            Heartbeat: self._on_heartbeat,
            StepCommitted: self._on_commit,
        }, otherwise=self._forward)

    def _on_hello(self, message: Hello, line: _Line) -> bool:
        """The line is this rank's now: what was held for it goes out, and the trace switch."""
        worker = line.worker = self._by_pid.get(message.pid)
        if worker is not None:
            worker.writer = line.writer
            for pending in worker.pending:
                line.writer.write(encode(pending))
            worker.pending.clear()
            trace = self._trace()
            if trace is not None:
                line.writer.write(encode(trace))
        return self._forward(message, line)

    def _on_heartbeat(self, message: Heartbeat, line: _Line) -> bool:
        """Beats stay here: the manager hears of hangs and stalls (``hang_watch.py``), not of every
        beat."""
        if line.worker is not None:
            line.worker.last_seen = time.time()
            line.worker.beat = message
        return True

    def _on_commit(self, message: StepCommitted, line: _Line) -> bool:
        worker = line.worker
        if worker is not None:
            generation, step, t = worker.last_commit
            if (message.generation, message.step) == (generation, step + 1):
                self._step_times.append(message.t - t)  # a plain step, no recovery inside
            worker.last_commit = (message.generation, message.step, message.t)
        return self._forward(message, line)

    def _forward(self, message: Message, line: _Line) -> bool:
        """A worker's report about the job: the manager's to hear."""
        if line.worker is not None:
            line.worker.last_seen = time.time()
        self._send(message)
        return True


@dataclass
class _Line:
    """A local process's line to the agent: the rank it speaks for, once its Hello said."""

    writer: asyncio.StreamWriter
    worker: LocalWorker | None = None
