"""The manager's HTTP API on localhost: one endpoint per resource.

GET  /                the status web page (polls /api/status once a second)
GET  /metrics         Prometheus metrics of the job (text exposition format)
GET  /api/status      the job: state, generation, step, ranks, incidents
GET  /api/ranks       ranks with their step, state and PID
GET  /api/incidents   incidents with their timelines
POST /api/inject      {"kind": "crash", "rank": R, "at_step": S?, "phase": P?, "how": H?}
POST /api/stop        stop the job
GET  /api/trace       the trace switch: {"step": bool, "comm": bool, "by": who, "t": when, "error": ""}
PUT  /api/trace       set it whole, as the switch file does: {"step": "on", "comm": "off"}
POST /api/trace       change it as the CLI does: {"on": true, "comm": false}
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from undying.errors import UsageError
from undying.manager.manager import Manager
from undying.manager.metrics import CONTENT_TYPE, exposition, new_registry
from undying.manager.page import status_page
from undying.trace.switch import TraceSwitch

__all__ = ["start_http", "build_app"]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, default=str))


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status=status)


def build_app(manager: Manager) -> web.Application:
    # One registry per app: several managers in one process (tests) must not share metrics.
    registry = new_registry(manager.status)

    async def page(request: web.Request) -> web.Response:
        # no-store: a browser kept open across a manager upgrade gets the new page on reload.
        return web.Response(body=status_page(), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=exposition(registry), headers={"Content-Type": CONTENT_TYPE})

    async def status(request: web.Request) -> web.Response:
        return _json(manager.status())

    async def ranks(request: web.Request) -> web.Response:
        return _json(manager.status()["ranks"])

    async def incidents(request: web.Request) -> web.Response:
        return _json(manager.status()["incidents"])

    async def inject(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "the body must be a JSON object like {\"kind\": \"crash\", \"rank\": 0}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        try:
            kind = str(body.get("kind", "crash"))
            rank = int(body["rank"])
            at_step = None if body.get("at_step") is None else int(body["at_step"])
            phase = None if body.get("phase") is None else str(body["phase"])
            how = None if body.get("how") is None else str(body["how"])
            factor = None if body.get("factor") is None else float(body["factor"])
        except (KeyError, TypeError, ValueError):
            return _error(400, "inject needs an integer \"rank\" (and optionally integer \"at_step\", "
                               "number \"factor\")")
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
        if not isinstance(on, bool) or not isinstance(comm, bool):
            return _error(400, 'trace needs a boolean "on" (and optionally a boolean "comm"), '
                               'e.g. {"on": true, "comm": false}')
        try:
            return _json(manager.change_trace(on=on, comm_only=comm, by=_who(request, body)))
        except UsageError as e:
            return _error(400, str(e))

    async def stop(request: web.Request) -> web.Response:
        manager.stop("stopped through the API")
        return _json({"stopping": True})

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/status", status)
    app.router.add_get("/api/ranks", ranks)
    app.router.add_get("/api/incidents", incidents)
    app.router.add_post("/api/inject", inject)
    app.router.add_post("/api/stop", stop)
    app.router.add_get("/api/trace", trace_get)
    app.router.add_put("/api/trace", trace_put)
    app.router.add_post("/api/trace", trace_post)
    return app


async def _body(request: web.Request, example: str) -> dict[str, Any] | web.Response:
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return _error(400, f"the body must be a JSON object like {example}")
    if not isinstance(body, dict):
        return _error(400, f"the body must be a JSON object like {example}")
    return body


def _who(request: web.Request, body: dict[str, Any]) -> str:
    """Who changed the switch, as the status shows it: the caller's own word, else the API and its peer."""
    said = body.get("by")
    if isinstance(said, str) and said.strip():
        return said.strip()[:80]
    return f"api {request.remote or ''}".strip()


async def start_http(manager: Manager, host: str, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(build_app(manager), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise UsageError(f"cannot serve the manager API on {host}:{port} ({e.strerror}); pass another --http-port") from e
    bound = runner.addresses[0][1]
    return runner, f"http://{host}:{bound}"
