"""DataCursor: the batch of step s depends on s alone, however the cursor gets there."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

from undying.errors import UsageError
from undying.worker.data import DataCursor

torchdata_loader = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = torchdata_loader.StatefulDataLoader

pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital.*:UserWarning")

N, BATCH = 20, 3  # 7 batches an epoch, the last one short
SPE = 7
EPOCHS = 3
SEED = 11


class NoisyDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A random transform: each read draws from torch's global generator."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i)]), torch.rand(2)


def _tensor_dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1), torch.arange(N) * 10)


Loader = Callable[[], Any]

LOADERS: dict[str, Loader] = {
    "shuffle": lambda: DataLoader(_tensor_dataset(), batch_size=BATCH, shuffle=True),
    "shuffle-noisy": lambda: DataLoader(NoisyDataset(), batch_size=BATCH, shuffle=True),
    "distributed": lambda: DataLoader(
        _tensor_dataset(), batch_size=BATCH, sampler=DistributedSampler(_tensor_dataset(), num_replicas=1, rank=0, seed=3)
    ),
    "stateful-distributed": lambda: StatefulDataLoader(
        NoisyDataset(), batch_size=BATCH, sampler=DistributedSampler(NoisyDataset(), num_replicas=1, rank=0, seed=3)
    ),
    "stateful-sequential": lambda: StatefulDataLoader(NoisyDataset(), batch_size=BATCH),
}

# Loaders whose sampler carries its own torch.Generator from epoch to epoch.
GENERATOR_LOADERS: dict[str, Loader] = {
    "stateful-shuffle": lambda: StatefulDataLoader(_tensor_dataset(), batch_size=BATCH, shuffle=True),
    "shuffle-with-generator": lambda: DataLoader(
        _tensor_dataset(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
    ),
}


def cursor(make: Loader, *, rank: int = 0, seed: int = SEED, outside_seed: int = 0) -> DataCursor:
    # What the process did before building the loader must not matter, except
    # that the user seeds before building it (as the demo does).
    torch.manual_seed(outside_seed)
    return DataCursor(make(), rank=rank, seed=seed, total=None, epochs=EPOCHS)


def sequential(make: Loader, **kw: Any) -> list[Any]:
    """Every step's batch, reached one step after the other as a job without faults does."""
    c = cursor(make, **kw)
    assert c.total_steps == SPE * EPOCHS
    batches = []
    for step in range(1, c.total_steps + 1):
        batches.append(c.batch_for(step))
        c.forget_through(step)
    return batches


def same(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def ids(batches: list[Any]) -> list[list[int]]:
    return [b[0].flatten().int().tolist() for b in batches]


@pytest.fixture(scope="module", params=sorted(LOADERS))
def loader(request: pytest.FixtureRequest) -> tuple[Loader, list[Any]]:
    make = LOADERS[request.param]
    return make, sequential(make)


def test_the_reference_itself_is_a_pass_over_the_data(loader: tuple[Loader, list[Any]]) -> None:
    _, batches = loader
    got = ids(batches)
    for epoch in range(EPOCHS):
        chunk = got[epoch * SPE:(epoch + 1) * SPE]
        assert [len(b) for b in chunk] == [3, 3, 3, 3, 3, 3, 2]
        assert sorted(i for b in chunk for i in b) == list(range(N))


def test_sequential_runs_repeat(loader: tuple[Loader, list[Any]]) -> None:
    make, reference = loader
    again = sequential(make, outside_seed=12345)
    assert all(same(a, b) for a, b in zip(reference, again, strict=True))


@pytest.mark.parametrize("step", [1, 2, 7, 8, 9, 14, 15, 20, 21])
def test_a_replacement_jumps_straight_to_any_step(loader: tuple[Loader, list[Any]], step: int) -> None:
    make, reference = loader
    c = cursor(make, outside_seed=999)
    assert same(c.batch_for(step), reference[step - 1])
    # ... and goes on from there.
    for s in range(step + 1, min(step + SPE + 1, len(reference) + 1)):
        assert same(c.batch_for(s), reference[s - 1]), s


def test_a_cached_step_is_the_same_object(loader: tuple[Loader, list[Any]]) -> None:
    make, reference = loader
    c = cursor(make)
    first = c.batch_for(10)
    assert c.batch_for(10) is first
    assert same(first, reference[9])


def test_rerunning_steps_backwards_and_across_epochs(loader: tuple[Loader, list[Any]]) -> None:
    make, reference = loader
    c = cursor(make)
    order = [1, 2, 3, 2, 5, 4, 4, 7, 8, 6, 13, 12, 15, 14, 21, 1, 20, 9]
    for step in order:
        assert same(c.batch_for(step), reference[step - 1]), step
        if step % 3 == 0:
            c.forget_through(step)  # as after a commit


def test_epochs_are_shuffled_differently_when_shuffled() -> None:
    batches = ids(sequential(LOADERS["shuffle"]))
    epochs = [batches[e * SPE:(e + 1) * SPE] for e in range(EPOCHS)]
    assert epochs[0] != epochs[1] != epochs[2]


def test_the_order_depends_on_seed_and_rank() -> None:
    base = ids(sequential(LOADERS["shuffle"]))
    assert ids(sequential(LOADERS["shuffle"], seed=SEED + 1)) != base
    assert ids(sequential(LOADERS["shuffle"], rank=1)) != base


def test_random_transforms_repeat_on_replay() -> None:
    reference = sequential(LOADERS["shuffle-noisy"])
    c = cursor(LOADERS["shuffle-noisy"])
    for step in (12, 3, 19):
        assert torch.equal(c.batch_for(step)[1], reference[step - 1][1])
    # Each step's noise is its own, not one stream repeated.
    assert not torch.equal(reference[0][1][0], reference[1][1][0])


@pytest.mark.parametrize("name", sorted(GENERATOR_LOADERS))
def test_generator_sampler_replacement_jumps_into_a_later_epoch(name: str) -> None:
    make = GENERATOR_LOADERS[name]
    reference = sequential(make)
    c = cursor(make)  # a fresh process: the same script, the same seeds
    assert same(c.batch_for(2 * SPE + 3), reference[2 * SPE + 2])


@pytest.mark.parametrize("name", sorted(GENERATOR_LOADERS))
def test_generator_sampler_rerun_of_a_forgotten_step(name: str) -> None:
    make = GENERATOR_LOADERS[name]
    reference = sequential(make)
    c = cursor(make)
    for step in range(1, 5):
        assert same(c.batch_for(step), reference[step - 1])
        c.forget_through(step)
    assert same(c.batch_for(3), reference[2])


def test_generator_sampler_within_the_first_epoch_is_fine() -> None:
    for make in GENERATOR_LOADERS.values():
        reference = sequential(make)
        assert same(cursor(make).batch_for(5), reference[4])


# --- sizes and errors -------------------------------------------------------


def _plain() -> DataLoader[Any]:
    return DataLoader(_tensor_dataset(), batch_size=BATCH)


def test_total_steps() -> None:
    assert DataCursor(_plain(), rank=0, seed=0, total=None, epochs=2).total_steps == 14
    assert DataCursor(_plain(), rank=0, seed=0, total=None, epochs=0).total_steps == 0
    assert DataCursor(_plain(), rank=0, seed=0, total=5, epochs=None).total_steps == 5
    assert DataCursor(_plain(), rank=0, seed=0, total=50, epochs=None).total_steps == 50
    assert DataCursor(None, rank=0, seed=0, total=9, epochs=None).total_steps == 9
    drop = DataLoader(_tensor_dataset(), batch_size=BATCH, drop_last=True)
    assert DataCursor(drop, rank=0, seed=0, total=None, epochs=2).total_steps == 12


def test_total_beyond_one_epoch_wraps_into_the_next() -> None:
    c = DataCursor(_plain(), rank=0, seed=0, total=10, epochs=None)
    assert c.epoch_of(7) == 0 and c.epoch_of(8) == 1 and c.epoch_of(10) == 1
    assert c.batch_for(8)[0].flatten().int().tolist() == [0, 1, 2]


def test_without_a_loader_there_is_no_batch() -> None:
    c = DataCursor(None, rank=0, seed=0, total=3, epochs=None)
    assert c.batch_for(1) is None
    assert c.epoch_of(3) == 0


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


class _Liar:
    """Says it has 5 batches and yields 3."""

    def __len__(self) -> int:
        return 5

    def __iter__(self) -> Iterator[int]:
        return iter([1, 2, 3])


@pytest.mark.parametrize(
    ("loader", "total", "epochs", "words"),
    [
        (None, 5, 2, "exactly one of total=N or epochs=N"),
        (None, None, None, "exactly one of total=N or epochs=N"),
        (None, -1, None, ">= 0"),
        ("plain", None, -1, ">= 0"),
        (None, None, 2, "needs State(loader=...)"),
        ("stream", None, 1, "has no length"),
        ("stream", 5, None, "has no length"),
        ("empty", None, 1, "yields no batches"),
        ("empty", 3, None, "yields no batches"),
    ],
)
def test_usage_errors(loader: str | None, total: int | None, epochs: int | None, words: str) -> None:
    made = {
        None: None,
        "plain": _plain(),
        "stream": DataLoader(_Stream(), batch_size=2),
        "empty": DataLoader(TensorDataset(torch.zeros(0, 1)), batch_size=2),
    }[loader]
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        DataCursor(made, rank=0, seed=0, total=total, epochs=epochs)


def test_a_loader_shorter_than_its_len_is_a_usage_error() -> None:
    c = DataCursor(_Liar(), rank=0, seed=0, total=None, epochs=1)
    assert c.batch_for(3) == 3
    with pytest.raises(UsageError, match="ended after 3 batches in epoch 0, but len\\(loader\\) is 5"):
        c.batch_for(5)
