"""The data position, derived from the step number.

Step ``s`` (1-based) reads batch ``(s-1) % steps_per_epoch`` of epoch
``(s-1) // steps_per_epoch``. Before each fetch the random state is reset from
the step (see ``rng``), so re-reading a batch gives the same batch: a rank that
must re-run a step re-uses the batch it holds, and a replacement rank replays
the epoch's iterator to that position. Replay fetches the skipped batches (it
is exact for any loader, worker processes and random transforms included);
its cost is one epoch's prefix of data loading, paid only by replacements.
"""

from __future__ import annotations

from typing import Any

import torch

from undying.errors import UsageError
from undying.worker import rng

__all__ = ["DataCursor"]


class DataCursor:
    def __init__(
        self,
        loader: Any,
        *,
        rank: int,
        seed: int,
        total: int | None,
        epochs: int | None,
    ) -> None:
        if (total is None) == (epochs is None):
            raise UsageError("job.steps() needs exactly one of total=N or epochs=N")
        if (total is not None and total < 0) or (epochs is not None and epochs < 0):
            raise UsageError(f"job.steps(): total and epochs must be >= 0, got total={total} epochs={epochs}")
        self._loader = loader
        self._rank = rank
        self._seed = seed
        self.steps_per_epoch: int | None = None
        if loader is not None:
            try:
                self.steps_per_epoch = len(loader)
            except TypeError as e:
                raise UsageError(
                    "the loader given to State(loader=...) has no length; undying positions "
                    "data by step and needs len(loader) batches per epoch"
                ) from e
            if self.steps_per_epoch == 0:
                raise UsageError("the loader given to State(loader=...) yields no batches")
        if epochs is not None:
            if self.steps_per_epoch is None:
                raise UsageError("job.steps(epochs=N) needs State(loader=...); use total=N without a loader")
            self.total_steps = epochs * self.steps_per_epoch
        else:
            assert total is not None
            self.total_steps = total
        # Samplers that shuffle with a generator of their own advance it every
        # pass; reset it per epoch (from the seed it was created with) so a
        # replayed epoch shuffles exactly as it did the first time.
        self._generators = {
            id(g): (g, g.initial_seed())
            for g in _generators_of(loader)
        }
        self._epoch = -1
        self._iterator: Any = None
        self._next_index = 0
        self._cache: dict[int, Any] = {}

    def epoch_of(self, step: int) -> int:
        if self.steps_per_epoch is None:
            return 0
        return (step - 1) // self.steps_per_epoch

    def batch_for(self, step: int) -> Any:
        if self._loader is None:
            return None
        if step in self._cache:
            return self._cache[step]
        assert self.steps_per_epoch is not None
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        if epoch != self._epoch or index < self._next_index:
            self._start_epoch(epoch)
        while self._next_index < index:  # replay to the position
            self._fetch(epoch * self.steps_per_epoch + self._next_index + 1)
        batch = self._fetch(step)
        self._cache[step] = batch
        return batch

    def forget_through(self, step: int) -> None:
        for cached in [s for s in self._cache if s <= step]:
            del self._cache[cached]

    def _start_epoch(self, epoch: int) -> None:
        rng.reseed(self._seed, self._rank, "epoch", epoch)
        samplers = {
            id(s): s
            for s in (
                getattr(self._loader, "sampler", None),
                getattr(getattr(self._loader, "batch_sampler", None), "sampler", None),
            )
            if s is not None and hasattr(s, "set_epoch")
        }
        for sampler in samplers.values():
            sampler.set_epoch(epoch)
        for generator, initial in self._generators.values():
            generator.manual_seed(rng.derived_seed(initial, 0, "sampler", epoch))
        self._iterator = iter(self._loader)
        self._epoch = epoch
        self._next_index = 0
        self._cache.clear()

    def _fetch(self, step: int) -> Any:
        rng.reseed(self._seed, self._rank, "data", step)
        try:
            batch = next(self._iterator)
        except StopIteration as e:
            raise UsageError(
                f"the loader ended after {self._next_index} batches in epoch {self._epoch}, "
                f"but len(loader) is {self.steps_per_epoch}"
            ) from e
        self._next_index += 1
        return batch


def _generators_of(loader: Any) -> list[torch.Generator]:
    if loader is None:
        return []
    holders = [
        loader,
        getattr(loader, "sampler", None),
        getattr(loader, "batch_sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ]
    return [
        g for g in (getattr(h, "generator", None) for h in holders if h is not None)
        if isinstance(g, torch.Generator)
    ]
