"""SIGTERM, the agreed stop step, the dying gasp: the decisions and carrying them out.

``policy`` (pure: what a SIGTERM does, the stop step, which checkpoint stands and what a resume
re-runs); ``executor`` (``Preemption``: asks the policy and carries each answer out within the
grace period).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.preemption.executor import Preemption

__all__ = ["Preemption"]

_WHERE = {
    "Preemption": "executor",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
