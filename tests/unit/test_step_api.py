"""The step object's semantics, the job's seed, batch fingerprints and the manager's divergence check."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from undying.config import JobConfig
from undying.errors import UsageError
from undying.jobfiles.events import EventLog, LogReader
from undying.manager.core import JobCore
from undying.manager.integrity import Divergence
from undying.protocol.env import SEED_ENV
from undying.protocol.worker_wire import Progress, StepBegun
from undying.worker.fingerprint import batch_fingerprint
from undying.worker.job import Job
from undying.worker.seed import seed_everything, seed_from_env
from undying.worker.state import State


def _job(seed: int = 0) -> Job:
    return Job(None, seed=seed)  # unmanaged: a single process, no fault tolerance, the same step API


def test_step_log_after_its_block_raises_and_the_step_says_it_committed() -> None:
    job = _job()
    model = torch.nn.Linear(2, 1)
    seen = []
    for step in job.steps(State(model=model), total=2):
        with pytest.raises(UsageError, match="before its `with step:` block"):
            step.log(loss=1.0)
        assert not step.committed
        with step:
            step.log(loss=torch.tensor(0.5), lr=1e-3)
        assert step.committed
        with pytest.raises(UsageError, match=r"step.log\(loss\) for step \d after its `with step:` block ended"):
            step.log(loss=2.0)
        seen.append((step.index, step.metrics))
    assert seen == [(1, {"loss": 0.5, "lr": 1e-3}), (2, {"loss": 0.5, "lr": 1e-3})]


def test_step_log_takes_numbers_and_one_element_tensors_only() -> None:
    step = next(iter(_job().steps(State(), total=1)))
    with step:
        with pytest.raises(UsageError, match=r"tensor of shape \(3,\)"):
            step.log(loss=torch.ones(3))
        with pytest.raises(UsageError, match="got a str"):
            step.log(loss="low")  # type: ignore[arg-type]


def test_a_step_whose_body_raises_did_not_commit() -> None:
    job = _job()
    step = next(iter(job.steps(State(), total=1)))
    with pytest.raises(ValueError), step:
        raise ValueError("a bug")
    assert not step.committed and step.outcome.value == "failed"
    with pytest.raises(UsageError, match="after the step ended"):
        step.uses(torch.ones(2))


def test_the_seed_comes_from_the_environment_or_zero_and_a_bad_one_is_refused() -> None:
    assert seed_from_env({}) == 0
    assert seed_from_env({SEED_ENV: "42"}) == 42
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(UsageError, match=f"{SEED_ENV}='{bad}' is not a seed"):
            seed_from_env({SEED_ENV: bad})
    with pytest.raises(UsageError, match="whole number"):
        seed_everything(-3)


def test_seeding_makes_torch_random_and_numpy_draw_the_same_numbers() -> None:
    draws = []
    for _ in range(2):
        seed_everything(7)
        draws.append((torch.rand(3).tolist(), random.random(), float(np.random.rand())))
    assert draws[0] == draws[1]
    seed_everything(8)
    assert torch.rand(3).tolist() != draws[0][0]


def test_the_jobs_seed_is_the_default_seed_of_its_steps() -> None:
    def first_draw(job: Job, **kwargs: int) -> list[float]:
        step = next(iter(job.steps(State(), total=1, **kwargs)))
        with step:
            return torch.rand(2).tolist()

    assert first_draw(_job(5)) == first_draw(_job(0), seed=5)
    assert first_draw(_job(5)) != first_draw(_job(6))


def test_a_batch_fingerprint_is_equal_iff_the_batch_is() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    assert batch_fingerprint((x, x[:, 0])) == batch_fingerprint((x.clone(), x[:, 0].clone()))
    assert batch_fingerprint(x) != batch_fingerprint(x.reshape(4, 3))  # same bytes, another shape
    y = x.clone()
    y[2, 3] += 1e-6
    assert batch_fingerprint(x) != batch_fingerprint(y)
    assert batch_fingerprint({"a": x, "b": 1}) == batch_fingerprint({"b": 1, "a": x})


def test_the_step_reports_its_batch_once_as_it_begins() -> None:
    job = _job()
    began: list[tuple[int, str]] = []
    job._hooks = dataclasses.replace(job._hooks, began=lambda s, f: began.append((s.index, f)))
    for step in job.steps(State(), total=2):
        with step:
            step.uses(torch.full((2,), float(step.index)))
            step.uses(torch.zeros(2))  # a second micro-batch: folded into the step's fingerprint, not reported
    assert began == [(1, batch_fingerprint(torch.full((2,), 1.0))), (2, batch_fingerprint(torch.full((2,), 2.0)))]


def _divergence(tmp_path: Path) -> tuple[Divergence, EventLog]:
    events = EventLog(tmp_path / "events.db")
    return Divergence(JobCore(JobConfig(job_id="j", job_dir=str(tmp_path), nproc_per_node=2), events)), events


def test_a_rerun_step_with_another_batch_is_a_diverged_incident(tmp_path: Path) -> None:
    divergence, events = _divergence(tmp_path)
    divergence.on_begun(StepBegun(1, 0, 7, "aaaa"))
    divergence.on_begun(StepBegun(0, 0, 7, "bbbb"))  # another rank's batch: its own
    divergence.on_begun(StepBegun(0, 1, 7, "bbbb"))  # a survivor re-running the step with its batch
    assert divergence.core.incidents == []
    divergence.on_begun(StepBegun(1, 1, 7, "cccc"))  # the replacement of rank 1, with another batch
    divergence.on_begun(StepBegun(1, 2, 7, "dddd"))  # said once per rank, step and fingerprint
    [incident] = divergence.core.incidents
    assert (incident.kind, incident.rank, incident.step, incident.status) == ("diverged", 1, 7, "observed")
    assert incident.detail["fingerprint"] == "batch"  # type: ignore[typeddict-item]
    assert "rank 1 began step 7 with another batch" in incident.error
    assert divergence.warning().startswith("; warning: the run diverged after a fault (rank 1 at step 7)")
    events.flush()
    with LogReader(tmp_path / "events.db") as reader:
        assert [i["kind"] for i in reader.incidents()] == ["diverged"]


def test_a_restored_state_that_is_not_its_donors_is_a_diverged_incident(tmp_path: Path) -> None:
    divergence, _ = _divergence(tmp_path)
    assert divergence.warning() == ""
    divergence.on_progress(Progress(1, 1, "state_loaded", 0.0, step=5, detail={"digest": "x", "donor_digest": "x"}))
    divergence.on_progress(Progress(1, 1, "state_restored", 0.0, step=5, detail={"donor": 0}))
    assert divergence.core.incidents == []
    divergence.on_progress(Progress(1, 1, "state_loaded", 0.0, step=5, detail={"digest": "y", "donor_digest": "x"}))
    [incident] = divergence.core.incidents
    assert (incident.kind, incident.rank, incident.step) == ("diverged", 1, 5)
    assert incident.detail["fingerprint"] == "state"  # type: ignore[typeddict-item]


def test_plain_variables_a_scaler_and_an_ema_copy_are_saved_as_plain_data() -> None:
    """What a script keeps across steps, in job.state: loaded back with weights_only=True, bit for bit."""
    import copy
    import io

    def build(seed: int) -> tuple[State, dict[str, float], torch.amp.GradScaler, torch.nn.Module]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        run = {"iter_num": seed, "best_val_loss": 1e9 - seed, "tokens_seen": 10 * seed}
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (10 + seed))
        ema = copy.deepcopy(model)
        return State(model=model, run=run, scaler=scaler, ema=ema), run, scaler, ema

    saved, run, scaler, ema = build(1)
    scaler.scale(torch.ones(1))  # its scale exists from its first use
    scaler.update(new_scale=123.0)
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    loaded, run2, scaler2, ema2 = build(2)
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    assert run2 == run and scaler2.get_scale() == 123.0
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), ema2.parameters(), strict=True))
    assert loaded.digest() == saved.digest()
