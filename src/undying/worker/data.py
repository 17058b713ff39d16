"""The data position, derived from the step number.

Step ``s`` (1-based) reads batch ``(s-1) % steps_per_epoch`` of epoch
``(s-1) // steps_per_epoch``. Before each fetch the random state is reset from
the step (see ``rng``), so re-reading a batch gives the same batch: a rank that
must re-run a step re-uses the batch it holds, and a replacement rank replays
the epoch's iterator to that position. Replay fetches the skipped batches (it
is exact for any loader, worker processes and random transforms included);
its cost is one epoch's prefix of data loading, paid only by replacements.
Because a replacement replays alone, a loader that runs a collective while it
is read is refused at its first batch. Each epoch the loader's own
``set_epoch`` and every ``set_epoch`` along its sampler chain are called and the
chain's generators reset from their seeds (``sampler_chain``), so the replay
draws the order the first pass drew.

A job resumed on another number of ranks has another number of batches per
epoch. Its data position is then carried over by *origin*: the resumed step
and how many batches of the new size cover what the old run had read
(``map_position``); the step numbers go on from the checkpoint's (the
scheduler and the log count optimizer steps) while the data continues where
the saved run left it.
"""

from __future__ import annotations

from typing import Any

import torch

from undying.errors import StateError, UsageError
from undying.worker import rng
from undying.worker.group import collectives_entered

__all__ = ["DataCursor", "epoch_setters", "map_position", "sampler_chain"]


def map_position(position: int, old_steps_per_epoch: int, new_steps_per_epoch: int) -> int:
    """Batches read per rank after ``position`` batches of another world size, at the same point
    of the data.

    Whole epochs stay whole; within an epoch the fraction read is kept,
    rounded down (a few samples are read again rather than skipped). Exact
    for a ``DistributedSampler`` when the world sizes divide each other: 4
    ranks after 5 batches have read the first 20 batches' worth of the
    epoch's order, which 2 ranks reach after 10.
    """
    if old_steps_per_epoch <= 0 or new_steps_per_epoch <= 0:
        raise UsageError(f"steps per epoch must be > 0, "
                         f"got {old_steps_per_epoch} and {new_steps_per_epoch}")
    epoch, within = divmod(position, old_steps_per_epoch)
    return epoch * new_steps_per_epoch + within * new_steps_per_epoch // old_steps_per_epoch


class DataCursor:
    def __init__(
        self,
        loader: Any,
        *,
        rank: int,
        seed: int,
        total: int | None,
        epochs: int | None,
        origin: tuple[int, int] | None = None,
    ) -> None:
        if (total is None) == (epochs is None):
            raise UsageError("job.steps() needs exactly one of total=N or epochs=N")
        if (total is not None and total < 0) or (epochs is not None and epochs < 0):
            raise UsageError(f"job.steps(): total and epochs must be >= 0, "
                             f"got total={total} epochs={epochs}")
        self._loader = loader
        self._rank = rank
        self._seed = seed
        # (step, batches read per rank after it): step s reads batch number origin[1] + s -
        # origin[0].
        self.origin = origin if origin is not None else (0, 0)
        self.steps_per_epoch: int | None = None
        if loader is not None:
            try:
                self.steps_per_epoch = len(loader)
            except TypeError as e:
                raise StateError(
                    "the loader given to State(loader=...) has no length; undying positions "
                    "data by step and needs len(loader) batches per epoch"
                ) from e
            if self.steps_per_epoch == 0:
                raise StateError("the loader given to State(loader=...) yields no batches")
        if epochs is not None and self.steps_per_epoch is None:
            raise UsageError("job.steps(epochs=N) needs State(loader=...); "
                             "use total=N without a loader")
        self._epochs = epochs
        self._total = total
        self.total_steps = 0
        # Samplers that shuffle with a generator of their own advance it every
        # pass; reset it per epoch (from the seed it was created with) so a
        # replayed epoch shuffles exactly as it did the first time.
        self._generators = {
            id(g): (g, g.initial_seed())
            for g in _generators_of(loader)
        }
        self._epoch_setters = epoch_setters(loader)
        self._epoch = -1
        self._iterator: Any = None
        self._next_index = 0
        self._cache: dict[int, Any] = {}
        self.fetched = 0  # batches read so far: progress, for the heartbeat (a replay's too)
        self.set_origin(self.origin)

    def set_origin(self, origin: tuple[int, int]) -> None:
        """The data stands at ``origin``: (step, batches read per rank after it). ``epochs=N``
        ends at the end of epoch N from there; ``total=N`` counts steps, so it ends at step N
        whatever the origin."""
        self.origin = origin
        if self._epochs is not None:
            assert self.steps_per_epoch is not None
            self.total_steps = origin[0] + self._epochs * self.steps_per_epoch - origin[1]
        else:
            assert self._total is not None
            self.total_steps = self._total
        if self._epoch >= 0:
            self._epoch = -1  # positions moved: the next batch starts its epoch's iterator afresh
            self._cache.clear()

    def outline(self, loader: Any) -> dict[str, Any]:
        """The steps as ``undying status`` shows them: how many, per epoch, from where, and the
        batch size of ``loader`` (the script's)."""
        size = getattr(loader, "batch_size", None)
        return {"total_steps": self.total_steps, "steps_per_epoch": self.steps_per_epoch,
                "origin": list(self.origin), "batch_size": size if isinstance(size, int) else None}

    def position(self, step: int) -> int:
        """Batches each rank has read once step ``step`` is done (``step`` itself without an
        origin)."""
        return self.origin[1] + step - self.origin[0]

    def epoch_of(self, step: int) -> int:
        if self.steps_per_epoch is None:
            return 0
        return (self.position(step) - 1) // self.steps_per_epoch

    def batch_for(self, step: int) -> Any:
        if self._loader is None:
            return None
        if step in self._cache:
            return self._cache[step]
        assert self.steps_per_epoch is not None
        epoch, index = divmod(self.position(step) - 1, self.steps_per_epoch)
        if epoch != self._epoch or index < self._next_index:
            self._start_epoch(epoch)
        while self._next_index < index:  # replay to the position
            self._fetch(step - index + self._next_index)
        batch = self._fetch(step)
        self._cache[step] = batch
        return batch

    def forget_through(self, step: int) -> None:
        for cached in [s for s in self._cache if s <= step]:
            del self._cache[cached]

    def _start_epoch(self, epoch: int) -> None:
        rng.reseed(self._seed, self._rank, "epoch", epoch)
        # The loader's own set_epoch first (accelerate's sets its samplers' from it), then every
        # sampler of its chain, so a chain that sets only some of its links still sees the epoch.
        for holder in self._epoch_setters:
            holder.set_epoch(epoch)
        for generator, initial in self._generators.values():
            generator.manual_seed(rng.derived_seed(initial, 0, "sampler", epoch))
        before = collectives_entered()
        self._iterator = iter(self._loader)
        self._no_collective(before, "started its epoch's iterator")
        self._epoch = epoch
        self._next_index = 0
        self._cache.clear()

    def _fetch(self, step: int) -> Any:
        rng.reseed(self._seed, self._rank, "data", step)
        before = collectives_entered()
        try:
            batch = next(self._iterator)
        except StopIteration as e:
            raise UsageError(
                f"the loader ended after {self._next_index} batches in epoch {self._epoch}, "
                f"but len(loader) is {self.steps_per_epoch}"
            ) from e
        self._no_collective(before, f"read batch {self._next_index} of epoch {self._epoch}")
        self._next_index += 1
        self.fetched += 1
        return batch

    def _no_collective(self, before: int, what: str) -> None:
        """A loader that runs a collective cannot be replayed: refused at once, by what it did."""
        after = collectives_entered()
        if before >= 0 and after > before:
            raise StateError(
                f"the loader given to job.state ran {after - before} collective(s) when it {what}: "
                "a replacement replays its loader alone to the step, where a collective would wait "
                "for ranks that never come; give job.state a loader that runs no collective (each "
                "rank reads its data itself; accelerate's prepared loader does, with "
                "dispatch_batches=False)")


# The links of a loader's sampler chain: DataLoader.sampler and .batch_sampler, a batch sampler's
# .sampler and its wrapped .batch_sampler (accelerate's BatchSamplerShard), to any depth.
_LINKS = ("sampler", "batch_sampler", "base_dataloader", "dataset")
_MAX_DEPTH = 16


def sampler_chain(loader: Any) -> list[Any]:
    """The loader and every object reachable from it through its sampler links, each once, the
    loader first (breadth first, at most ``_MAX_DEPTH`` links deep)."""
    if loader is None:
        return []
    seen: dict[int, Any] = {id(loader): loader}
    level = [loader]
    for _ in range(_MAX_DEPTH):
        following = []
        for holder in level:
            for link in _LINKS:
                try:
                    found = getattr(holder, link, None)
                except Exception:  # a property that raises (a dataset without the attribute)
                    continue
                if found is None or id(found) in seen or isinstance(found, str | bytes | int):
                    continue
                seen[id(found)] = found
                following.append(found)
        if not following:
            break
        level = following
    return list(seen.values())


def epoch_setters(loader: Any) -> list[Any]:
    """The links of ``loader``'s chain with a ``set_epoch``, the loader's own first."""
    return [h for h in sampler_chain(loader) if callable(getattr(h, "set_epoch", None))]


def _generators_of(loader: Any) -> list[torch.Generator]:
    """The generators of the chain's links (``generator``, or accelerate's nested
    ``synchronized_generator``), each once."""
    found: dict[int, torch.Generator] = {}
    for holder in sampler_chain(loader):
        for name in ("generator", "synchronized_generator"):
            g = getattr(holder, name, None)
            if isinstance(g, torch.Generator):
                found.setdefault(id(g), g)
    return list(found.values())
