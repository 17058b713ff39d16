"""An elastic job moving to the nodes it has, losing no completed step.

``record`` (``Regroup``: a regroup's record, and what a second fault during one makes of it);
``policy`` (pure: grow, form the world, wait, re-plan, fail); ``executor`` (``Regrouping``: carries
them out).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.regroup.executor import Regrouping
    from undying.manager.regroup.record import LOG_KEY

__all__ = ["LOG_KEY", "Regrouping"]

_WHERE = {
    "LOG_KEY": "record",
    "Regrouping": "executor",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
