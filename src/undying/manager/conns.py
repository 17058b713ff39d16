"""Bounds on the manager's listening sockets: how long a connection may idle, how many may be open,
how much a flood of bad requests may write to the log.

Why: a socket costs the manager a file descriptor for as long as it is open.
aiohttp alone never closes a connection whose request headers never finish
(its keep-alive timer is an hour), so a few hundred half-open sockets used up
the descriptors the job needed for its next recovery ("Too many open files"),
and every malformed request logged a traceback.

- ``ConnectionLimits``: the options (``--http-header-timeout``,
  ``--http-idle-timeout``, ``--max-connections``), tens of seconds by default.
- ``ConnectionGuard``: wraps the HTTP server's protocol factory. Each
  connection has a deadline: its request headers must be complete within the
  header timeout of its accept (or of its previous response, which also
  bounds an idle keep-alive), a body must arrive within the header timeout of
  its headers. A watch closes a connection past its deadline. At the cap, a
  new connection closes the oldest one with no request in progress (a flood
  of idle sockets cannot lock out the operator's ``undying inject``); when
  every one is busy, the newcomer gets a 503 and is closed.
- The watch judges a client's slowness only over time the manager ran
  (``protocol/judge_clock.py``): after a stall of the manager itself every
  connection gets a fresh window, as its agents do.
- ``QuietLog``: a logging filter that lets through at most a few lines of one
  kind per minute, without tracebacks, then one line saying how many it held
  back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from undying.config import ConnectionLimits
from undying.protocol.judge_clock import JudgeClock

__all__ = ["ConnectionGuard", "GuardedSite", "QuietLog", "read_line"]

log = logging.getLogger("undying.manager.conns")

_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: 76\r\n\r\n"
            b'{"error": "the manager has too many requests in progress; try again later"}\n')


@dataclass
class _Conn:
    opened: float
    deadline: float
    limit: float  # what its deadline allows from its start (the header or the idle timeout)
    busy: bool = False
    transport: asyncio.Transport | None = None  # None until the connection is made


class _Refuse(asyncio.Protocol):
    """The answer to a connection over the cap when none can be closed for it: 503, then close."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_REFUSAL)
        transport.close()


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, passed every event, with the guard told when it opens
    and closes."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol, conn: _Conn) -> None:
        self._guard = guard
        self._inner = inner
        self._conn = conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._conn.transport = transport
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.forget(self._inner)
        self._inner.connection_lost(exc)


class ConnectionGuard:
    """Deadlines and a cap for the connections of one aiohttp server (see the module)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.cap = limits.cap
        # By aiohttp's protocol of the connection, which its requests name (``request.protocol``).
        self._conns: dict[asyncio.Protocol, _Conn] = {}
        self._watch: asyncio.Task[None] | None = None

    @property
    def open_count(self) -> int:
        return len(self._conns)

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """``make`` (aiohttp's protocol factory), with each connection tracked and the cap kept."""

        def build() -> asyncio.Protocol:
            now = time.monotonic()
            if len(self._conns) >= self.cap:
                # Only a connection already made can be closed: one accepted in this same batch has
                # no transport yet; the cap is then over by at most the listen backlog, for a
                # moment.
                idle = [(c.opened, p) for p, c in self._conns.items() if not c.busy
                        and c.transport is not None]
                if idle:
                    _, oldest = min(idle, key=lambda item: item[0])
                    self._close(oldest)
                    log.warning("HTTP: %d connections open (the cap, --max-connections): closed "
                                "the oldest idle one", self.cap)
                elif all(c.busy for c in self._conns.values()):
                    log.warning("HTTP: %d connections, all busy: refused one with 503",
                                len(self._conns))
                    return _Refuse()
            inner = make()
            conn = self._conns[inner] = _Conn(opened=now,
                                              deadline=now + self.limits.http_header_timeout,
                                              limit=self.limits.http_header_timeout)
            return _Tracked(self, inner, conn)

        return build

    def forget(self, inner: asyncio.Protocol) -> None:
        """The connection of ``inner`` closed."""
        self._conns.pop(inner, None)

    def _close(self, inner: asyncio.Protocol) -> None:
        """Close the connection of ``inner``; it no longer counts from now (its close completes a
        turn later)."""
        conn = self._conns.pop(inner, None)
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Marks the connection busy while its request is handled, then gives it the idle
        deadline."""
        conn = self._conns.get(request.protocol)
        if conn is not None:
            conn.busy = True
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.busy = False
                idle_s = self.limits.http_idle_timeout
                conn.deadline, conn.limit = time.monotonic() + idle_s, idle_s

    def start(self) -> None:
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    async def _watch_loop(self) -> None:
        period = max(0.05, min(1.0, self.limits.http_header_timeout / 4))
        clock = JudgeClock(period, min(self.limits.http_header_timeout,
                                       self.limits.http_idle_timeout), "the manager's HTTP server")
        while True:
            await asyncio.sleep(period)
            clock.tick()
            now = time.monotonic()
            late = [p for p, c in self._conns.items() if not c.busy and c.transport is not None
                    and clock.silent_s(c.deadline - c.limit, now) > c.limit]
            for inner in late:
                self._close(inner)
            if late:
                log.info("HTTP: closed %d connection(s) with no complete request within their time "
                         "limit", len(late))


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through ``guard`` (aiohttp's TCPSite offers no hook for
    it)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.factory(server), self._host, self._port, backlog=self._backlog,
            reuse_address=True)
        self._guard.start()

    async def stop(self) -> None:
        await self._guard.stop()
        await super().stop()


class QuietLog(logging.Filter):
    """At most ``burst`` lines of one kind (logger, level, format) per ``window_s``, each without
    its traceback; the first line after a window in which some were held back says how many.

    10,000 malformed requests then cost a few dozen short lines, not 10,000 tracebacks.
    """

    def __init__(self, burst: int = 10, window_s: float = 60.0) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        # kind -> [window start, lines, held back]
        self._seen: dict[tuple[str, int, str], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        state = self._seen.get(key)
        if state is None or now - state[0] >= self.window_s:
            held = int(state[2]) if state is not None else 0
            if len(self._seen) > 1000:
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            self._plain(record, held)
            return True
        if state[1] < self.burst:
            state[1] += 1
            self._plain(record, 0)
            if state[1] == self.burst:
                record.msg = (f"{record.msg} (more like this are held back for "
                              f"{self.window_s:.0f} s and counted)")
            return True
        state[2] += 1
        return False

    def _plain(self, record: logging.LogRecord, held: int) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            said = f"{type(exc).__name__}: {str(exc)[:200]}".replace("%", "%%")
            record.msg = f"{record.msg}: {said}"
        record.exc_info = None
        record.exc_text = None
        if held:
            record.msg = (f"{record.msg} (and {held} more like it held back in the last "
                          f"{self.window_s:.0f} s)")


# a flood: a few lines a minute of evictions and refusals, not one a connection
log.addFilter(QuietLog())


async def read_line(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """The next line of ``reader`` (``b""`` at its end, a partial line at EOF, as ``readline``), at
    most ``max_bytes`` long; past that, ``ValueError``.

    ``readline`` can only be bounded by the reader's one limit, fixed when the server starts. The
    agents' port needs two: a joined agent may send a 16 MB line of reports, but a connection that
    has not joined (anyone who can reach the port, token or not) must not make the manager buffer
    that much, times the connection cap. So the server's reader limit is the small one and a longer
    line is gathered here, piece by piece, only up to what the caller allows.
    """
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            parts.append(await reader.readuntil(b"\n"))
            return b"".join(parts)
        except asyncio.IncompleteReadError as e:
            parts.append(e.partial)
            return b"".join(parts)
        except asyncio.LimitOverrunError as e:
            piece = await reader.readexactly(e.consumed)
            size += len(piece)
            if size > max_bytes:
                raise ValueError(f"a line longer than {max_bytes} bytes") from None
            parts.append(piece)
