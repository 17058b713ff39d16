"""The options that bound the manager's listening sockets, shared by ``undying run`` and
``undying manager``."""

from __future__ import annotations

import argparse

from undying.cli.settings import add_setting, from_args
from undying.config import ConnectionLimits
from undying.inputs import finite_arg

__all__ = ["add_connection_arguments", "connection_limits"]


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connections to the manager (its HTTP API and agents' port)")
    add_setting(g, ConnectionLimits, "--http-header-timeout",
                type=finite_arg("--http-header-timeout"), metavar="SECONDS",
                help="a connection whose request headers (or body) are not complete this long "
                "after it opened or after its previous answer is closed (default %(default)g, at "
                "most 60)")
    add_setting(g, ConnectionLimits, "--http-idle-timeout",
                type=finite_arg("--http-idle-timeout"), metavar="SECONDS",
                help="a kept-alive connection with no request this long is closed (default "
                "%(default)g, at most 60)")
    add_setting(g, ConnectionLimits, "--max-connections", type=int, metavar="N",
                help="open connections per listening socket; at the cap the oldest idle one is "
                "closed for a new one (default %(default)s: a quarter of the open-files limit, 16 "
                "to 1024)")


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    limits = from_args(ConnectionLimits, args)
    limits.validate()
    return limits
