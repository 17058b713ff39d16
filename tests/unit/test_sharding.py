"""Sharded state in one process: a real FSDP2 model on a one-rank gloo group (DTensor parameters).

What a shard serializes to must load back bit for bit; FSDP must keep
training after undying rebuilds the default group (a new generation) and after
a step that failed midway. The multi-rank paths run in
tests/integration/test_checkpoint_sharded.py.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from undying.checkpoint.sharded import load_sharded, save_sharded
from undying.errors import UsageError
from undying.worker import dtensor, sharding
from undying.worker.state import State

fsdp = pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _init_group() -> dist.TCPStore:
    dist.distributed_c10d._world.group_count = 0  # as undying's generations do: the default group is "0" again
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0, world_size=1)
    return store


@pytest.fixture
def group() -> Iterator[None]:
    assert not dist.is_initialized()
    store = _init_group()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        del store


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, State]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2]):
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    counters = {"seen": 0}
    return model, optimizer, State(model=model, optimizer=optimizer, scheduler=scheduler, counters=counters)


def train(model: nn.Module, state: State, steps: range) -> list[float]:
    losses = []
    assert state.optimizer is not None and state.scheduler is not None
    for i in steps:
        torch.manual_seed(100 + i)
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.extras["counters"]["seen"] += 1
        losses.append(loss.item())
    return losses


def test_a_dtensor_model_is_sharded_state(group: None) -> None:
    model, _, state = build()
    assert state.sharded and dtensor.has_dtensors(model)
    assert not State(model=nn.Linear(2, 2)).sharded
    assert State(model=nn.Linear(2, 2), sharded=True).sharded
    with pytest.raises(UsageError, match="sharded=False"):
        State(model=model, sharded=False)
    assert len(state.digest()) == 64  # per-rank digest of local slices, no collective


def test_a_shard_loads_back_bit_for_bit_into_a_fresh_model(group: None) -> None:
    model, _, state = build()
    train(model, state, range(3))
    data = sharding.shard_bytes(state, {"data_origin": (3, 3)})
    expected = train(model, state, range(3, 6))
    digest = state.digest()

    fresh, _, fresh_state = build(seed=99)  # other weights, an optimizer with no state yet
    extra = sharding.load_shard_bytes(fresh_state, data)
    assert extra == {"data_origin": (3, 3)}
    assert fresh_state.extras["counters"] == {"seen": 3}
    assert train(fresh, fresh_state, range(3, 6)) == expected
    assert fresh_state.digest() == digest


def test_a_shard_of_another_layout_is_refused(group: None) -> None:
    _, _, state = build()
    other = State(model=nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3)))
    with pytest.raises(Exception, match="local shape|lacks model entries"):
        sharding.load_shard_bytes(state, sharding.shard_bytes(other))


def test_the_dcp_view_is_keyed_by_name_and_round_trips_through_a_sharded_checkpoint(
    group: None, tmp_path: Path
) -> None:
    model, _, state = build()
    train(model, state, range(2))
    sd = sharding.dcp_state_dict(state)
    assert sorted(sd) == ["extras", "model", "optimizer", "scheduler"]
    assert "0.weight" in sd["model"] and "0.weight" in sd["optimizer"]["state"]
    digest = sharding.full_digest(sd)
    result = save_sharded(tmp_path, 2, sd)
    expected = train(model, state, range(2, 4))

    fresh, _, fresh_state = build(seed=7)
    target = sharding.dcp_state_dict(fresh_state)
    assert sharding.full_digest(target) != digest
    load_sharded(result.path, target)
    sharding.load_dcp_state_dict(fresh_state, target)
    assert sharding.full_digest(sharding.dcp_state_dict(fresh_state)) == digest
    assert fresh_state.extras["counters"] == {"seen": 2}
    assert train(fresh, fresh_state, range(2, 4)) == expected


def test_fsdp_trains_on_after_a_new_generation_and_a_failed_forward(group: None) -> None:
    model, _, state = build()
    reference, _, reference_state = build()
    train(model, state, range(2))
    train(reference, reference_state, range(2))

    model(torch.randn(4, 6))  # a step that failed after its forward: parameters gathered, hooks half-run
    sharding.reset_after_failure(model)
    state.discard_gradients()
    dist.destroy_process_group()
    store = _init_group()  # the next generation's group, under the same name
    assert sharding.rebind_groups(model) > 0
    assert train(model, state, range(2, 5)) == train(reference, reference_state, range(2, 5))
    del store


def test_a_staged_copy_for_the_background_writer_is_private_and_still_sharded(group: None) -> None:
    from undying.worker.shard_saves import stage

    model, _, state = build()
    train(model, state, range(1))
    sd = sharding.dcp_state_dict(state)
    staged = stage(sd)
    weight, copy = sd["model"]["0.weight"], staged["model"]["0.weight"]
    assert dtensor.is_dtensor(copy) and copy.placements == weight.placements and copy.shape == weight.shape
    assert torch.equal(copy.to_local(), weight.to_local())
    assert copy.to_local().data_ptr() != weight.to_local().data_ptr()
    before = copy.to_local().clone()
    train(model, state, range(1, 2))  # training goes on while the writer holds its copy
    assert torch.equal(copy.to_local(), before) and not torch.equal(weight.to_local(), before)
    assert staged["scheduler"] == sd["scheduler"] and staged["scheduler"] is not sd["scheduler"]
