"""Roll back N steps (worker.snapshots, Numerics(on_persistent="rollback")) and ``undying run --numerics``.

One process, the real step loop (an unmanaged job runs the same transaction,
checks and replay as a managed rank); the multi-rank oracle tests are in
tests/integration/test_numerics_policy.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from undying.cli.main import build_parser
from undying.cli.run_config import numerics_env
from undying.errors import UsageError
from undying.protocol.env import NUMERICS_ENV
from undying.worker.job import Job, Outcome
from undying.worker.numerics import Numerics
from undying.worker.snapshots import SnapshotRing
from undying.worker.state import State

STEPS = 10


def _train(numerics: Any, bad: Callable[[int], bool] = lambda step: False,
           skip: frozenset[int] = frozenset()) -> tuple[dict[int, float], dict[str, Any], Any]:
    """STEPS steps of a small seeded model (Adam and a scheduler: state that a roll-back must restore whole)."""
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(80, 4, generator=data), torch.randn(80, 1, generator=data)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    job = Job(None)
    state = job.state(model=model, optimizer=optimizer, scheduler=scheduler,
                      loader=DataLoader(TensorDataset(x, y), batch_size=8))
    losses: dict[int, float] = {}
    guard = None
    for step in job.steps(state, total=STEPS, numerics=numerics):
        guard = job._numerics if guard is None else guard
        with step:
            if step.index in skip:
                continue
            inputs, targets = step.batch
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            if bad(step.index):
                loss = loss * float("nan")  # every run of this step: a persistent fault
            step.log(loss=loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        if step.outcome is Outcome.COMMITTED and step.metrics:
            losses[step.index] = step.metrics["loss"]
    return losses, state.state_dict(), guard


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_equal(p, q) for p, q in zip(a, b, strict=True))
    return bool(a == b)


def test_rollback_goes_back_n_steps_and_the_rest_is_the_run_that_skips_their_batches() -> None:
    twin, twin_state, _ = _train(None, skip=frozenset({5, 6, 7}))
    plain, _, _ = _train(None)
    losses, state, guard = _train(Numerics(on_persistent="rollback", rollback_steps=3), bad=lambda s: s == 7)
    # Steps 5 and 6 committed (the fault-free run's losses), then were undone with step 7's batch.
    assert {s: losses[s] for s in (5, 6)} == {s: plain[s] for s in (5, 6)} and 7 not in losses
    after = {s: v for s, v in losses.items() if s not in (5, 6)}
    assert after == twin and sorted(twin) == [1, 2, 3, 4, 8, 9, 10]
    assert _equal(state, twin_state)  # model, Adam's moments and step counts, the scheduler: bit for bit
    assert guard.ring is not None and guard.ring.indices == [8, 9, 10]  # the undone steps' states were dropped


def test_rollback_goes_back_only_as_far_as_the_ring_holds() -> None:
    twin, twin_state, _ = _train(None, skip=frozenset({1, 2}))
    losses, state, _ = _train(Numerics(on_persistent="rollback", rollback_steps=5), bad=lambda s: s == 2)
    assert {s: v for s, v in losses.items() if s != 1} == twin and _equal(state, twin_state)


def test_the_ring_reuses_its_buffers_and_never_lends_them() -> None:
    model = torch.nn.Linear(3, 2)
    state = State(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ring = SnapshotRing(2)
    for index in (1, 2):
        ring.save(index, state)
        with torch.no_grad():
            model.weight.add_(1)
    buffers = ring._held[1]["model"]["weight"]
    ring.save(3, state)  # the oldest (1) goes, and its buffers hold step 3's pre-state
    assert ring.indices == [2, 3] and ring._held[3]["model"]["weight"] is buffers
    assert ring.nbytes == 2 * (6 + 2) * 4
    before_2 = ring._held[2]["model"]["weight"].clone()
    ring.restore(2, state)
    assert torch.equal(model.weight, before_2) and ring.indices == []
    assert model.weight.data_ptr() != before_2.data_ptr()
    ring.save(2, state)
    with pytest.raises(UsageError, match=r"no snapshot of the state before step 1: the ring holds \[2\]"):
        ring.restore(1, state)
    with pytest.raises(UsageError, match="a snapshot ring holds 1 to 64 states, got 0"):
        SnapshotRing(0)


def test_undying_run_sets_the_default_of_job_steps_through_the_environment() -> None:
    env = {NUMERICS_ENV: "on_persistent=rollback,rollback_steps=3,spike_factor=10.0"}
    expected = Numerics(on_persistent="rollback", rollback_steps=3, spike_factor=10.0)
    assert Numerics.of(None, env) == expected and Numerics.of(True, env) == expected
    assert Numerics.of(False, env) is None  # the script opted out
    own = Numerics(on_persistent="stop")
    assert Numerics.of(own, env) is own
    assert Numerics.of(None, {}) is None and Numerics.of(True, {}) == Numerics()
    with pytest.raises(UsageError, match="rollback_steps must be a whole number from 1 to 64, got 'x'"):
        Numerics.of(None, {NUMERICS_ENV: "on_persistent=skip,rollback_steps=x"})
    with pytest.raises(UsageError, match="'bogus=x' is not one of on_persistent=VALUE"):
        Numerics.of(None, {NUMERICS_ENV: "on_persistent=skip,bogus=x"})
    with pytest.raises(UsageError, match="rollback_steps must be a whole number from 1 to 64, got '0'"):
        Numerics.of(None, {NUMERICS_ENV: "on_persistent=rollback,rollback_steps=0"})


@pytest.mark.parametrize(("argv", "value"), [
    ([], None),
    (["--numerics", "skip"], "on_persistent=skip"),
    (["--numerics", "rollback", "--rollback-steps", "4", "--spike-factor", "8"],
     "on_persistent=rollback,spike_factor=8.0,rollback_steps=4"),
])
def test_the_cli_options_become_the_environment(argv: list[str], value: str | None) -> None:
    args = build_parser().parse_args(["run", *argv, "train.py"])
    assert numerics_env(args) == value
    if value is not None:
        assert Numerics.from_env({NUMERICS_ENV: value}) is not None


@pytest.mark.parametrize(("argv", "message"), [
    (["--spike-factor", "3"], "--spike-factor applies to the numeric checks: add --numerics"),
    (["--numerics", "skip", "--rollback-steps", "2"], "--rollback-steps applies to --numerics rollback, not"),
    (["--numerics", "stop", "--spike-factor", "1"], "--spike-factor must be above 1"),
])
def test_bad_cli_options_are_refused_by_name(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        numerics_env(build_parser().parse_args(["run", *argv, "train.py"]))


def test_a_bad_rollback_count_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--numerics", "rollback", "--rollback-steps", "65", "train.py"])
    assert "'65' is not a number of steps to roll back" in capsys.readouterr().err


# -- skipping is bounded (issue #25 item 7) ----------------------------------------------


@pytest.mark.parametrize(("skipped", "steps_run", "limits", "expected"), [
    (set(), 32, {}, None),
    ({5, 37}, 64, {}, None),  # an occasional bad batch: skipped, the job goes on
    (set(range(1, 11)), 10, {}, None),  # 10 in a row is the limit, not past it
    (set(range(1, 12)), 11, {}, "skipped 11 steps in a row (steps 1..11), more than --max-skips-in-a-row 10"),
    (set(range(3, 6)), 5, {"max_skips_in_a_row": 2}, "skipped 3 steps in a row (steps 3..5)"),
    (set(range(2, 40, 2)), 40, {}, "skipped 19 of 40 steps (48%), more than --max-skipped-share 0.1"),
    (set(range(2, 22, 2)), 400, {}, None),  # 10 every other step: no run, and 2.5% of the steps
    (set(range(2, 26, 2)), 100, {}, "skipped 12 of 100 steps (12%)"),
    (set(range(2, 26, 2)), 100, {"max_skipped_share": 0.2}, None),
    (set(range(2, 26, 2)), 100, {"max_skipped_share": 1.0}, None),
])
def test_skipping_is_bounded_in_a_row_and_by_share(skipped: set[int], steps_run: int, limits: dict[str, float],
                                                   expected: str | None) -> None:
    from undying.manager.integrity.numerics import skip_limit

    got = skip_limit(skipped, steps_run, limits)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got and got.endswith("the job stops") and "\n" not in got, got


def test_the_skip_bounds_are_options_with_their_environment_and_checked() -> None:
    args = build_parser().parse_args(["run", "--numerics", "rollback", "--max-skips-in-a-row", "3",
                                      "--max-skipped-share", "0.25", "train.py"])
    value = numerics_env(args)
    assert value == "on_persistent=rollback,max_skips_in_a_row=3,max_skipped_share=0.25"
    assert Numerics.from_env({NUMERICS_ENV: str(value)}) == Numerics(on_persistent="rollback", max_skips_in_a_row=3,
                                                                     max_skipped_share=0.25)
    assert Numerics().max_skips_in_a_row == 10 and Numerics().max_skipped_share == 0.1
    with pytest.raises(UsageError, match="--max-skips-in-a-row applies to --numerics skip or rollback"):
        numerics_env(build_parser().parse_args(["run", "--numerics", "stop", "--max-skips-in-a-row", "3", "t.py"]))
    with pytest.raises(UsageError, match="--max-skipped-share applies to the numeric checks: add --numerics"):
        numerics_env(build_parser().parse_args(["run", "--max-skipped-share", "0.5", "t.py"]))
    with pytest.raises(UsageError, match=r"max_skips_in_a_row=\.\.\.\) must be a whole number of steps from 1"):
        Numerics(max_skips_in_a_row=0)
    with pytest.raises(UsageError, match=r"max_skipped_share=\.\.\.\) must be a share of the steps above 0"):
        Numerics(max_skipped_share=1.5)


@pytest.mark.parametrize(("flag", "raw", "said"), [("--max-skips-in-a-row", "0", "'0' is not a number of steps"),
                                                  ("--max-skipped-share", "nan", "'nan' is not a share of the steps"),
                                                  ("--max-skipped-share", "0", "'0' is not a share of the steps")])
def test_bad_skip_bounds_are_refused_by_the_parser(flag: str, raw: str, said: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--numerics", "skip", flag, raw, "train.py"])
    assert said in capsys.readouterr().err
