"""The manager's HTTP port: the API, the status page, and the check of a caller's token.

``server`` (the endpoints, each behind the token); ``access`` (reading and comparing a caller's
token, over HTTP and in a node's join); ``page`` (the status page, ``static/status.html``).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.http.access import tokens_match
    from undying.manager.http.server import start_http

__all__ = ["start_http", "tokens_match"]

_WHERE = {
    "start_http": "server",
    "tokens_match": "access",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
