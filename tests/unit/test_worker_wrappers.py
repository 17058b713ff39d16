"""What frameworks wrap around the optimizer and the loader, as undying.State takes them (worker.wrappers).

Real accelerate and Lightning objects: their optimizer wrappers are unwrapped, ZeRO's partitioned
optimizer is refused by name with what to pass, and accelerate's prepared loader (a BatchSamplerShard
over a shuffling sampler with its own generator) gives a replacement replaying an epoch the batches
the survivors saw, its random-state synchronisation switched off.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from undying.errors import StateError
from undying.worker.data import DataCursor, epoch_setters
from undying.worker.state import State

accelerate = pytest.importorskip("accelerate")
from accelerate.data_loader import prepare_data_loader  # noqa: E402

SEED = 5


def _optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture
def group() -> Iterator[None]:
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_accelerates_optimizer_wrapper_is_unwrapped() -> None:
    model, inner = _optimizer()
    wrapped = accelerate.Accelerator(cpu=True).prepare(inner)
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    state = State(model=model, optimizer=wrapped)
    assert state.optimizer is inner
    state.optimizer.register_step_pre_hook(lambda *_: None)  # what job.steps does: it works now


def test_lightnings_optimizer_wrapper_is_unwrapped_and_so_is_a_wrapper_of_a_wrapper() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model, inner = _optimizer()
    assert State(model=model, optimizer=LightningOptimizer(inner)).optimizer is inner
    nested = LightningOptimizer(accelerate.Accelerator(cpu=True).prepare(inner))
    assert State(model=model, optimizer=nested).optimizer is inner


def test_zero_redundancy_optimizer_is_refused_with_why_and_what_to_pass(group: None) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.Linear(4, 2)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    with pytest.raises(StateError) as caught:
        State(model=model, optimizer=zero)
    words = str(caught.value)
    assert "ZeroRedundancyOptimizer" in words and "each rank's part" in words
    assert "pass a plain torch optimizer" in words and "\n" not in words


def test_something_that_is_no_optimizer_is_refused_by_name() -> None:
    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def state_dict(self) -> dict[str, Any]:
            return self.optimizer.state_dict()

    model, inner = _optimizer()
    with pytest.raises(StateError, match="got a Wrapper, which is not a working torch.optim.Optimizer"):
        State(model=model, optimizer=Wrapper(inner))


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1))


def _prepared(*, seedable: bool = False, dispatch: bool = False) -> Any:
    torch.manual_seed(SEED)  # as undying.init() seeds every rank alike: the sampler's seed is drawn from it
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True)
    return prepare_data_loader(loader, num_processes=2, process_index=1, put_on_device=dispatch,
                               rng_types=["generator"], use_seedable_sampler=seedable,
                               dispatch_batches=dispatch)


def _batches(cursor: DataCursor, steps: range) -> list[list[float]]:
    return [cursor.batch_for(s)[0].flatten().tolist() for s in steps]


@pytest.mark.parametrize("seedable", [False, True])
def test_a_replacement_replaying_accelerates_loader_sees_the_survivors_batches(seedable: bool) -> None:
    # 5 batches an epoch for each of 2 processes; the survivor reads epochs 0-2 in order, a
    # replacement made anew (the same seed) jumps to step 13 (epoch 2, batch 3) and replays to it
    survivor_state = State(loader=_prepared(seedable=seedable))
    assert not survivor_state.loader.rng_types  # its iterator's collective is switched off
    survivor = DataCursor(survivor_state.loader, rank=1, seed=SEED, total=None, epochs=3)
    assert survivor.steps_per_epoch == 5
    read = _batches(survivor, range(1, 16))
    assert read[5:10] != read[0:5], "the sampler shuffles each epoch anew"
    replacement = DataCursor(State(loader=_prepared(seedable=seedable)).loader, rank=1, seed=SEED,
                             total=None, epochs=3)
    assert _batches(replacement, range(13, 16)) == read[12:15]
    again = DataCursor(State(loader=_prepared(seedable=seedable)).loader, rank=1, seed=SEED,
                       total=None, epochs=3)
    assert _batches(again, range(7, 9)) == read[6:8]


def test_accelerates_dispatching_loader_is_refused_with_the_setting_to_change() -> None:
    with pytest.raises(StateError, match=r"dispatch_batches=False"):
        State(loader=_prepared(dispatch=True))


class _Epochs:
    """A link of a sampler chain that remembers the epochs it was given."""

    def __init__(self, inner: Any = None, link: str = "sampler") -> None:
        self.epochs: list[int] = []
        if inner is not None:
            setattr(self, link, inner)

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_every_set_epoch_of_a_chain_nested_to_any_depth_is_called_the_loaders_own_first() -> None:
    deepest = _Epochs()
    chain = _Epochs(_Epochs(_Epochs(_Epochs(deepest), link="batch_sampler")), link="batch_sampler")
    loader = _Epochs(chain, link="batch_sampler")
    found = epoch_setters(loader)
    assert found[0] is loader and found[-1] is deepest and len(found) == 6
    looped = _Epochs()
    looped.sampler = looped  # a chain that points back at itself ends
    assert epoch_setters(looped) == [looped]


class _Broadcasting:
    """A loader whose iterator runs a collective when it starts (as accelerate's synchronises random states)."""

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Iterator[torch.Tensor]:
        dist.broadcast(torch.zeros(1), src=0)
        yield from (torch.tensor([float(i)]) for i in range(3))


def test_a_loader_that_runs_a_collective_is_refused_at_its_first_batch_by_what_it_did(group: None) -> None:
    cursor = DataCursor(_Broadcasting(), rank=0, seed=SEED, total=None, epochs=1)
    with pytest.raises(StateError) as caught:
        cursor.batch_for(1)
    words = str(caught.value)
    assert "ran 1 collective(s) when it read batch 0 of epoch 0" in words and "runs no collective" in words
    quiet = DataCursor(DataLoader(_dataset(), batch_size=8), rank=0, seed=SEED, total=None, epochs=1)
    assert quiet.batch_for(2)[0].shape == (8, 1), "a loader without collectives reads on"
