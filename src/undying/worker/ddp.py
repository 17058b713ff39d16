"""A DistributedDataParallel that follows the job's process-group generations.

DDP binds to one process group for life. After a recovery the group is a new
one, so the wrapper builds a fresh DDP around the same module (same parameter
tensors, so the user's optimizer stays valid) at its first forward in the new
generation: every rank reaches that point in the same step, which is what
DDP's constructor, a collective, requires.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from undying.worker.context import JobContext
from undying.worker.tracing import CommHookState, traced_allreduce_hook

__all__ = ["GenerationalDDP"]

# Asked of the live DDP; everything else is asked of the module, which exists
# before any group does (a replacement builds its optimizer before it joins).
_DDP_ATTRIBUTES = frozenset({"no_sync", "join", "join_hook", "register_comm_hook", "reducer"})


class GenerationalDDP:
    def __init__(self, ctx: JobContext, module: torch.nn.Module, **ddp_kwargs: Any) -> None:
        self.module = module
        self._ctx = ctx
        self._ddp_kwargs = ddp_kwargs
        first = next(module.parameters(), None)
        if first is not None and first.requires_grad:
            # Computed last in backward, while the other gradients' all-reduce runs.
            first.register_hook(self._in_backward)
        self._ddp: DistributedDataParallel | None = None
        self._generation = -1
        self._hooked = False  # whether the live DDP carries the comm-marker hook

    def invalidate(self) -> None:
        """Drop the DDP bound to a group that is going away."""
        self._ddp = None
        self._generation = -1

    def current(self) -> torch.nn.Module:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.module
        ctx = self._ctx
        hooked = ctx.tracing.comm_hook_at(ctx.current_step)
        if self._ddp is None or self._generation != ctx.generation or self._hooked != hooked:
            ddp = DistributedDataParallel(self.module, **self._ddp_kwargs)
            # DDP regroups its gradient buckets after its first iteration, in
            # the order gradients became ready. A DDP rebuilt after a fault
            # would run one iteration in the first grouping while the
            # fault-free run used the second, and the all-reduce would sum in
            # another order: the same numbers, other last bits. Asking for the
            # regrouping now, in parameter order, gives every DDP this wrapper
            # builds one and the same layout from its first iteration on.
            ddp.reducer._push_all_rebuilt_params()
            if hooked:
                # Comm markers: DDP's own all-reduce, done by a hook that times it (no bit changes).
                # A DDP takes a hook only before its first step, so switching comm rebuilds it,
                # on every rank at the same step (see TraceSet.comm_from_step).
                ddp.register_comm_hook(
                    CommHookState(ctx.tracing, ddp.process_group, dist.get_world_size(ddp.process_group)),
                    traced_allreduce_hook,
                )
            self._ddp = ddp
            self._generation = ctx.generation
            self._hooked = hooked
        return self._ddp

    def _in_backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        self._ctx.faults.check("backward", self._ctx.current_step)
        return self._ctx.faults.corrupt(grad, self.module)  # nan/bitflip drills

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._ctx.faults.check("forward", self._ctx.current_step)
        tracing = self._ctx.tracing
        if not tracing.active:
            return self.current()(*args, **kwargs)
        with tracing.forward():
            return self.current()(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Any:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def train(self, mode: bool = True) -> GenerationalDDP:
        self.module.train(mode)
        return self

    def eval(self) -> GenerationalDDP:
        self.module.eval()
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _DDP_ATTRIBUTES:
            return getattr(self.current(), name)
        return getattr(self.module, name)
