"""The job's progress (jobfiles/progress.py): completed steps, plan, epoch, rate, ETA and values."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from undying.config import JobConfig
from undying.jobfiles.events import EventLog
from undying.jobfiles.progress import PLAN_EVENT, RATE_WINDOW, JobSteps, Plan, compute, mean_values
from undying.manager.manager import Manager
from undying.manager.steps import StepClock
from undying.protocol.worker_wire import CheckpointSaved, Progress, StepCommitted


def test_a_step_is_done_when_every_rank_committed_it_and_its_values_are_the_ranks_mean() -> None:
    steps = JobSteps(world_size=2)
    assert steps.commit(0, 1, 1.0, {"loss": 2.0}) is None
    assert steps.commit(1, 1, 1.5, {"loss": 4.0, "lr": 0.1}) == (1.5, {"loss": 3.0, "lr": 0.1})
    assert steps.last_values == (1, {"loss": 3.0, "lr": 0.1})
    # A step re-run after a recovery completes again, with the values of its new execution.
    assert steps.commit(0, 1, 3.0, {"loss": 1.0}) is None
    assert steps.commit(1, 1, 3.2, {"loss": 1.0}) == (3.2, {"loss": 1.0})
    assert list(steps.recent) == [(1, 1.5), (1, 3.2)]


def test_a_nan_loss_stays_nan_in_the_mean() -> None:
    assert math.isnan(mean_values([{"loss": float("nan")}, {"loss": 1.0}])["loss"])
    assert mean_values([{"a": 1.0}, {"b": 3.0}, {"a": 3.0}]) == {"a": 2.0, "b": 3.0}


def test_epochs_are_counted_as_the_worker_counts_them() -> None:
    plan = Plan(total_steps=64, steps_per_epoch=32)
    assert [plan.epoch_of(s) for s in (1, 32, 33, 64)] == [0, 0, 1, 1]
    assert plan.epochs == 2
    # Resumed on another world size: step 11 was batch 20 of the data (origin (10, 20)), 30 per epoch.
    resumed = Plan(total_steps=40, steps_per_epoch=30, origin=(10, 20))
    assert [resumed.epoch_of(s) for s in (11, 20, 21, 40)] == [0, 0, 1, 1]


def test_a_plan_is_read_from_the_workers_report_and_a_damaged_one_is_none() -> None:
    assert Plan.from_detail({"total_steps": 10, "steps_per_epoch": None, "origin": [0, 0], "batch_size": 8}) == \
        Plan(10, None, (0, 0), 8)
    for bad in ({}, {"total_steps": "x"}, {"total_steps": -1}, {"total_steps": 3, "origin": [1]}):
        assert Plan.from_detail(bad) is None, bad


def test_rate_eta_and_samples_from_the_recent_steps() -> None:
    plan = Plan(total_steps=100, steps_per_epoch=50, batch_size=16)
    recent = [(s, 10.0 + 0.5 * s) for s in range(1, 21)]  # 2 steps a second
    p = compute(20, plan, recent, world_size=4, values=(20, {"loss": 0.5}))
    assert p.steps_per_s == pytest.approx(2.0)
    assert p.samples_per_s == pytest.approx(2.0 * 16 * 4)
    assert p.eta_s == pytest.approx(80 / 2.0)
    assert (p.fraction, p.epoch, p.epochs, p.values_step, p.values) == (0.2, 0, 2, 20, {"loss": 0.5})
    d = p.to_dict()
    assert d["eta_s"] == 40.0 and d["total_steps"] == 100 and d["values"] == {"loss": 0.5}


def test_no_rate_without_forward_progress_nor_once_the_job_ended() -> None:
    plan = Plan(total_steps=10)
    assert compute(3, plan, [(3, 1.0)], world_size=2).steps_per_s is None  # one step: no interval yet
    assert compute(3, plan, [(3, 1.0), (3, 2.0)], world_size=2).eta_s is None  # a re-run only
    ended = compute(10, plan, [(9, 1.0), (10, 2.0)], world_size=2, running=False)
    assert ended.steps_per_s is None and ended.eta_s is None and ended.fraction == 1.0
    unknown = compute(5, None, [(4, 1.0), (5, 2.0)], world_size=2)
    assert unknown.total_steps is None and unknown.fraction is None and unknown.eta_s is None
    assert unknown.steps_per_s == pytest.approx(1.0) and unknown.samples_per_s is None


def test_the_rate_follows_a_change_of_pace_within_its_window() -> None:
    slow = [(s, float(s)) for s in range(1, 100)]  # 1 step a second, then 10
    fast = [(s, 99.0 + (s - 99) * 0.1) for s in range(100, 100 + RATE_WINDOW)]
    steps = JobSteps(world_size=1)
    for s, t in slow + fast:
        steps.commit(0, s, t)
    assert compute(131, None, steps.recent, world_size=1).steps_per_s == pytest.approx(10.0)


def test_the_step_clock_feeds_progress_from_commits_the_plan_and_saves() -> None:
    clock = StepClock(world_size=2)
    clock.reported("state_layout", {"sharded": False})  # not a plan: ignored
    clock.reported(PLAN_EVENT, {"total_steps": 8, "steps_per_epoch": 4, "origin": [0, 0], "batch_size": 2})
    clock.reported(PLAN_EVENT, {"total_steps": "garbage"})  # a damaged report keeps the plan there is
    for step in range(1, 5):
        for rank in (0, 1):
            clock.committed(rank, step, step + 0.1 * rank, {"loss": float(step * 10 + rank)})
    clock.saved(2, 2.5, 0.05)
    clock.saved(3, 3.5, 0.0)  # no stall: nothing to account
    assert clock.plan == Plan(8, 4, (0, 0), 2)
    assert clock.job_steps.last_values == (4, {"loss": 40.5})
    assert len(clock.ledger) == 4 and [s.step for s in clock.stalls] == [2]
    p = compute(4, clock.plan, clock.job_steps.recent, world_size=2, values=clock.job_steps.last_values)
    assert p.steps_per_s == pytest.approx(1.0) and p.eta_s == pytest.approx(4.0) and p.epoch == 0


def test_the_managers_status_carries_progress_and_goodput(tmp_path: Path) -> None:
    """The reports a real Manager takes (a plan, commits with values, a save) reach /api/status's fields."""
    events = EventLog(tmp_path / "events.db")
    manager = Manager(JobConfig(job_id="p", job_dir=str(tmp_path), nproc_per_node=2), events)
    manager.core.started_at = t0 = time.time() - 10  # the job started 10 s ago; its steps are in the past
    plan = {"total_steps": 10, "steps_per_epoch": 5, "origin": [0, 0], "batch_size": 4}
    manager.on_messages([Progress(0, 0, PLAN_EVENT, t0, step=0, detail=plan)])
    manager.on_messages([StepCommitted(r, 0, s, t0 + 1 + 0.5 * s + 0.01 * r, {"loss": float(10 * s + r)})
                         for s in range(1, 5) for r in (0, 1)])
    manager.on_messages([CheckpointSaved(0, 2, "periodic", "/ckpt/2", 0.05, 0.2, 100, t0 + 2.3)])
    status = manager.status()
    progress, goodput = status["progress"], status["goodput"]
    assert (progress["step"], progress["total_steps"], progress["epoch"], progress["epochs"]) == (4, 10, 0, 2)
    assert progress["steps_per_s"] == pytest.approx(2.0) and progress["eta_s"] == pytest.approx(3.0)
    assert progress["samples_per_s"] == pytest.approx(2.0 * 4 * 2)
    assert progress["values"] == {"loss": 40.5} and progress["values_step"] == 4
    assert goodput["losses"]["startup"] == pytest.approx(1.51, abs=1e-3)
    assert goodput["losses"]["checkpoint"] == pytest.approx(0.05, abs=1e-3)
    assert goodput["goodput_s"] == pytest.approx(1.5 - 0.05, abs=1e-3)
    assert goodput["goodput_s"] + sum(goodput["losses"].values()) == pytest.approx(goodput["wall_s"], abs=2e-3)
    manager.close()


def test_a_restarted_manager_goes_on_with_the_progress_and_goodput_its_log_kept(tmp_path: Path) -> None:
    config = JobConfig(job_id="r", job_dir=str(tmp_path), nproc_per_node=2)
    first = Manager(config, EventLog(tmp_path / "events.db"))
    first.core.started_at = t0 = time.time() - 10
    first.events.set_job("started_at", t0)
    plan = {"total_steps": 10, "steps_per_epoch": 5, "origin": [0, 0], "batch_size": 4}
    first.on_messages([Progress(0, 0, PLAN_EVENT, t0, step=0, detail=plan)])
    first.on_messages([StepCommitted(r, 0, s, t0 + 1 + 0.5 * s + 0.01 * r, {"loss": 1.0})
                       for s in range(1, 5) for r in (0, 1)])
    first.on_messages([CheckpointSaved(0, 2, "periodic", "/ckpt/2", 0.05, 0.2, 100, t0 + 2.3)])
    before = first.status()
    first.close()  # (the manager dies; its log stays)
    second = Manager(config, EventLog(tmp_path / "events.db"), restoring=True)
    second.restore()
    after = second.status()
    for key in ("step", "total_steps", "epoch", "steps_per_s", "eta_s", "samples_per_s"):
        assert after["progress"][key] == before["progress"][key], key
    assert after["goodput"]["goodput_s"] == pytest.approx(before["goodput"]["goodput_s"], abs=1e-3)
    assert after["goodput"]["losses"]["checkpoint"] == pytest.approx(0.05, abs=1e-3)
    assert after["goodput"]["losses"]["startup"] == pytest.approx(before["goodput"]["losses"]["startup"], abs=1e-3)
    second.close()
