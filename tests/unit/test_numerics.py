"""Numeric checks and exact replay (undying.worker.numerics), one process, through the real step loop.

An unmanaged job (no ``undying run``) runs the same transaction, checks and
replay as a managed rank; the multi-rank paths (fingerprints over DDP,
the incident, the drills) are in tests/integration/test_numerics.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.unit.test_http_auth import Served
from undying.errors import UsageError
from undying.protocol.worker_wire import ArmFault, Progress
from undying.worker.faults import FaultSwitch, flip_bit
from undying.worker.job import Job, Outcome
from undying.worker.numerics import NumericFault, Numerics

STEPS = 8


def _run(numerics: Any, poison: Callable[[int, int], bool] = lambda step, attempt: False, *,
         skip: frozenset[int] = frozenset(), spike: Callable[[int, int], bool] = lambda step, attempt: False,
         batchnorm: bool = False) -> tuple[dict[int, float], list[int], torch.nn.Module]:
    """Train STEPS steps; ``poison(step, attempt)`` puts a NaN into that run of the step's loss.

    Returns each committed step's loss, how many times each step's body ran, and the model.
    """
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 4, generator=data), torch.randn(64, 1, generator=data)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 8)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(8))
    model = torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = Job(None)
    state = job.state(model=model, optimizer=optimizer, loader=loader)
    losses: dict[int, float] = {}
    runs = [0] * (STEPS + 1)
    for step in job.steps(state, total=STEPS, numerics=numerics):
        with step:
            runs[step.index] += 1
            if step.index in skip:
                continue
            inputs, targets = step.batch
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            if poison(step.index, runs[step.index]):
                loss = loss * float("nan")
            if spike(step.index, runs[step.index]):
                loss = loss * 1000
            step.log(loss=loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if step.outcome is Outcome.COMMITTED and step.metrics:
            losses[step.index] = step.metrics["loss"]
    return losses, runs, model


def _same_model(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_transient_nan_is_replayed_and_the_run_is_the_fault_free_one() -> None:
    base, base_runs, base_model = _run(True, batchnorm=True)
    assert base_runs[1:] == [1] * STEPS
    losses, runs, model = _run(True, lambda step, attempt: step == 3 and attempt == 1, batchnorm=True)
    assert runs[3] == 2 and sum(runs) == STEPS + 1  # step 3 ran twice, every other once
    assert losses == base  # bit for bit: the same batch, random state and buffers on the replay
    assert _same_model(model, base_model)


def test_without_checks_a_nan_trains_into_the_model() -> None:
    """The test above can fail: unchecked, the same NaN reaches the weights."""
    _, runs, model = _run(None, lambda step, attempt: step == 3 and attempt == 1)
    assert runs[3] == 1
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_persistent_nan_skips_the_batch_like_a_run_that_skips_it() -> None:
    skipped, _, _ = _run(None, skip=frozenset({4}))
    losses, runs, model = _run(True, lambda step, attempt: step == 4)
    assert runs[4] == 2 and 4 not in losses
    assert losses == skipped  # the rest identical to a fault-free run that skips the same batch
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_persistent_nan_with_stop_fails_the_step_with_a_report() -> None:
    with pytest.raises(NumericFault) as caught:
        _run(Numerics(on_persistent="stop"), lambda step, attempt: step == 5)
    text = str(caught.value)
    assert "step 5" in text and "the loss is nan" in text and "failed the same way, bit for bit" in text
    assert "rank 0: {'epoch': 0, 'batch': 4}" in text  # where the batch is


def test_a_spike_is_found_after_the_warmup_and_replayed() -> None:
    config = Numerics(spike_factor=50, window=4, warmup=3)
    base, _, _ = _run(config)
    losses, runs, _ = _run(config, spike=lambda step, attempt: step == 6 and attempt == 1)
    assert runs[6] == 2 and losses == base
    # Within the warm-up the same spike is not judged: it commits.
    _, runs, _ = _run(config, spike=lambda step, attempt: step == 2 and attempt == 1)
    assert runs[2] == 1


def test_a_grad_scaler_skip_is_not_a_fault() -> None:
    """Inf gradients a GradScaler skips never reach optimizer.step: the step commits, nothing replayed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)  # overflows the float32 gradients
    job = Job(None)
    state = job.state(model=model, optimizer=optimizer)
    runs = 0
    for step in job.steps(state, total=3, numerics=Numerics(scaler=scaler)):
        with step:
            runs += 1
            loss = model(torch.full((2, 4), 1e3)).sum()
            step.log(loss=loss)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert runs == 3  # no replay
    assert scaler.get_scale() < 2.0 ** 127  # the scaler did its own work


def test_bad_options_are_refused_by_name() -> None:
    with pytest.raises(UsageError, match="spike_factor"):
        Numerics(spike_factor=0.5)
    with pytest.raises(UsageError, match="warmup <= window"):
        Numerics(window=3, warmup=5)
    with pytest.raises(UsageError, match="on_persistent"):
        Numerics(on_persistent="pray")
    with pytest.raises(UsageError, match="numerics"):
        Numerics.of("yes")  # type: ignore[arg-type]


def test_flip_bit_flips_one_exponent_bit() -> None:
    t = torch.tensor([0.01, 1.0])
    flip_bit(t)
    assert t[1] == 1.0 and t[0] > 1e30
    flip_bit(t)
    assert t[0] == torch.tensor(0.01)


# --- the manager's side: the drills armed, the verdict recorded ------------------------------------------


def test_the_manager_arms_drills_and_records_the_verdict_as_an_incident(tmp_path: Path) -> None:
    served = Served(tmp_path)
    try:
        manager = served.manager

        async def drive() -> list[Any]:
            answers = [manager.inject("nan", 1, 7, None, "persistent"), manager.inject("bitflip", 0, None, None, None)]
            for kind, rank, phase, how in (("nan", 0, None, "grad"), ("bitflip", 0, "forward", None),
                                           ("nan", 0, None, "sideways")):
                with pytest.raises(UsageError):
                    manager.inject(kind, rank, 5, phase, how)
            manager.handlers.handle(Progress(0, 0, "numeric_fault", time.time(), step=7, detail={
                "verdict": "transient", "action": "replayed", "summary": "step 7: the loss is nan; ...",
                "suspects": [1], "reason": "the loss is nan", "first": {"loss": "nan"}, "replay": {"loss": 0.5}}))
            return answers

        answers = served.call(drive)
        assert [a["phase"] for a in answers] == ["backward", "backward"] and answers[1]["how"] == "grad"
        assert [c for c in served.agent.calls if c[0] == "arm"] == [("arm", 1, "nan:persistent", 7),
                                                                     ("arm", 0, "bitflip:grad", 1)]
        (incident,) = manager.incidents
        assert (incident.kind, incident.rank, incident.step, incident.action, incident.status) == (
            "numeric", 1, 7, "replayed", "recovered")
        assert [e for e in served.snapshot()["events"] if e[0] == "numeric_fault"]
    finally:
        served.close()


def test_a_replay_that_fails_differently_is_called_nondeterministic() -> None:
    """First run a NaN loss, the replay an infinite one: not reproduced bit for bit, so not the data's doing."""
    told: list[Any] = []
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    job = Job(None)
    state = job.state(model=model, optimizer=optimizer)
    runs = 0
    for step in job.steps(state, total=4, numerics=True):
        with step:
            assert job._numerics is not None
            job._numerics._send = told.append  # the report rank 0 would send to the manager
            loss = model(torch.ones(2, 4)).sum()
            if step.index == 2:
                runs += 1
                loss = loss.abs() * (float("nan") if runs == 1 else float("inf"))
            step.log(loss=loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    (report,) = told
    assert isinstance(report, Progress) and report.phase == "numeric_fault" and report.step == 2
    assert report.detail["verdict"] == "nondeterministic" and report.detail["action"] == "skip"
    assert "failed differently (the loss is inf)" in report.detail["summary"]
    assert report.detail["suspects"] == [0]  # its gradients changed between the runs
    assert report.detail["first"]["loss"] == "nan" and report.detail["replay"]["loss"] == "inf"


def test_drills_strike_the_step_they_are_armed_for() -> None:
    """nan:once strikes one run, nan:persistent every run of its step only, bitflip:param the weight itself."""
    told: list[Any] = []
    switch = FaultSwitch(3, told.append, {})
    module = torch.nn.Linear(2, 1)
    weight = module.weight.detach().clone()
    switch.arm(ArmFault(kind="nan:once", at_step=2, phase="backward"))
    switch.arm(ArmFault(kind="nan:persistent", at_step=4, phase="backward"))
    grad = torch.ones(3)
    struck = []
    for step in (1, 2, 2, 3, 4, 4, 5):
        switch.check("step", step)
        out = switch.corrupt(grad, module)
        struck.append(out is not None and bool(torch.isnan(out[0])))
    assert struck == [False, True, False, False, True, True, False]
    assert torch.equal(grad, torch.ones(3))  # the gradient handed in is not written: a new one is returned
    switch.arm(ArmFault(kind="bitflip:param", at_step=6, phase="backward"))
    switch.check("step", 6)
    assert switch.corrupt(grad, module) is None
    assert not torch.equal(module.weight, weight) and torch.equal(module.weight.view(-1)[1:], weight.view(-1)[1:])
    assert [(m.kind, m.step) for m in told] == [("nan:once", 2), ("nan:persistent", 4), ("nan:persistent", 4),
                                               ("bitflip:param", 6)]


def test_a_second_loop_over_the_same_model_replaces_the_first_ones_hooks() -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    job = Job(None)
    state = job.state(model=model, optimizer=optimizer)
    guards = []
    for total in (2, 4):
        for step in job.steps(state, total=total, numerics=True):
            with step:
                guards.append(job._numerics)
                loss = model(torch.ones(2, 4)).sum()
                step.log(loss=loss)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    first, second = guards[0], guards[-1]
    assert first is not second and first is not None and second is not None
    assert len(second._sums) == 2  # this backward's two gradients, once each
    assert len(first._sums) == 2  # left as the first loop's last step left it: its hooks are gone


@pytest.mark.parametrize("unused", [False, True])
def test_a_nan_only_in_the_gradients_is_found(unused: bool) -> None:
    """A finite loss with a NaN gradient: found by the mark the last gradient carries, or (a parameter
    that gets no gradient, so no backward reaches the mark) by the full norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    spare = torch.nn.Linear(1, 1)  # in the state, never in the forward pass
    holder = torch.nn.ModuleList([model, spare]) if unused else model
    optimizer = torch.optim.SGD(holder.parameters(), lr=0.1)
    job = Job(None)
    state = job.state(model=holder, optimizer=optimizer)
    runs, strike = [0] * 5, [False]
    model[1].weight.register_hook(lambda g: g * float("nan") if strike[0] else None)
    for step in job.steps(state, total=4, numerics=True):
        with step:
            runs[step.index] += 1
            strike[0] = step.index == 2 and runs[2] == 1
            loss = model(torch.ones(2, 4)).pow(2).sum()
            step.log(loss=loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert runs[1:] == [1, 2, 1, 1]
    assert all(torch.isfinite(p).all() for p in holder.parameters())
