"""The worker library: what runs inside each rank (the step transaction, recovery, state transfer).

Names are imported on first use (PEP 562): the agent imports
``undying.worker.boot`` to start workers and must not import torch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.worker.job import Job, init
    from undying.worker.numerics import Numerics
    from undying.worker.state import State
    from undying.worker.step import Step

__all__ = ["Job", "Step", "init", "State", "Numerics"]

_WHERE = {"Job": "job", "Step": "step", "init": "job", "State": "state", "Numerics": "numerics"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"undying.worker.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'undying.worker' has no attribute {name!r}")
