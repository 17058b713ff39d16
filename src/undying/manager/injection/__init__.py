"""Faults caused on purpose (``undying inject``), on a real process, each command checked first.

``injector`` (``Injector``: a crash, a hang, a comm error, a slow rank or an early leave, now or at
a step; the numeric drills are armed by ``integrity``).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.injection.injector import Injector

__all__ = ["Injector"]

_WHERE = {
    "Injector": "injector",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
