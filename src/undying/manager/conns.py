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
from typing import Any

from aiohttp import web

from undying.config import ConnectionLimits

__all__ = ["ConnectionGuard", "GuardedSite", "QuietLog"]

log = logging.getLogger("undying.manager.conns")

_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: 76\r\n\r\n"
            b'{"error": "the manager has too many requests in progress; try again later"}\n')


@dataclass
class _Conn:
    opened: float
    deadline: float
    busy: bool = False


class _Refuse(asyncio.Protocol):
    """The answer to a connection over the cap when none can be closed for it: 503, then close."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(_REFUSAL)
        transport.close()


class ConnectionGuard:
    """Deadlines and a cap for the connections of one aiohttp server (see the module)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.cap = limits.cap
        self._conns: dict[Any, _Conn] = {}
        self._watch: asyncio.Task[None] | None = None
        self.closed_idle = 0
        self.evicted = 0
        self.refused = 0

    @property
    def open_count(self) -> int:
        return len(self._conns)

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """``make`` (aiohttp's protocol factory), with each connection tracked and the cap kept."""

        def build() -> asyncio.Protocol:
            now = time.monotonic()
            self._forget_closed(now)
            if len(self._conns) >= self.cap:
                # Only a connection already made can be closed: one accepted in this same batch has no
                # transport yet (closing it now would leave its socket open for good).
                idle = [(c.opened, p) for p, c in self._conns.items()
                        if not c.busy and getattr(p, "transport", None) is not None]
                if idle:
                    _, oldest = min(idle, key=lambda item: item[0])
                    self._close(oldest)
                    self.evicted += 1
                    log.warning("HTTP: %d connections open (the cap, --max-connections): closed the oldest idle "
                                "one", self.cap)
                elif all(c.busy for c in self._conns.values()):
                    self.refused += 1
                    log.warning("HTTP: %d connections, all busy: refused one with 503", len(self._conns))
                    return _Refuse()
                # else: every idle one is of this accept batch; the cap is over by at most the listen backlog.
            protocol = make()
            self._conns[protocol] = _Conn(opened=now, deadline=now + self.limits.header_timeout)
            return protocol

        return build

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Marks the connection busy while its request is handled, then gives it the idle deadline."""
        conn = self._conns.get(request.protocol)
        if conn is not None:
            conn.busy = True
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.busy = False
                conn.deadline = time.monotonic() + self.limits.idle_timeout

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
        period = max(0.05, min(1.0, self.limits.header_timeout / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self._forget_closed(now)
            late = [p for p, c in self._conns.items() if not c.busy and now > c.deadline]
            for protocol in late:
                self._close(protocol)
            if late:
                self.closed_idle += len(late)
                log.info("HTTP: closed %d connection(s) with no complete request within their time limit", len(late))

    def forget(self, protocol: Any) -> None:
        """``protocol``'s connection is closed (aiohttp's server reports each one, see ``GuardedSite``)."""
        self._conns.pop(protocol, None)

    def _forget_closed(self, now: float) -> None:
        # A safety net only (closed connections are forgotten as they close): aiohttp's handler has no
        # transport before its connection is made (within a loop turn) and after it is lost.
        gone = [p for p, c in self._conns.items() if getattr(p, "transport", None) is None and now - c.opened > 5.0]
        for protocol in gone:
            del self._conns[protocol]

    def _close(self, protocol: Any) -> None:
        self._conns.pop(protocol, None)
        force_close = getattr(protocol, "force_close", None)
        if force_close is not None:
            force_close()
            return
        transport = getattr(protocol, "transport", None)
        if transport is not None:
            transport.close()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through ``guard`` (aiohttp's TCPSite offers no hook for it)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
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
        # aiohttp's server hears of every closed connection: so does the guard, at once (a flood of short
        # requests must not count against the cap after they closed).
        reported = server.connection_lost
        guard = self._guard

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            try:
                reported(handler, exc)
            finally:
                guard.forget(handler)

        server.connection_lost = connection_lost  # type: ignore[method-assign]
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.factory(server), self._host, self._port, backlog=self._backlog, reuse_address=True)
        self._guard.start()

    async def stop(self) -> None:
        await self._guard.stop()
        await super().stop()


class QuietLog(logging.Filter):
    """At most ``burst`` lines of one kind (logger, level, format) per ``window_s``, each without its
    traceback; the first line after a window in which some were held back says how many.

    10,000 malformed requests then cost a few dozen short lines, not 10,000 tracebacks.
    """

    def __init__(self, burst: int = 10, window_s: float = 60.0) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self._seen: dict[tuple[str, int, str], list[float]] = {}  # kind -> [window start, lines, held back]

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
                record.msg = f"{record.msg} (more like this are held back for {self.window_s:.0f} s and counted)"
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
            record.msg = f"{record.msg} (and {held} more like it held back in the last {self.window_s:.0f} s)"


log.addFilter(QuietLog())  # a flood: a few lines a minute of evictions and refusals, not one a connection
