"""Warm standby agents: which one takes which lost node, and the parked connections.

``policy`` (pure: ``promotions`` pairs lost nodes with parked standbys); ``roster`` (``Standbys``:
the parked connections, their beats, and seating one as a lost node's agent).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.standbys.policy import SlotFacts
    from undying.manager.standbys.roster import Parked, Standbys

__all__ = ["SlotFacts", "Parked", "Standbys"]

_WHERE = {
    "SlotFacts": "policy",
    "Parked": "roster",
    "Standbys": "roster",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
