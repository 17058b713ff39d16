"""A DistributedDataParallel that follows the job's process-group generations.

DDP binds to one process group for life. After a recovery the group is a new
one, so the wrapper builds a fresh DDP around the same module (same parameter
tensors, so the user's optimizer stays valid) at its first forward in the new
generation: every rank reaches that point in the same step, which is what
DDP's constructor, a collective, requires.

To the script it is a DDP: ``isinstance(ddp, DistributedDataParallel)``
holds, ``ddp.module`` is the model, ``state_dict`` and ``named_parameters``
carry DDP's ``module.`` prefix, ``no_sync()`` and
``require_backward_grad_sync = False`` skip the gradient all-reduce (gradient
accumulation), and every other DDP method and attribute is the live DDP's.
What the script sets or registers (the sync switch, a comm hook, a static
graph) is carried to each DDP the wrapper builds.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from undying.worker.context import JobContext
from undying.worker.tracing import CommHookState, traced_allreduce_hook

__all__ = ["GenerationalDDP"]

log = logging.getLogger("undying.worker")

# DDP's instance attributes, asked of the live DDP (building it, a collective, if there is none
# yet).
_DDP_STATE = frozenset({
    "process_group", "device_ids", "device_type", "device", "output_device", "dim", "reducer",
    "logger", "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
    "bucket_bytes_cap", "mixed_precision",
    "parameters_to_ignore", "device_mesh", "is_multi_device_module", "require_forward_param_sync",
    "broadcast_bucket_size", "use_side_stream_for_tensor_copies", "skip_all_reduce_unused_params",
})
# DDP's methods that register something on the live DDP: replayed on every DDP built after.
_REPLAYED = frozenset({"register_comm_hook", "_register_builtin_comm_hook", "_register_fused_optim",
                       "_set_static_graph", "_set_ddp_runtime_logging_sample_rate",
                       "_set_ddp_sink_clone", "_register_buffer_comm_hook"})
# DDP's own code that runs on the wrapper itself (it reads only what the wrapper carries).
_OWN = frozenset({"no_sync", "forward", "train"})


class GenerationalDDP(DistributedDataParallel):
    """A DDP to the script, rebuilt around the same module on every new process-group generation."""

    # Set by job.steps in invariant mode: forward is the module's, gradients reduced by undying.
    invariant = False

    def __init__(self, ctx: JobContext, module: torch.nn.Module, **ddp_kwargs: Any) -> None:
        torch.nn.Module.__init__(self)  # not DDP's: that one binds a group, which the live DDP does
        self.module = module
        self._ctx = ctx
        self._ddp_kwargs = ddp_kwargs
        self._sync = True
        self._registered: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        first = next(module.parameters(), None)
        if first is not None and first.requires_grad:
            # Computed last in backward, while the other gradients' all-reduce runs.
            first.register_hook(self._in_backward)
        object.__setattr__(self, "_ddp", None)  # not a submodule: its state is the module's
        self._generation = -1
        self._hooked = False  # whether the live DDP carries the comm-marker hook

    @property
    def require_backward_grad_sync(self) -> bool:
        """False: backward accumulates gradients without all-reducing them (what ``no_sync()``
        sets)."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.__dict__["_sync"] = bool(value)
        live = self.__dict__.get("_ddp")
        if live is not None:
            live.require_backward_grad_sync = bool(value)

    def invalidate(self) -> None:
        """Drop the DDP bound to a group that is going away."""
        object.__setattr__(self, "_ddp", None)
        self._generation = -1

    def current(self) -> torch.nn.Module:
        """The live DDP of this generation (built now if needed: a collective), or the module
        alone on one rank."""
        if self.invariant or not dist.is_initialized() or dist.get_world_size() == 1:
            return self.module  # invariant mode reduces itself (worker.virtual): no DDP, no reducer
        ctx = self._ctx
        hooked = ctx.tracing.comm_hook_at(ctx.current_step) and not self._has_comm_hook()
        ddp: DistributedDataParallel | None = self.__dict__["_ddp"]
        if ddp is None or self._generation != ctx.generation or self._hooked != hooked:
            ddp = DistributedDataParallel(self.module, **self._ddp_kwargs)
            # DDP regroups its gradient buckets after its first iteration, in
            # the order gradients became ready. A DDP rebuilt after a fault
            # would run one iteration in the first grouping while the
            # fault-free run used the second, and the all-reduce would sum in
            # another order: the same numbers, other last bits. Asking for the
            # regrouping now, in parameter order, gives every DDP this wrapper
            # builds one and the same layout from its first iteration on.
            ddp.reducer._push_all_rebuilt_params()
            for name, args, kwargs in self._registered:
                getattr(ddp, name)(*args, **kwargs)
            if hooked:
                # Comm markers: DDP's own all-reduce, done by a hook that times it (no bit changes).
                # A DDP takes a hook only before its first step, so switching comm rebuilds it,
                # on every rank at the same step (see TraceSet.comm_from_step).
                ddp.register_comm_hook(
                    CommHookState(ctx.tracing, ddp.process_group,
                                  dist.get_world_size(ddp.process_group)),
                    traced_allreduce_hook,
                )
            object.__setattr__(self, "_ddp", ddp)
            self._generation = ctx.generation
            self._hooked = hooked
        ddp.require_backward_grad_sync = self._sync
        ddp.training = self.training
        return ddp

    def _has_comm_hook(self) -> bool:
        return any(name in ("register_comm_hook", "_register_builtin_comm_hook")
                   for name, _, _ in self._registered)

    def _in_backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        self._ctx.faults.check("backward", self._ctx.current_step)
        return self._ctx.faults.corrupt(grad, self.module)  # nan/bitflip drills

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.current()(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._ctx.faults.check("forward", self._ctx.current_step)
        tracing = self._ctx.tracing
        if not tracing.active:
            return self.current()(*args, **kwargs)
        with tracing.forward():
            return self.current()(*args, **kwargs)

    def train(self, mode: bool = True) -> GenerationalDDP:
        torch.nn.Module.train(self, mode)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (``module``)
        except AttributeError:
            pass
        if name.startswith("__") or "_modules" not in self.__dict__:
            raise AttributeError(name)
        live = self.__dict__.get("_ddp")
        if name in _DDP_STATE or (live is not None and name in vars(live)):
            return getattr(self.current(), name)
        # Not a DDP's: the module's own attributes stay reachable, as through this wrapper before.
        return getattr(self.__dict__["_modules"]["module"], name)


def _on_live(name: str) -> Callable[..., Any]:
    """DDP's method ``name``, called on the live DDP (and remembered for the next ones when it
    registers)."""
    method = getattr(DistributedDataParallel, name)

    @functools.wraps(method)
    def call(self: GenerationalDDP, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.current(), name)(*args, **kwargs)
        if name in _REPLAYED:
            self._registered.append((name, args, kwargs))
        return result

    return call


def _live_property(name: str) -> property:
    return property(lambda self: getattr(self.current(), name), doc=f"The live DDP's ``{name}``.")


for _name, _attr in list(vars(DistributedDataParallel).items()):
    if _name.startswith("__") or _name in _OWN:
        continue
    if inspect.isfunction(_attr):
        setattr(GenerationalDDP, _name, _on_live(_name))
    elif isinstance(_attr, property):
        setattr(GenerationalDDP, _name, _live_property(_name))
