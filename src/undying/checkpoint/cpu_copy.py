"""The CPU copy a save blocks the training loop for: a deep copy of the state with every tensor on
the CPU.

``AsyncCheckpointer`` (``checkpoint/writer.py``) writes this private copy on its
thread, never the live tensors, so training may change them right after ``save``
returns.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["cpu_copy"]


def cpu_copy(obj: Any, _memo: dict[int, Any] | None = None) -> Any:
    """A deep copy of a state dict with every tensor cloned into CPU memory.

    The clone is what makes async saving safe: the writer thread only ever sees
    this copy. A tensor that appears twice (tied weights) is copied once and
    stays shared, so torch.save stores it once, as it would have.
    """
    memo: dict[int, Any] = {} if _memo is None else _memo
    key = id(obj)
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(obj, torch.Tensor):
        out = obj.detach().to("cpu", copy=True)
    elif isinstance(obj, dict):
        try:
            out = type(obj)()
        except TypeError:
            out = {}
        for k, v in obj.items():
            out[k] = cpu_copy(v, memo)
    elif isinstance(obj, list):
        out = [cpu_copy(v, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [cpu_copy(v, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        out = copy.deepcopy(obj, {})
    memo[key] = out
    return out
