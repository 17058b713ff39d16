"""Faults caused on purpose (``undying inject``), on a real process, each command checked first.

``injector`` (``Injector``: a crash, a hang, a comm error, a slow rank or an early leave, now or at
a step; the numeric drills are armed by ``integrity``).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.manager.injection.injector import Injector

__all__ = ["Injector"]

_WHERE = {
    "Injector": "injector",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
