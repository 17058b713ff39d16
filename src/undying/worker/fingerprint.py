"""A cheap fingerprint of a step's batch: equal for two batches iff (almost surely) bit-equal.

The manager compares the fingerprint a rank reports when it begins a step
with the one reported for the same rank and step before a fault
(``manager.divergence``): a replacement, or a survivor re-running the step,
must draw the same batch, or its losses are not those of the run it replaces.

Tensors on the CPU are hashed whole (BLAKE2b over their bytes, with their
dtype and shape); a tensor on an accelerator is summarized on its device (its
shape, dtype and two sums, one weighted by position) so that no batch is
copied to the host every step. Other values are hashed by their ``repr``.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import torch

__all__ = ["batch_fingerprint"]


def batch_fingerprint(*parts: Any) -> str:
    """16 hex digits over every tensor (and plain value) in ``parts``, nested in lists, tuples and
    dicts."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, parts)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.device.type == "cpu":
            if t.numel():
                t = t.contiguous()
                # (NumPy may be absent)
                h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
        else:
            flat = t.reshape(-1).to(torch.float64)
            weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)
            sums = torch.stack([flat.sum(), (flat * weights).sum()]).cpu()
            h.update(repr(sums.tolist()).encode())
    elif isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=str):
            h.update(repr(key).encode())
            _feed(h, obj[key])
        h.update(b"}")
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for item in obj:
            _feed(h, item)
        h.update(b"]")
    elif hasattr(obj, "__array__") and hasattr(obj, "dtype"):
        # A NumPy array, without importing NumPy.
        _feed(h, torch.as_tensor(obj))
    else:
        h.update(repr(obj).encode())
