"""Telling DTensors apart without importing ``torch.distributed.tensor`` (the state's and the
shards' common need).

Kept in a module of its own so that ``worker.state`` (what the user declares)
and ``worker.sharding`` (what a sharded state needs) both use it without
importing each other.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "has_dtensors"]


def is_dtensor(obj: Any) -> TypeGuard[DTensor]:
    # torch.distributed.tensor costs ~0.4 s to import (sympy, DTensor ops); a job that never made a
    # DTensor never imported it, so nothing here can be one: no import on every worker's start.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def has_dtensors(module: torch.nn.Module | None) -> bool:
    """True when any parameter or buffer of ``module`` is a DTensor (FSDP2, tensor parallel)."""
    if module is None:
        return False
    return any(is_dtensor(t) for t in module.state_dict().values())
