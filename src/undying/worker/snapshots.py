"""The last N pre-step states of a ``State``, in memory: what a roll-back goes back to.

A ``SnapshotRing`` of capacity N holds, for each of the last N steps, the
state as it was before that step ran (the state of the step before it,
committed). Saving copies every tensor of ``State.state_dict()`` into buffers
allocated at the first save and reused after (no allocation a step), and the
rest (the scheduler's counters, the optimizer's hyper-parameters, extras) as a
deep copy, which is small. Its cost is one copy of the state a step (the model
and the optimizer's tensors) and N copies of it in memory; docs/benchmarks.md
gives the figures.

The API is small on purpose, so that other parts can go back too:

- ``save(index, state)``: the state before step ``index`` (call it before the step runs);
- ``oldest``: the earliest step whose pre-state is held (None: none);
- ``restore(index, state)``: load the pre-state of step ``index`` into ``state``,
  and forget that one and every later one (their steps are undone);
- ``forget_from(index)``: drop the pre-states of ``index`` and later without loading;
- ``nbytes``: the memory the ring holds.

The restored state is a copy (the ring's buffers never become the live
model's or optimizer's), so the next save cannot change what training uses.
It holds this process's tensors only: a sharded state rolls back each shard,
and every rank must restore the same ``index``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from undying.errors import UsageError

__all__ = ["SnapshotRing", "MAX_SNAPSHOTS"]

# The most pre-step states a ring keeps: each is a copy of the whole state.
MAX_SNAPSHOTS = 64


def _copy_into(value: Any, into: Any) -> Any:
    """``value`` with each tensor copied into the matching buffer of ``into`` (allocated when
    absent or unfit)."""
    if isinstance(value, torch.Tensor):
        if (isinstance(into, torch.Tensor) and into.shape == value.shape
                and into.dtype == value.dtype and into.device == value.device):
            with torch.no_grad():
                into.copy_(value)
            return into
        return value.detach().clone()
    if isinstance(value, dict):
        old = into if isinstance(into, dict) else {}
        return {k: _copy_into(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        fits = isinstance(into, list | tuple) and len(into) == len(value)
        old_seq = into if fits else [None] * len(value)
        out = [_copy_into(v, o) for v, o in zip(value, old_seq, strict=True)]
        return out if isinstance(value, list) else tuple(out)
    return copy.deepcopy(value)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        out = [_clone(v) for v in value]
        return out if isinstance(value, list) else tuple(out)
    return copy.deepcopy(value)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


class SnapshotRing:
    """The pre-step states of the last ``capacity`` steps, oldest first (see the module's
    docstring)."""

    def __init__(self, capacity: int) -> None:
        if not 1 <= capacity <= MAX_SNAPSHOTS:
            raise UsageError(f"a snapshot ring holds 1 to {MAX_SNAPSHOTS} states, got {capacity}")
        self.capacity = capacity
        self._held: OrderedDict[int, Any] = OrderedDict()  # step index -> its pre-state
        self._spare: Any = None  # the buffers of a dropped snapshot, reused by the next save

    @property
    def oldest(self) -> int | None:
        return next(iter(self._held), None)

    @property
    def indices(self) -> list[int]:
        return list(self._held)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(s) for s in self._held.values())

    def save(self, index: int, state: Any) -> None:
        """Hold the state before step ``index`` (a step saved again, as a replay does, is saved
        once)."""
        if index in self._held:
            return
        if self._held and index <= next(reversed(self._held)):
            self.forget_from(index)  # a step from before the newest: what is after it is stale
        if len(self._held) >= self.capacity:
            _, self._spare = self._held.popitem(last=False)
        self._held[index] = _copy_into(state.state_dict(), self._spare)
        self._spare = None

    def restore(self, index: int, state: Any) -> None:
        """Load the pre-state of step ``index``; it and every later one are forgotten (their steps
        are undone)."""
        if index not in self._held:
            raise UsageError(f"no snapshot of the state before step {index}: the ring holds "
                             f"{self.indices}")
        state.load_state_dict(_clone(self._held[index]))
        self.forget_from(index)

    def forget_from(self, index: int) -> None:
        """Drop the pre-states of step ``index`` and later."""
        for held in [i for i in self._held if i >= index]:
            self._spare = self._held.pop(held)
