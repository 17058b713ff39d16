"""The status web page the manager serves at ``GET /``, and the pages open on it.

The page is one self-contained HTML file (``static/status.html``: its own
style and script, no external assets) that polls ``api/status`` and redraws
itself, so the server side is only "hand out the file". It lives in a file of
its own rather than a Python string so it can be read and edited as HTML; it
ships as package data (pyproject's ``[tool.setuptools.package-data]``).

The page's last word. When the job ends its manager stops serving, and a page
that polls once a second would keep the last state it saw ("running") for
good. So the server notes each open page (``OpenPages``: the page names itself
in ``X-Undying-Page``), and before it stops (``PageRunner``) it waits, a few
seconds at most and only for pages that polled lately, until each was answered
once with the job's end state.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

__all__ = ["status_page", "OpenPages", "PageRunner", "PAGES", "PAGE_HEADER"]

# Open pages: the header they name themselves in, how many are remembered, how recent a poll counts
# as open, and how long a stopping server waits for them to see the end (a page polls once a
# second).
PAGE_HEADER = "X-Undying-Page"
_MAX_PAGES = 64
_PAGE_OPEN_S = 5.0
_PAGE_WAIT_S = 3.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@functools.cache
def status_page() -> bytes:
    """The page's HTML, read from the installed package once."""
    return resources.files("undying.manager.http").joinpath("static", "status.html").read_bytes()


class OpenPages:
    """The pages that poll ``/api/status`` (by the id each names itself with)
    and whether each saw the end."""

    def __init__(self, ended: Callable[[], bool]) -> None:
        self._ended = ended
        # page id -> (its last poll, monotonic; it saw the end)
        self._seen: dict[str, tuple[float, bool]] = {}

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # (asked before the answer is made: an end after it is not in the answer)
        ended = self._ended()
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
        return sum(1 for t, saw_end in self._seen.values()
                   if not saw_end and now - t < _PAGE_OPEN_S)

    async def told(self, timeout: float = _PAGE_WAIT_S) -> None:
        """Once the job ended: wait until every open page saw it, ``timeout`` at most."""
        if not self._ended():
            return
        deadline = time.monotonic() + timeout
        while self.waiting() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


PAGES = web.AppKey("pages", OpenPages)


class PageRunner(web.AppRunner):
    """The app's runner: before it stops serving, the open pages are told how the job ended."""

    async def cleanup(self) -> None:
        await self.app[PAGES].told()
        await super().cleanup()
