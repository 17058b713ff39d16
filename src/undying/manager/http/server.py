"""The manager's HTTP API: one endpoint per resource, each behind the job's token.

GET  /                the status web page (polls /api/status once a second)
GET  /metrics         Prometheus metrics of the job (text exposition format)
GET  /api/status      the job: state, generation, step, ranks, incidents
GET  /api/ranks       ranks with their step, state and PID
GET  /api/incidents   incidents with their timelines
GET  /api/series      the whole run for the page's charts, downsampled: ?from=S&to=S&points=N
                      (all optional)
POST /api/inject      {"kind": "crash", "rank": R, "at_step": S?, "phase": P?, "how": H?,
                      "factor": F?}: 400 for a bad field, 409 for a drill the job's state
                      refuses (a step passed or past its end, a script without steps)
POST /api/stop        stop the job
POST /api/migrate     {"rank": R, "to": HOST?}: move a rank to a warm spare at a step boundary
POST /api/drain       {"host": H, "reason": "..."?}: no new ranks on the host;
                      POST /api/undrain {"host": H} clears it
GET  /api/hello       the manager proves the job's key (X-Undying-Nonce; no token:
                      protocol/api_proof.py)
GET  /api/trace       the trace switch: {"step": bool, "comm": bool, "by": who, "t": when,
                      "error": ""}
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
``GET /metrics`` also takes the user's scrape credential, one for all of the
user's jobs (``undying.jobfiles.prometheus``), and nothing else does.

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
done (``bodies.py``). Nothing is changed by any refused request.

The page's last word before the server stops
(each open page told how the job ended): ``page.py``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from undying.errors import ConflictError, UsageError
from undying.jobfiles.tokens import JOB_HEADER, ensure_token, where_the_token_is
from undying.manager.conns import ConnectionGuard, ConnectionLimits, GuardedSite, QuietLog
from undying.manager.http.access import token_from_headers, tokens_match
from undying.manager.http.bodies import (
    INJECT_EXAMPLE,
    MAX_BODY,
    Malformed,
    error,
    inject_fields,
    json_response,
    read_body,
    series_query,
    short,
    who,
)
from undying.manager.http.page import PAGES, OpenPages, PageRunner, status_page
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
    """Masks what looks like a token (``token=...`` in a query, ``Bearer ...``)
    in a record's message."""

    _TOKEN = re.compile(r"((?:[?&;]|%3[fF]|%26)token(?:=|%3[dD]))[^&;\s'\"]*|(bearer\s+)\S+",
                        re.IGNORECASE)

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
READ_ONLY_PATHS = frozenset({"/", "/metrics", "/api/status", "/api/ranks", "/api/incidents",
                             "/api/series", "/api/trace"})
_READ_METHODS = frozenset({"GET", "HEAD"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(manager: Manager, token: str | None = None, *, open_status: bool = False,
              connections: ConnectionGuard | None = None,
              scrape_credential: str | None = None) -> web.Application:
    """The API of ``manager``; ``token`` defaults to the job's (``ensure_token`` of its job dir).

    ``scrape_credential``: the user's (``undying.jobfiles.prometheus``), accepted for GET (and
    HEAD) /metrics and nothing else."""
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
            return error(401, f"this manager runs job {job_id}, the request is for job {meant}; "
                               f"check --job-dir or --manager")
        if request.path == HELLO_PATH:
            # anyone may ask a manager to prove the job's key; the answer holds no secret
            return None
        if "token" in request.query and request.path != "/":
            return error(401, "a token in a URL is refused (URLs end up in logs, histories and "
                              "proxies): send it as 'Authorization: Bearer <token>'")
        if open_status and request.method in _READ_METHODS and request.path in READ_ONLY_PATHS:
            return None
        given = token_from_headers(request.headers)
        if given is None and request.path == "/" and request.method in _READ_METHODS:
            given = request.query.get("token")
        if tokens_match(given, expected):
            return None
        if (scrape_credential is not None and request.path == "/metrics"
                and request.method in _READ_METHODS and tokens_match(given, scrape_credential)):
            return None
        problem = "no token" if not given else "a wrong token"
        page = " (a browser: open /?token=<token>)" if request.path == "/" else ""
        return error(
            401,
            f"the manager of job {job_id} refused a request with {problem}: send the job's token "
            f"as 'Authorization: Bearer <token>'{page}; {where}",
            headers={"WWW-Authenticate": f'Bearer realm="undying job {job_id}"'},
        )

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = refusal(request)
        if refused is not None:
            # The raw path, cut short (a decoded one may hold a newline that forges a log line), and
            # never its query: a token sent in the URL would be written whole.
            path, query, _ = request.raw_path.partition("?")
            log.warning("job %s: refused %s %s%s from %s (%d)", job_id, request.method,
                        ascii(path[:200]), " (query not shown)" if query else "",
                        request.remote or "?", refused.status)
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
            return error(400, f"{HELLO_PATH} needs a fresh nonce: a header {NONCE_HEADER} "
                              "of 64 hex digits")
        transport = request.transport
        peer = peer_name(transport.get_extra_info("peername") if transport is not None else None)
        proof = proof_of(proving, nonce, job_id, peer)
        return json_response({"job_id": job_id, "peer": peer, "proof": proof},
                     headers={"Cache-Control": "no-store"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=exposition(registry), headers={"Content-Type": CONTENT_TYPE})

    async def status(request: web.Request) -> web.Response:
        return json_response(manager.status())

    async def series(request: web.Request) -> web.Response:
        try:
            first, last, points = series_query(request.query)
        except Malformed as e:
            return error(400, str(e))
        view = manager.history.view(first, last, points)
        view["world_size"] = manager.world_size
        view["incidents"] = [{"id": i.id, "kind": i.kind.value, "rank": i.rank, "step": i.step,
                              "t": i.fault_t, "status": i.status.value, "action": i.action}
                             for i in manager.incidents]
        return json_response(view)

    async def ranks(request: web.Request) -> web.Response:
        return json_response(manager.status()["ranks"])

    async def incidents(request: web.Request) -> web.Response:
        return json_response(manager.status()["incidents"])

    async def inject(request: web.Request) -> web.Response:
        body = await read_body(request, INJECT_EXAMPLE)
        if isinstance(body, web.Response):
            return body
        try:
            kind, rank, at_step, phase, how, factor = inject_fields(body)
        except Malformed as e:
            return error(400, str(e))
        try:
            return json_response(manager.inject(kind, rank, at_step, phase, how, factor=factor))
        except ConflictError as e:  # well-formed, but the job's state refuses it now
            return error(409, str(e))
        except UsageError as e:
            return error(400, str(e))

    async def trace_get(request: web.Request) -> web.Response:
        return json_response(manager.tracing.status())

    async def trace_put(request: web.Request) -> web.Response:
        body = await read_body(request, '{"step": "on", "comm": "off"}')
        if isinstance(body, web.Response):
            return body
        try:
            switch = TraceSwitch.parse({k: v for k, v in body.items() if k != "by"},
                                       by=who(request, body), t=time.time())
        except UsageError as e:
            return error(400, str(e))
        return json_response(manager.tracing.set(switch))

    async def trace_post(request: web.Request) -> web.Response:
        body = await read_body(request, '{"on": true, "comm": false}')
        if isinstance(body, web.Response):
            return body
        on, comm = body.get("on"), body.get("comm", False)
        if not isinstance(on, bool):
            return error(400, f'trace needs a boolean "on", got {short(on)}; '
                              'e.g. {"on": true, "comm": false}')
        if not isinstance(comm, bool):
            return error(400, f'"comm" must be a boolean, got {short(comm)}; '
                              'e.g. {"on": true, "comm": false}')
        try:
            changed = manager.tracing.change(on=on, comm_only=comm, by=who(request, body))
            return json_response(changed)
        except UsageError as e:
            return error(400, str(e))

    # migrate, drain, undrain (manager/placement/migration.py)
    async def move(request: web.Request) -> web.Response:
        what = request.path.rsplit("/", 1)[-1]
        body = await read_body(request, MOVE_EXAMPLES[what])
        if isinstance(body, web.Response):
            return body
        try:
            return json_response(request_move(manager.migrations, what, body, who(request, body)))
        except UsageError as e:
            return error(400, str(e))

    async def stop(request: web.Request) -> web.Response:
        manager.stop("stopped through the API")
        return json_response({"stopping": True})

    # The connection guard (when served through start_http) sees every request, refused ones
    # included.
    middlewares = ([connections.middleware, guard, pages.middleware] if connections is not None
                   else [guard, pages.middleware])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
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
    app[PAGES] = pages
    return app


async def start_http(manager: Manager, host: str, port: int, *, open_status: bool = False,
                     limits: ConnectionLimits | None = None,
                     scrape_credential: str | None = None) -> tuple[web.AppRunner, str]:
    """Serve the API of ``manager`` on ``host:port`` with the job's token (``<job dir>/token``)
    (and, for GET /metrics only, the user's ``scrape_credential``).

    Returns the runner (``cleanup()`` stops it) and the base URL. ``host`` is
    what the caller chose: 127.0.0.1 unless the user asked for more. Every
    connection is bounded by ``limits`` (default: the job's ``connections``).
    """
    limits = limits if limits is not None else manager.config.connections
    token = ensure_token(Path(manager.config.job_dir))
    guard = ConnectionGuard(limits)
    app = build_app(manager, token, open_status=open_status, connections=guard,
                    scrape_credential=scrape_credential)
    runner = PageRunner(app, access_log=None, keepalive_timeout=limits.http_idle_timeout,
                        logger=_server_log)
    await runner.setup()
    site = GuardedSite(runner, host, port, guard)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise UsageError(f"cannot serve the manager API on {host}:{port} ({e.strerror}); "
                         "pass another --http-port") from e
    bound = runner.addresses[0][1]
    return runner, f"http://{host}:{bound}"
