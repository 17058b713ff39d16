"""The state a rank needs to continue: what ``undying.State`` declares.

Model, optimizer and LR scheduler are moved by their ``state_dict``. Extras are
objects with ``state_dict``/``load_state_dict`` or mutable dicts (updated in
place, so the user's reference stays valid); they are treated as replicated,
like the model under DDP. Random state and the data position are not stored:
they are derived from the step (see ``rng`` and ``data``).

A state is *sharded* when its model holds DTensors (FSDP2 ``fully_shard``):
each rank then holds only its slices, checkpoints go through
torch.distributed.checkpoint, and recovery moves shards (``worker.sharding``).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from undying.errors import StateError
from undying.worker.dtensor import has_dtensors, is_dtensor
from undying.worker.wrappers import loader_for_state, optimizer_for_state

__all__ = ["State"]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    if is_dtensor(t):
        t = t.to_local()  # this rank's slices: a digest per rank, no collective
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def _walk_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _walk_tensors(obj[key])
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _walk_tensors(item)


class State:
    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        loader: Any = None,
        *,
        sharded: bool | None = None,
        **extras: Any,
    ) -> None:
        if isinstance(model, DistributedDataParallel):
            model = model.module  # a DDP's state is its module's (what job.ddp(model) wraps)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise StateError(
                f"State(model=...) needs a torch.nn.Module, got {type(model).__name__}; "
                "pass the model (an nn.Module)"
            )
        for name, value in extras.items():
            stateful = hasattr(value, "state_dict") and hasattr(value, "load_state_dict")
            if not stateful and not isinstance(value, dict):
                raise StateError(
                    f"State extra {name!r} is a {type(value).__name__}; extras must have "
                    "state_dict()/load_state_dict() or be a dict (updated in place on restore)"
                )
        self.model = model
        # accelerate's and Lightning's wrappers unwrapped; ZeRO's partitioned state refused
        self.optimizer = optimizer_for_state(optimizer)
        self.scheduler = scheduler
        self.loader = loader_for_state(loader)
        self.extras = extras
        found = has_dtensors(model)
        if sharded is False and found:
            raise StateError(
                "State(sharded=False) but the model holds DTensors (FSDP2 fully_shard?): each "
                "rank has only its slices, so it cannot be saved or restored whole; leave sharded "
                "unset or pass sharded=True"
            )
        # Sharded: checkpoints through DCP written by every rank, recovery by shards (see
        # worker.sharding).
        self.sharded = found if sharded is None else sharded

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict() if self.model is not None else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "extras": {
                name: value.state_dict() if hasattr(value, "state_dict") else dict(value)
                for name, value in self.extras.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        for name, value in self.extras.items():
            saved = state["extras"][name]
            if hasattr(value, "load_state_dict"):
                value.load_state_dict(saved)
            else:
                value.clear()
                value.update(saved)

    def discard_gradients(self) -> None:
        """A failed step's partial gradients must not leak into the re-run."""
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None

    def digest(self) -> str:
        """A fingerprint of model and optimizer state, equal across runs iff bit-equal."""
        h = hashlib.sha256()
        for part in ("model", "optimizer"):
            obj = getattr(self, part)
            if obj is not None:
                for t in _walk_tensors(obj.state_dict()):
                    h.update(_tensor_bytes(t))
        return h.hexdigest()
