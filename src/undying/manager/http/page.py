"""The status web page the manager serves at ``GET /``.

The page is one self-contained HTML file (``static/status.html``: its own
style and script, no external assets) that polls ``api/status`` and redraws
itself, so the server side is only "hand out the file". It lives in a file of
its own rather than a Python string so it can be read and edited as HTML; it
ships as package data (pyproject's ``[tool.setuptools.package-data]``).
"""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["status_page"]


@functools.cache
def status_page() -> bytes:
    """The page's HTML, read from the installed package once."""
    return resources.files("undying.manager.http").joinpath("static", "status.html").read_bytes()
