"""The options that bound the manager's listening sockets, shared by ``undying run`` and ``undying manager``."""

from __future__ import annotations

import argparse

from undying.config import ConnectionLimits
from undying.inputs import finite_arg

__all__ = ["add_connection_arguments", "connection_limits"]

_DEFAULTS = ConnectionLimits()


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connections to the manager (its HTTP API and agents' port)")
    g.add_argument("--http-header-timeout", type=finite_arg("--http-header-timeout"),
                   default=_DEFAULTS.header_timeout, metavar="SECONDS",
                   help="a connection whose request headers (or body) are not complete this long after it opened "
                   f"or after its previous answer is closed (default {_DEFAULTS.header_timeout:g}, at most 60)")
    g.add_argument("--http-idle-timeout", type=finite_arg("--http-idle-timeout"),
                   default=_DEFAULTS.idle_timeout, metavar="SECONDS",
                   help=f"a kept-alive connection with no request this long is closed (default "
                   f"{_DEFAULTS.idle_timeout:g}, at most 60)")
    g.add_argument("--max-connections", type=int, default=0, metavar="N",
                   help="open connections per listening socket; at the cap the oldest idle one is closed for a "
                   "new one (default 0: a quarter of the open-files limit, 16 to 1024)")


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    limits = ConnectionLimits(header_timeout=args.http_header_timeout, idle_timeout=args.http_idle_timeout,
                              max_connections=args.max_connections)
    limits.validate()
    return limits
