"""Where ranks run: a host's state (ok, drained, quarantined), and ranks and nodes moved on purpose.

``hosts`` (``HostBook``: one state per host, and when a quarantined host requalifies); ``migration``
(``Migrations``: planned moves at a step boundary, drains); ``moves`` (a move while it waits,
and its boundary step); ``requests`` (an operator's move request, checked); ``host_marks`` (where
a rank runs, quarantining the host of a fault); ``standby_seats`` (the standby agents a whole node
moves to).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.placement.host_marks import host_of, node_host, quarantine
    from undying.manager.placement.hosts import LOG_KEY, HostBook, HostState
    from undying.manager.placement.migration import Migrations
    from undying.manager.placement.requests import MOVE_EXAMPLES, request_move

__all__ = [
    "HostBook",
    "HostState",
    "LOG_KEY",
    "MOVE_EXAMPLES",
    "Migrations",
    "host_of",
    "node_host",
    "quarantine",
    "request_move",
]

_WHERE = {
    "HostBook": "hosts",
    "HostState": "hosts",
    "LOG_KEY": "hosts",
    "MOVE_EXAMPLES": "requests",
    "Migrations": "migration",
    "host_of": "host_marks",
    "node_host": "host_marks",
    "quarantine": "host_marks",
    "request_move": "requests",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
