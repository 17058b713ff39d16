"""The job manager: state machine, recovery policy, incidents, HTTP API.

The job dir, its event log and the records it stores, and the token's file are
not the manager's own: every role reads them through ``undying.jobfiles``.

Names are imported on first use (PEP 562): importing one small module of the
manager must not pay for the whole manager with it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.manager.manager import Manager
    from undying.manager.recovery import Action, Decision, PolicyContext, decide

__all__ = ["Manager", "Action", "Decision", "PolicyContext", "decide"]

_WHERE = {
    "Manager": "manager",
    "Action": "recovery",
    "Decision": "recovery",
    "PolicyContext": "recovery",
    "decide": "recovery",
}


def lazy_surface(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562): each name of ``where`` imported on first use.

    The manager's subpackages are its surfaces; each is this with its own table.
    """

    def attribute(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return attribute


__getattr__ = lazy_surface(__name__, _WHERE)
