"""undying.State: what a rank needs to continue, moved by state_dict."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from undying.errors import UsageError
from undying.worker.state import State


@pytest.fixture(scope="module", autouse=True)
def _warm_optimizer() -> None:
    """The first optimizer.step() of a process imports torch._dynamo (seconds); pay it once, outside the tests."""
    model, optimizer, scheduler = _build(0)
    _train_step(model, optimizer, scheduler, seed=0)


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_round_trip_makes_two_ranks_identical() -> None:
    m1, o1, s1 = _build(0)
    m2, o2, s2 = _build(1)
    extras1: dict[str, Any] = {"epoch": 3, "best": 0.25}
    extras2: dict[str, Any] = {"epoch": 0, "stale": True}
    c1, c2 = Counter(), Counter()
    c1.n = 7
    donor = State(m1, o1, s1, meta=extras1, counter=c1)
    receiver = State(m2, o2, s2, meta=extras2, counter=c2)
    assert donor.digest() != receiver.digest()
    _train_step(m1, o1, s1, seed=1)  # the donor has momentum buffers and a decayed lr
    before = donor.digest()

    receiver.load_state_dict(donor.state_dict())

    assert receiver.digest() == donor.digest() == before
    assert _params_equal(m1, m2)
    assert torch.equal(o1.state[next(iter(m1.parameters()))]["momentum_buffer"],
                       o2.state[next(iter(m2.parameters()))]["momentum_buffer"])
    assert s2.last_epoch == s1.last_epoch == 1
    assert o2.param_groups[0]["lr"] == o1.param_groups[0]["lr"] == pytest.approx(0.05)
    # The user's dict is the same object, with the donor's content.
    assert receiver.extras["meta"] is extras2
    assert extras2 == {"epoch": 3, "best": 0.25}
    assert c2.n == 7


def test_after_a_transfer_the_ranks_go_on_bit_for_bit() -> None:
    # Serialized as send_state/recv_state move it. (Loaded in memory without
    # serializing, torch's optimizer.load_state_dict would share the donor's
    # momentum buffers, so the two could not be stepped independently.)
    m1, o1, s1 = _build(0)
    _train_step(m1, o1, s1, seed=1)
    donor = State(m1, o1, s1, meta={"k": 1})
    buffer = io.BytesIO()
    torch.save(donor.state_dict(), buffer)
    m2, o2, s2 = _build(5)
    receiver = State(m2, o2, s2, meta={})
    receiver.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    assert receiver.digest() == donor.digest()
    assert receiver.extras["meta"] == {"k": 1}
    for seed in (2, 3, 4):
        _train_step(m1, o1, s1, seed)
        _train_step(m2, o2, s2, seed)
        assert _params_equal(m1, m2)
        assert donor.digest() == receiver.digest()
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"] == pytest.approx(0.1 / 16)


def test_digest_sees_every_parameter_and_the_momentum() -> None:
    model, optimizer, scheduler = _build(0)
    state = State(model, optimizer, scheduler)
    d0 = state.digest()
    assert d0 == state.digest()
    with torch.no_grad():
        last = list(model.parameters())[-1]
        last.view(-1)[0] = torch.nextafter(last.view(-1)[0], torch.tensor(float("inf")))
    d1 = state.digest()
    assert d1 != d0
    _train_step(model, optimizer, scheduler, seed=1)
    d2 = state.digest()
    buf = optimizer.state[last]["momentum_buffer"]
    buf.view(-1)[0] += 1.0
    assert state.digest() not in (d0, d1, d2)


def test_a_state_without_parts() -> None:
    state = State()
    sd = state.state_dict()
    assert sd == {"model": None, "optimizer": None, "scheduler": None, "extras": {}}
    state.load_state_dict(sd)
    state.discard_gradients()
    assert isinstance(state.digest(), str)


@pytest.mark.parametrize("bad", [3, "text", [1, 2], None])
def test_bad_extras_are_usage_errors(bad: Any) -> None:
    with pytest.raises(UsageError, match="State extra 'counter'"):
        State(counter=bad)


def test_a_module_extra_is_accepted() -> None:
    ema = torch.nn.Linear(2, 2)
    State(ema=ema)


@pytest.mark.parametrize("bad", [object(), {"weight": torch.zeros(1)}, torch.zeros(2)])
def test_model_must_be_a_module(bad: Any) -> None:
    with pytest.raises(UsageError, match="needs a torch.nn.Module"):
        State(model=bad)


def test_discard_gradients() -> None:
    model, optimizer, scheduler = _build(0)
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    State(model, optimizer, scheduler).discard_gradients()
    assert all(p.grad is None for p in model.parameters())
