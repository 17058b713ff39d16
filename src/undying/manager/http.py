"""The manager's HTTP API on localhost: one endpoint per resource.

GET  /                the status web page (polls /api/status once a second)
GET  /metrics         Prometheus metrics of the job (text exposition format)
GET  /api/status      the job: state, generation, step, ranks, incidents
GET  /api/ranks       ranks with their step, state and PID
GET  /api/incidents   incidents with their timelines
POST /api/inject      {"kind": "crash", "rank": R, "at_step": S?, "phase": P?, "how": H?}
POST /api/stop        stop the job
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from undying.errors import UsageError
from undying.manager.manager import Manager
from undying.manager.metrics import CONTENT_TYPE, exposition, new_registry
from undying.manager.page import status_page

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
        except (KeyError, TypeError, ValueError):
            return _error(400, "inject needs an integer \"rank\" (and optionally integer \"at_step\")")
        try:
            return _json(manager.inject(kind, rank, at_step, phase, how))
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
    return app


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
