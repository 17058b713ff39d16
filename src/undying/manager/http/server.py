"""The manager's HTTP API: one endpoint per resource, each behind the job's token.

GET  /                the status web page (polls /api/status once a second)
GET  /metrics         Prometheus metrics of the job (text exposition format)
GET  /api/status      the job: state, generation, step, ranks, incidents
GET  /api/ranks       ranks with their step, state and PID
GET  /api/incidents   incidents with their timelines
GET  /api/series      the whole run for the page's charts, downsampled: ?from=S&to=S&points=N (all optional)
POST /api/inject      {"kind": "crash", "rank": R, "at_step": S?, "phase": P?, "how": H?, "factor": F?}
POST /api/stop        stop the job
POST /api/migrate     {"rank": R, "to": HOST?}: move a rank to a warm spare at a step boundary
POST /api/drain       {"host": H, "reason": "..."?}: no new ranks on the host; POST /api/undrain {"host": H} clears it
GET  /api/hello       the manager proves the job's key (X-Undying-Nonce; no token: protocol/api_proof.py)
GET  /api/trace       the trace switch: {"step": bool, "comm": bool, "by": who, "t": when, "error": ""}
PUT  /api/trace       set it whole, as the switch file does: {"step": "on", "comm": "off"}
POST /api/trace       change it as the CLI does: {"on": true, "comm": false}

Access. Every request shows the job's token (``undying.jobfiles.tokens``) as
``Authorization: Bearer <token>`` or ``X-Undying-Token: <token>``
(``undying.manager.http.access`` reads and checks it); without it, or with a wrong
one, the answer is 401 with a JSON error that says where the token is, and the
handler never runs, so nothing changes. A request may name
its job in ``X-Undying-Job``: a manager of another job answers 401 instead of
faulting the wrong job. The job check comes first: a job id is no secret (it is
in process lists and pod names) and "wrong manager" is the more useful answer.
With ``open_status`` the read-only endpoints (GET of /, /metrics, /api/status,
/api/ranks, /api/incidents, /api/trace) answer anyone, for a dashboard or a
Prometheus without the token; inject, stop and trace changes still need it.

The page in a browser. A browser cannot add a header to the address bar, so
``GET /`` also takes the token as ``/?token=<token>`` (only there: the API takes
headers only; a token in the query of any other path is refused, 401). The
page's script reads it from its own address and sends it
as an ``Authorization`` header on each poll; no cookie is set, so no other
site can make a browser send it (no CSRF), and the token leaves the page in
no ``Referer`` (``Referrer-Policy: no-referrer``). Bookmark the address with
the token; the server keeps no access log, and the lines it does write about
refused requests carry the path without its query (and any ``token=`` or
``Bearer`` value that still reaches a log line of this module or aiohttp's is
masked), so the token is written nowhere.

Before a command sends the token it asks ``GET /api/hello`` with a nonce, and
sends the token only on a connection whose listener answered with the proof
of the job's key (``undying.protocol.api_proof``): a listener named by a
planted or stale ``manager.json`` gets no token.

A malformed body is 400 naming the field, checked whole before anything is
done. Nothing is changed by any refused request.

The page's last word. When the job ends its manager stops serving, and a page
that polls once a second would keep the last state it saw ("running") for
good. So the server notes each open page (the page names itself in
``X-Undying-Page``), and before it stops it waits, a few seconds at most and
only for pages that polled lately, until each was answered once with the
job's end state. With no page open nothing waits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from undying.errors import UsageError
from undying.jobfiles.tokens import JOB_HEADER, ensure_token, where_the_token_is
from undying.manager.conns import ConnectionGuard, ConnectionLimits, GuardedSite, QuietLog
from undying.manager.http.access import token_from_headers, tokens_match
from undying.manager.http.page import status_page
from undying.manager.manager import Manager
from undying.manager.placement import MOVE_EXAMPLES, request_move
from undying.manager.views import CONTENT_TYPE, exposition, new_registry
from undying.protocol.api_proof import (
    HELLO_PATH,
    NONCE_HEADER,
    parse_nonce,
    peer_name,
    proof_key,
    proof_of,
)
from undying.protocol.trace_switch import TraceSwitch

__all__ = ["start_http", "build_app", "READ_ONLY_PATHS"]



class HideTokens(logging.Filter):
    """Masks what looks like a token (``token=...`` in a query, ``Bearer ...``) in a record's message."""

    _TOKEN = re.compile(r"((?:[?&;]|%3[fF]|%26)token(?:=|%3[dD]))[^&;\s'\"]*|(bearer\s+)\S+", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = self._TOKEN.sub(lambda m: (m.group(1) or m.group(2)) + "<hidden>", message)
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


log = logging.getLogger("undying.manager.http")
log.addFilter(QuietLog())  # a flood of refused requests: a few lines a minute, not one each
log.addFilter(HideTokens())
# aiohttp's own errors (malformed requests), short and as rare.
_server_log = logging.getLogger("undying.manager.http.requests")
_server_log.addFilter(QuietLog())
_server_log.addFilter(HideTokens())

# What open_status opens to anyone, for GET (and HEAD) only.
READ_ONLY_PATHS = frozenset({"/", "/metrics", "/api/status", "/api/ranks", "/api/incidents", "/api/series",
                             "/api/trace"})
_READ_METHODS = frozenset({"GET", "HEAD"})
_INJECT_EXAMPLE = '{"kind": "crash", "rank": 0}'
_INJECT_FIELDS = ("kind", "rank", "at_step", "phase", "how", "factor")
# A request body: every endpoint's fits in a few hundred bytes. aiohttp answers 413 past this.
_MAX_BODY = 64 * 1024
# JSON nesting and integer digits past these are no request of ours (and would cost a deep recursion
# or a quadratic int parse): 400 before they are parsed.
_MAX_DEPTH = 16
_MAX_DIGITS = 30
# Ranks and steps are counted, never negative; a step past this is no step a job reaches.
_MAX_STEP = 2**53
_MAX_RANK = 2**20
_BODY_WAIT_S = 10.0
# The page's charts: points per series it may ask for (the default draws one a few pixels wide).
_POINTS_DEFAULT, _POINTS_MAX = 400, 2000
# Open pages: the header they name themselves in, how many are remembered, how recent a poll counts as open,
# and how long a stopping server waits for them to see the end (a page polls once a second).
PAGE_HEADER = "X-Undying-Page"
_MAX_PAGES = 64
_PAGE_OPEN_S = 5.0
_PAGE_WAIT_S = 3.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(data, status=status, headers=headers, dumps=lambda d: json.dumps(d, default=str))


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return _json({"error": message}, status=status, headers=headers)


def build_app(manager: Manager, token: str | None = None, *, open_status: bool = False,
              connections: ConnectionGuard | None = None) -> web.Application:
    """The API of ``manager``; ``token`` defaults to the job's (``ensure_token`` of its job dir)."""
    expected = token if token is not None else ensure_token(Path(manager.config.job_dir))
    job_id = manager.config.job_id
    proving = proof_key(expected)  # what /api/hello proves the job with (never the token itself)
    where = where_the_token_is(manager.config.job_dir)
    # One registry per app: several managers in one process (tests) must not share metrics.
    registry = new_registry(manager.status, manager.history)
    pages = OpenPages(lambda: manager.state.terminal)

    def refusal(request: web.Request) -> web.Response | None:
        """Why ``request`` may not reach its handler, as the 401 to send; None when it may."""
        meant = request.headers.get(JOB_HEADER)
        if meant is not None and meant != job_id:
            return _error(401, f"this manager runs job {job_id}, the request is for job {meant}; "
                               f"check --job-dir or --manager")
        if request.path == HELLO_PATH:
            return None  # anyone may ask a manager to prove the job's key; the answer holds no secret
        if "token" in request.query and request.path != "/":
            return _error(401, "a token in a URL is refused (URLs end up in logs, histories and proxies): send it "
                               "as 'Authorization: Bearer <token>'")
        if open_status and request.method in _READ_METHODS and request.path in READ_ONLY_PATHS:
            return None
        given = token_from_headers(request.headers)
        if given is None and request.path == "/" and request.method in _READ_METHODS:
            given = request.query.get("token")
        if tokens_match(given, expected):
            return None
        problem = "no token" if not given else "a wrong token"
        page = " (a browser: open /?token=<token>)" if request.path == "/" else ""
        return _error(
            401,
            f"the manager of job {job_id} refused a request with {problem}: send the job's token as "
            f"'Authorization: Bearer <token>'{page}; {where}",
            headers={"WWW-Authenticate": f'Bearer realm="undying job {job_id}"'},
        )

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = refusal(request)
        if refused is not None:
            # The raw path, cut short (a decoded one may hold a newline that forges a log line), and never its
            # query: a token sent in the URL would be written whole.
            path, query, _ = request.raw_path.partition("?")
            log.warning("job %s: refused %s %s%s from %s (%d)", job_id, request.method, ascii(path[:200]),
                        " (query not shown)" if query else "", request.remote or "?", refused.status)
            return refused
        return await handler(request)

    async def page(request: web.Request) -> web.Response:
        # no-store: a browser kept open across a manager upgrade gets the new page on reload.
        # no-referrer: the token in this page's address goes nowhere else.
        return web.Response(body=status_page(), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})

    async def hello(request: web.Request) -> web.Response:
        nonce = parse_nonce(request.headers.get(NONCE_HEADER))
        if nonce is None:
            return _error(400, f"{HELLO_PATH} needs a fresh nonce: a header {NONCE_HEADER} of 64 hex digits")
        peer = peer_name(request.transport.get_extra_info("peername") if request.transport is not None else None)
        return _json({"job_id": job_id, "peer": peer, "proof": proof_of(proving, nonce, job_id, peer)},
                     headers={"Cache-Control": "no-store"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=exposition(registry), headers={"Content-Type": CONTENT_TYPE})

    async def status(request: web.Request) -> web.Response:
        return _json(manager.status())

    async def series(request: web.Request) -> web.Response:
        try:
            first, last, points = _series_query(request.query)
        except _Malformed as e:
            return _error(400, str(e))
        view = manager.history.view(first, last, points)
        view["world_size"] = manager.world_size
        view["incidents"] = [{"id": i.id, "kind": i.kind.value, "rank": i.rank, "step": i.step, "t": i.fault_t,
                              "status": i.status.value, "action": i.action} for i in manager.incidents]
        return _json(view)

    async def ranks(request: web.Request) -> web.Response:
        return _json(manager.status()["ranks"])

    async def incidents(request: web.Request) -> web.Response:
        return _json(manager.status()["incidents"])

    async def inject(request: web.Request) -> web.Response:
        body = await _body(request, _INJECT_EXAMPLE)
        if isinstance(body, web.Response):
            return body
        try:
            kind, rank, at_step, phase, how, factor = _inject_fields(body)
        except _Malformed as e:
            return _error(400, str(e))
        try:
            return _json(manager.inject(kind, rank, at_step, phase, how, factor=factor))
        except UsageError as e:
            return _error(400, str(e))

    async def trace_get(request: web.Request) -> web.Response:
        return _json(manager.trace_status())

    async def trace_put(request: web.Request) -> web.Response:
        body = await _body(request, '{"step": "on", "comm": "off"}')
        if isinstance(body, web.Response):
            return body
        try:
            switch = TraceSwitch.parse({k: v for k, v in body.items() if k != "by"}, by=_who(request, body), t=time.time())
        except UsageError as e:
            return _error(400, str(e))
        return _json(manager.set_trace(switch))

    async def trace_post(request: web.Request) -> web.Response:
        body = await _body(request, '{"on": true, "comm": false}')
        if isinstance(body, web.Response):
            return body
        on, comm = body.get("on"), body.get("comm", False)
        if not isinstance(on, bool):
            return _error(400, f'trace needs a boolean "on", got {_short(on)}; e.g. {{"on": true, "comm": false}}')
        if not isinstance(comm, bool):
            return _error(400, f'"comm" must be a boolean, got {_short(comm)}; e.g. {{"on": true, "comm": false}}')
        try:
            return _json(manager.change_trace(on=on, comm_only=comm, by=_who(request, body)))
        except UsageError as e:
            return _error(400, str(e))

    async def move(request: web.Request) -> web.Response:  # migrate, drain, undrain (manager/placement/migration.py)
        what = request.path.rsplit("/", 1)[-1]
        body = await _body(request, MOVE_EXAMPLES[what])
        if isinstance(body, web.Response):
            return body
        try:
            return _json(request_move(manager.migrations, what, body, _who(request, body)))
        except UsageError as e:
            return _error(400, str(e))

    async def stop(request: web.Request) -> web.Response:
        manager.stop("stopped through the API")
        return _json({"stopping": True})

    # The connection guard (when served through start_http) sees every request, refused ones included.
    middlewares = [connections.middleware, guard, pages.middleware] if connections is not None else [
        guard, pages.middleware]
    app = web.Application(middlewares=middlewares, client_max_size=_MAX_BODY)
    app.router.add_get("/", page)
    app.router.add_get("/metrics", metrics)
    app.router.add_get(HELLO_PATH, hello)
    app.router.add_get("/api/status", status)
    app.router.add_get("/api/ranks", ranks)
    app.router.add_get("/api/incidents", incidents)
    app.router.add_get("/api/series", series)
    app.router.add_post("/api/inject", inject)
    app.router.add_post("/api/stop", stop)
    for what in MOVE_EXAMPLES:
        app.router.add_post(f"/api/{what}", move)
    app.router.add_get("/api/trace", trace_get)
    app.router.add_put("/api/trace", trace_put)
    app.router.add_post("/api/trace", trace_post)
    app[_PAGES] = pages
    return app


class OpenPages:
    """The pages that poll ``/api/status`` (by the id each names itself with) and whether each saw the end."""

    def __init__(self, ended: Callable[[], bool]) -> None:
        self._ended = ended
        self._seen: dict[str, tuple[float, bool]] = {}  # page id -> (its last poll, monotonic; it saw the end)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        ended = self._ended()  # (asked before the answer is made: an end after it is not in the answer)
        response = await handler(request)
        page = request.headers.get(PAGE_HEADER, "")
        if request.path == "/api/status" and response.status == 200 and 0 < len(page) <= 64:
            self._seen.pop(page, None)
            self._seen[page] = (time.monotonic(), ended)
            while len(self._seen) > _MAX_PAGES:
                del self._seen[next(iter(self._seen))]
        return response

    def waiting(self) -> int:
        """Pages open lately that have not been told the job ended."""
        now = time.monotonic()
        return sum(1 for t, saw_end in self._seen.values() if not saw_end and now - t < _PAGE_OPEN_S)

    async def told(self, timeout: float = _PAGE_WAIT_S) -> None:
        """Once the job ended: wait until every open page saw it, ``timeout`` at most."""
        if not self._ended():
            return
        deadline = time.monotonic() + timeout
        while self.waiting() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


_PAGES = web.AppKey("pages", OpenPages)


class _PageRunner(web.AppRunner):
    """The app's runner: before it stops serving, the open pages are told how the job ended."""

    async def cleanup(self) -> None:
        await self.app[_PAGES].told()
        await super().cleanup()


def _series_query(query: Mapping[str, str]) -> tuple[int | None, int | None, int]:
    """``from``, ``to`` and ``points`` of a series request, each checked; ``_Malformed`` names the bad one."""

    def whole(name: str, low: int, high: int) -> int | None:
        raw = query.get(name)
        if raw is None or raw == "":
            return None
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 16 or not low <= int(raw) <= high:
            raise _Malformed(f"?{name}= must be a whole number from {low} to {high}, got {_short(raw)}; "
                             f"e.g. /api/series?from=100&to=500&points=400")
        return int(raw)

    first, last = whole("from", 0, _MAX_STEP), whole("to", 0, _MAX_STEP)
    if first is not None and last is not None and first > last:
        raise _Malformed(f"?from={first} is after ?to={last}; ask for a range of steps from the first to the last")
    points = whole("points", 10, _POINTS_MAX)
    return first, last, _POINTS_DEFAULT if points is None else points


async def _body(request: web.Request, example: str) -> dict[str, Any] | web.Response:
    """The request's JSON object, or the 400 that says what is wrong with it (never a 500)."""
    try:
        raw = await asyncio.wait_for(request.read(), _BODY_WAIT_S)
    except asyncio.TimeoutError:
        return _error(408, f"the request body did not arrive within {_BODY_WAIT_S:.0f} s")
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the body is over {_MAX_BODY} bytes; a request is a small JSON object like {example}")
    try:
        body = parse_json(raw)
    except ValueError as e:
        return _error(400, f"the body must be a JSON object like {example}: {e}")
    if not isinstance(body, dict):
        return _error(400, f"the body must be a JSON object like {example}, got {type(body).__name__}")
    return body


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, held to what a request may hold; ``ValueError`` says what is wrong.

    ``json.loads`` alone turns a deep nesting into a RecursionError, 5,000
    digits into Python's int-conversion error and ``NaN`` into a float: each
    would have been a 500 or a number no check expects.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("it is not UTF-8") from None
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > _MAX_DEPTH:
                raise ValueError(f"it nests deeper than {_MAX_DEPTH} levels")
        elif ch in "]}":
            depth -= 1

    def whole(digits: str) -> int:
        if len(digits.lstrip("-")) > _MAX_DIGITS:
            raise ValueError(f"a number has more than {_MAX_DIGITS} digits")
        return int(digits)

    def real(digits: str) -> float:
        value = float(digits)
        if not math.isfinite(value):
            raise ValueError(f"the number {digits[:20]} is out of range")
        return value

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        return json.loads(text, parse_int=whole, parse_float=real, parse_constant=constant)
    except RecursionError:
        raise ValueError(f"it nests deeper than {_MAX_DEPTH} levels") from None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


class _Malformed(Exception):
    """A request body field that is missing or of the wrong type; the message names it."""


def _inject_fields(body: dict[str, Any]) -> tuple[str, int, int | None, str | None, str | None, float | None]:
    """The inject request's fields, each checked on its own; ``_Malformed`` names the first bad one.

    Strict on purpose: ``int()`` would quietly turn a rank of 1.7 into 1 and
    fault a rank nobody asked for, and a misspelt field would be dropped.
    """
    unknown = sorted(k for k in body if k not in _INJECT_FIELDS)
    if unknown:
        raise _Malformed(f"unknown field {_short(unknown[0])} in the inject body; the fields are "
                         f"{', '.join(_INJECT_FIELDS)}, e.g. {_INJECT_EXAMPLE}")

    def whole(name: str, low: int, high: int) -> int | None:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _Malformed(f'"{name}" must be a whole number, got {_short(value)}; e.g. {_INJECT_EXAMPLE}')
        if value is not None and not low <= value <= high:
            raise _Malformed(f'"{name}" must be between {low} and {high}, got {_short(value)}; e.g. {_INJECT_EXAMPLE}')
        return value

    def text(name: str) -> str | None:
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise _Malformed(f'"{name}" must be a string, got {_short(value)}; e.g. {_INJECT_EXAMPLE}')
        return value

    def number(name: str) -> float | None:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value)):
            raise _Malformed(f'"{name}" must be a number, got {_short(value)}; e.g. 1.2 for steps 20% slower')
        return None if value is None else float(value)

    rank = whole("rank", 0, _MAX_RANK)
    if rank is None:
        raise _Malformed(f'inject needs a "rank" (a whole number), e.g. {_INJECT_EXAMPLE}')
    kind = text("kind")
    return (kind if kind is not None else "crash", rank, whole("at_step", 1, _MAX_STEP), text("phase"), text("how"),
            number("factor"))


def _who(request: web.Request, body: dict[str, Any]) -> str:
    """Who changed the switch, as the status shows it: the caller's own word, else the API and its peer."""
    said = body.get("by")
    if isinstance(said, str) and said.strip():
        return said.strip()[:80]
    return f"api {request.remote or ''}".strip()


async def start_http(manager: Manager, host: str, port: int, *, open_status: bool = False,
                     limits: ConnectionLimits | None = None) -> tuple[web.AppRunner, str]:
    """Serve the API of ``manager`` on ``host:port`` with the job's token (``<job dir>/token``).

    Returns the runner (``cleanup()`` stops it) and the base URL. ``host`` is
    what the caller chose: 127.0.0.1 unless the user asked for more. Every
    connection is bounded by ``limits`` (default: the job's ``connections``).
    """
    limits = limits if limits is not None else manager.config.connections
    token = ensure_token(Path(manager.config.job_dir))
    guard = ConnectionGuard(limits)
    runner = _PageRunner(build_app(manager, token, open_status=open_status, connections=guard), access_log=None,
                           keepalive_timeout=limits.http_idle_timeout, logger=_server_log)
    await runner.setup()
    site = GuardedSite(runner, host, port, guard)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise UsageError(f"cannot serve the manager API on {host}:{port} ({e.strerror}); pass another --http-port") from e
    bound = runner.addresses[0][1]
    return runner, f"http://{host}:{bound}"
