"""Invariant mode: a job defined by V virtual ranks, whatever the number of physical ones.

A job that declares ``V`` virtual ranks (``undying run --virtual-ranks V``, or
``job.steps(..., virtual_ranks=V)``) is the job of ``V`` data-parallel ranks,
run on however many physical ranks it has at each moment. Each virtual rank
``v`` is what physical rank ``v`` of a ``V``-rank job is today:

- its slice of every global batch comes from its own loader, built by the
  script's factory ``State(loader=lambda v, V: ...)`` (e.g. a
  ``DistributedSampler(num_replicas=V, rank=v)``), positioned by the step
  exactly as a physical rank's (``worker.data``, seeded with ``v``);
- its random stream is ``rng.reseed(seed, v, "body", step)``, reset before its
  micro-step, as a physical rank's is before its step (``worker.rng``).

A physical rank runs its virtual ranks (a contiguous block, ``layout``) one
after the other inside the step (``for v in step.virtual_ranks():``), and
keeps each one's gradient apart. The reduction is then undying's own, not
DDP's reducer: the per-virtual-rank gradient buffers (flattened) go, slice by
slice, to the rank that owns that slice of the parameters (an all-to-all);
each rank folds its slice left to right over ``v = 0 .. V-1`` and divides by
``V``, and an all-gather hands every rank the whole result. Element by
element the additions happen in the same order on every rank and for every
physical layout, so the gradient, the optimizer step and the next loss are
bit-identical on 1, 2, 3 or 4 physical ranks, and across a shrink or a grow.
The price: about ``V/N + 1`` gradients' worth of traffic per rank instead of
a ring all-reduce's 2, no overlap with backward, and the micro-steps' smaller
batches (see docs/elastic.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from undying.errors import UsageError
from undying.protocol.env import VIRTUAL_RANKS_ENV
from undying.worker import rng
from undying.worker.data import DataCursor

if TYPE_CHECKING:
    from undying.worker.context import JobContext
    from undying.worker.state import State
    from undying.worker.step import Step

__all__ = [
    "virtual_ranks_from_env", "invariant_mode", "layout", "VirtualRank", "VirtualRanks", "fold",
    "fold_across",
]


def virtual_ranks_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The ``V`` that ``undying run --virtual-ranks V`` passed, or None (the job did not opt in)."""
    raw = (os.environ if env is None else env).get(VIRTUAL_RANKS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{VIRTUAL_RANKS_ENV}={raw!r} is not a number of virtual ranks: give a "
                         "whole number >= 1 (undying run --virtual-ranks V)")
    return value


def layout(virtual: int, world_size: int) -> list[range]:
    """The virtual ranks each physical rank runs: contiguous blocks, the first ``V % N`` ranks
    one more.

    4 over 3 ranks: [0, 1], [2], [3]. The order inside a block is the order
    of the micro-steps; the reduction's order does not depend on it.
    """
    if virtual < 1 or world_size < 1:
        raise UsageError(f"a layout needs virtual ranks >= 1 and ranks >= 1, got {virtual} and "
                         f"{world_size}")
    if world_size > virtual:
        raise UsageError(f"{world_size} ranks for {virtual} virtual ranks: each rank needs at "
                         f"least one virtual rank; run on at most {virtual} ranks or raise "
                         "--virtual-ranks")
    base, extra = divmod(virtual, world_size)
    blocks, start = [], 0
    for r in range(world_size):
        count = base + (1 if r < extra else 0)
        blocks.append(range(start, start + count))
        start += count
    return blocks


def fold(buffers: list[torch.Tensor]) -> torch.Tensor:
    """The mean of ``buffers`` summed strictly left to right (index 0 first): the one order
    every layout uses."""
    total = buffers[0].clone()
    for buffer in buffers[1:]:
        total.add_(buffer)
    return total.div_(len(buffers))


def fold_across(buffers: list[torch.Tensor], virtual: int, world_size: int) -> torch.Tensor:
    """The mean of all ``virtual`` ranks' buffers, folded in virtual-rank order; ``buffers``
    are this rank's block.

    An all-to-all sends each rank its slice of every virtual rank's buffer; it
    folds them in virtual-rank order (element by element the same sums as
    folding the whole buffers on one rank), and an all-gather hands the folded
    slices to everyone. Each rank moves about ``V/N + 1`` buffers of data
    instead of the ``V`` an all-gather of whole buffers would.
    """
    if world_size == 1:
        return fold(buffers)
    blocks = layout(virtual, world_size)
    widest = max(len(b) for b in blocks)
    length = buffers[0].numel()
    # on the gradients' device (NCCL needs CUDA tensors)
    dtype, device = buffers[0].dtype, buffers[0].device
    chunk = -(-length // world_size)
    local = torch.zeros(widest, world_size * chunk, dtype=dtype, device=device)
    for i, buffer in enumerate(buffers):
        local[i, :length].copy_(buffer)
    # [rank it goes to, virtual rank of mine, slice]: rank j gets its slice of each of my buffers.
    sent = local.view(widest, world_size, chunk).transpose(0, 1).contiguous()
    received = torch.empty_like(sent)  # [rank it came from, its virtual rank, my slice]
    dist.all_to_all_single(received, sent)
    folded = fold([received[r, i] for r, block in enumerate(blocks) for i in range(len(block))])
    slices = [torch.empty(chunk, dtype=dtype, device=device) for _ in range(world_size)]
    dist.all_gather(slices, folded)
    return torch.cat(slices)[:length]


class VirtualRank:
    """One virtual rank's micro-step: its number, its batch, and what it logs (averaged over all
    ``V``)."""

    def __init__(self, index: int, batch: Any) -> None:
        self.index = index
        self.batch = batch
        self.metrics: dict[str, float] = {}

    def log(self, **metrics: float | torch.Tensor) -> None:
        """Values of this virtual rank (``loss=loss``); the step logs their mean over the ``V``
        virtual ranks, folded in virtual-rank order, the same on every physical rank."""
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise UsageError(f"virtual rank {self.index}: log({name}=...) got a tensor of "
                                     f"shape {tuple(value.shape)}; log one number")
                value = value.detach().item()
            self.metrics[name] = float(value)

    def __repr__(self) -> str:
        return f"VirtualRank({self.index})"


class VirtualRanks:
    """The job's virtual ranks: per-virtual-rank data cursors, the micro-steps and the
    fixed-order reduction."""

    def __init__(self, ctx: JobContext, state: State, count: int, *, seed: int, total: int | None,
                 epochs: int | None) -> None:
        if state.sharded:
            raise UsageError("--virtual-ranks works with a replicated model (DDP), not a sharded "
                             "one (FSDP, DTensors): drop --virtual-ranks or the sharding")
        if state.model is None:
            raise UsageError("invariant mode (--virtual-ranks) needs State(model=...): undying "
                             "reduces its gradients")
        factory = state.loader
        if factory is not None and (not callable(factory) or hasattr(factory, "__iter__")):
            raise UsageError(
                f"with --virtual-ranks {count}, State(loader=...) takes a function "
                f"(virtual_rank, virtual_ranks) -> loader, e.g. lambda v, V: DataLoader(ds, "
                f"sampler=DistributedSampler(ds, V, v)), not a {type(factory).__name__}: each "
                f"virtual rank reads its own slice")
        self.count = count
        self._ctx = ctx
        self._seed = seed
        self._total = total
        self._epochs = epochs
        self._factory: Callable[[int, int], Any] | None = factory
        self._cursors: dict[int, DataCursor] = {}
        self.params = [p for p in state.model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        self._dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        # The job's cursor: virtual rank 0's loader (every virtual rank has the same number of
        # batches per epoch, whatever the physical layout), so positions, epochs and the end never
        # depend on the layout.
        self.cursor = self._cursor(0, ctx.data_origin)

    def _cursor(self, v: int, origin: tuple[int, int] | None) -> DataCursor:
        loader = self._factory(v, self.count) if self._factory is not None else None
        return DataCursor(loader, rank=v, seed=self._seed, total=self._total,
                          epochs=self._epochs, origin=origin)

    def batch_for(self, v: int, index: int) -> Any:
        cursor = self._cursors.get(v)
        if cursor is None:
            cursor = self._cursors[v] = (self.cursor if v == 0
                                         else self._cursor(v, self.cursor.origin))
        if cursor.origin != self.cursor.origin:  # a resume moved the job's data position
            cursor.set_origin(self.cursor.origin)
        batch = cursor.batch_for(index)
        cursor.forget_through(index - 1)
        return batch

    def micro_steps(self, step: Step) -> Iterator[VirtualRank]:
        """This rank's virtual ranks for ``step``, each with its batch and its random stream;
        then the reduction."""
        ctx = self._ctx
        mine = layout(self.count, ctx.world_size)[ctx.rank]
        buffers: list[torch.Tensor] = []
        names: list[str] | None = None
        self._clear_grads()
        for v in mine:
            batch = self.batch_for(v, step.index)
            rng.reseed(self._seed, v, "body", step.index)
            micro = VirtualRank(v, batch)
            yield micro
            if names is None:
                names = sorted(micro.metrics)
            elif sorted(micro.metrics) != names:
                raise UsageError(f"step {step.index}: virtual rank {v} logged "
                                 f"{sorted(micro.metrics)}, virtual rank {mine[0]} logged "
                                 f"{names}: every virtual rank logs the same names")
            buffers.append(self._take_grads(micro, names))
        world = ctx.world_size if dist.is_initialized() else 1
        # A comm marker, as DDP's all-reduce gets one (`undying trace on --comm`): slow-rank
        # diagnosis sees it.
        size = buffers[0].numel() * buffers[0].element_size()
        with ctx.tracing.tracer.span("comm", name="ordered_fold", bytes=size):
            mean = fold_across(buffers, self.count, world)
        self._put_grads(mean)
        assert names is not None
        offset = mean.numel() - len(names)
        step.log(**{name: float(mean[offset + i].item()) for i, name in enumerate(names)})

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _take_grads(self, micro: VirtualRank, names: list[str]) -> torch.Tensor:
        """One virtual rank's gradients (and logged values) as one flat buffer; the live
        gradients cleared."""
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p))
                 .reshape(-1).to(self._dtype)
                 for p in self.params]
        device = self.params[0].device if self.params else None
        values = [micro.metrics[n] for n in names]
        parts.append(torch.tensor(values, dtype=self._dtype, device=device))
        self._clear_grads()
        return torch.cat(parts)

    def _put_grads(self, mean: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = mean[offset:offset + n].view_as(p).to(p.dtype).clone()
            offset += n


def invariant_mode(ctx: JobContext, state: State, virtual_ranks: int | None, *, seed: int,
                   total: int | None, epochs: int | None) -> VirtualRanks | None:
    """The job's virtual ranks when it opted in (``job.steps(virtual_ranks=V)`` or
    ``--virtual-ranks V``), else None."""
    from_env = virtual_ranks_from_env()
    if virtual_ranks is not None:
        if (isinstance(virtual_ranks, bool) or not isinstance(virtual_ranks, int)
                or virtual_ranks < 1):
            raise UsageError(f"job.steps(virtual_ranks={virtual_ranks!r}): give a whole number "
                             ">= 1")
        if from_env is not None and from_env != virtual_ranks:
            raise UsageError(f"job.steps(virtual_ranks={virtual_ranks}) but undying run "
                             f"--virtual-ranks {from_env}: the job has one number of virtual "
                             "ranks; give the same or only one of them")
    count = virtual_ranks if virtual_ranks is not None else from_env
    if count is None:
        return None
    # refused now, by name, if there are more ranks than virtual ranks
    layout(count, ctx.world_size)
    return VirtualRanks(ctx, state, count, seed=seed, total=total, epochs=epochs)
