"""A DistributedDataParallel that follows the job's process-group generations.

DDP binds to one process group for life. After a recovery the group is a new
one, so the wrapper builds a fresh DDP around the same module (same parameter
tensors, so the user's optimizer stays valid) at its first forward in the new
generation: every rank reaches that point in the same step, which is what
DDP's constructor, a collective, requires.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.distributed_c10d import _get_default_group
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from undying.worker.job import Job

__all__ = ["GenerationalDDP"]

# Asked of the live DDP; everything else is asked of the module, which exists
# before any group does (a replacement builds its optimizer before it joins).
_DDP_ATTRIBUTES = frozenset({"no_sync", "join", "join_hook", "register_comm_hook", "reducer"})


class GenerationalDDP:
    def __init__(self, job: Job, module: torch.nn.Module, **ddp_kwargs: Any) -> None:
        self.module = module
        self._job = job
        # DDP regroups its gradient buckets after the first iteration, in the
        # order gradients became ready. A DDP rebuilt after a fault would run
        # one iteration with the first layout while the fault-free run used the
        # regrouped one, and the all-reduce would sum in a different order: the
        # same numbers, different last bits. Tracking unused parameters keeps
        # the first layout for good, in every DDP this wrapper builds.
        ddp_kwargs.setdefault("find_unused_parameters", True)
        self._ddp_kwargs = ddp_kwargs
        self._ddp: DistributedDataParallel | None = None
        self._generation = -1

    def invalidate(self) -> None:
        """Drop the DDP bound to a group that is going away."""
        self._ddp = None
        self._generation = -1

    def current(self) -> torch.nn.Module:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.module
        if self._ddp is None or self._generation != self._job.generation:
            self._ddp = DistributedDataParallel(self.module, **self._ddp_kwargs)
            self._ddp.register_comm_hook(self._job, _allreduce_with_faults)
            self._generation = self._job.generation
        return self._ddp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._job._faults.check("forward", self._job.current_step)
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


def _allreduce_with_faults(job, bucket):
    """DDP's own all-reduce, with the fault-injection seam for backward.

    Unannotated on purpose: DDP checks the hook's annotations against the real
    classes, and postponed (string) annotations would fail that check.
    """
    future = default_hooks.allreduce_hook(_get_default_group(), bucket)
    # After launching: a fault here leaves the peers mid-collective.
    job._faults.check("backward", job.current_step)
    return future
