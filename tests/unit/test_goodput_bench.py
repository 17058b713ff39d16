"""bench/goodput.py's and ``bench/recovery.py --ranks``'s pure parts: the interruption mix and its
seeded schedule, Young's interval, the goodput arithmetic, and the per-size recovery summary.

The benchmarks run real jobs for many minutes and are not part of the suite; what they decide
from their inputs and records is tested here, without a process.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import sys
from itertools import pairwise
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:  # recovery_ranks imports its siblings by name, as a script does
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"goodput_test_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


plan = _load("goodput_plan")
ranks = _load("recovery_ranks")


# --- the mix ---------------------------------------------------------------------------------


def test_the_mix_is_the_llama3_snapshot() -> None:
    assert sum(plan.MIX.values()) == plan.LLAMA3["interruptions"] == 466
    assert plan.MIX["preempt"] == plan.LLAMA3["planned"] == 47
    unexpected = sum(n for k, n in plan.MIX.items() if k != "preempt")
    assert unexpected == plan.LLAMA3["unexpected"] == 419
    assert max(plan.MIX, key=plan.MIX.__getitem__) == "crash-hw"  # GPU faults the largest share


def test_apportion_keeps_the_shares_and_the_count() -> None:
    assert plan.apportion(466, plan.MIX, every_kind=False) == plan.MIX
    for count in (6, 9, 30, 100):
        shares = plan.apportion(count, plan.MIX, every_kind=True)
        assert sum(shares.values()) == count
        assert min(shares.values()) >= 1
        assert max(shares, key=shares.__getitem__) == "crash-hw"
    mix_only = plan.apportion(10, plan.MIX, every_kind=False)
    assert sum(mix_only.values()) == 10 and mix_only["hang"] == 0 and mix_only["crash-hw"] == 7


def test_apportion_refuses_what_cannot_be() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        plan.apportion(0, plan.MIX, every_kind=False)
    with pytest.raises(ValueError, match="each of the 6 kinds"):
        plan.apportion(5, plan.MIX, every_kind=True)


# --- the schedule ----------------------------------------------------------------------------


def test_schedule_is_seeded_spaced_and_inside_the_job() -> None:
    a = plan.schedule(9, 1800, 4, random.Random(405), verify_every=20)
    b = plan.schedule(9, 1800, 4, random.Random(405), verify_every=20)
    assert a == b
    assert a != plan.schedule(9, 1800, 4, random.Random(406), verify_every=20)
    steps = [f.step for f in a]
    assert steps == sorted(steps)
    slice_ = (1800 - 40) // 9
    assert all(later - earlier >= slice_ // 2 - 20 for earlier, later in pairwise(steps))
    assert steps[0] >= 20 and steps[-1] <= 1780
    assert {f.kind for f in a} == set(plan.MIX)
    assert all(0 <= f.rank < 4 for f in a)


def test_a_bitflip_lands_where_a_verification_replays_its_rank() -> None:
    for seed in range(20):
        for f in plan.schedule(8, 2000, 4, random.Random(seed), verify_every=25):
            if f.kind == "bitflip":
                assert f.step % 25 == 0
                assert f.rank == (f.step // 25 - 1) % 4  # worker.verify_plan.suspect_of
    assert plan.verified_step(41, 20, 4) == (60, 2)
    assert plan.verified_step(40, 20, 4) == (40, 1)


def test_schedule_refuses_a_job_too_short() -> None:
    with pytest.raises(ValueError, match="longer job"):
        plan.schedule(30, 100, 4, random.Random(1), verify_every=1)
    with pytest.raises(ValueError, match="verify-every"):
        plan.schedule(6, 1000, 4, random.Random(1), verify_every=100)


# --- Young's interval and goodput ------------------------------------------------------------


def test_young_interval() -> None:
    assert plan.young_interval_s(2.0, 3600.0) == pytest.approx(math.sqrt(14400.0))
    assert plan.checkpoint_every(0.005, 20.0, 0.1) == 4  # sqrt(0.2) = 0.447 s
    assert plan.checkpoint_every(1e-6, 1.0, 10.0) == 1  # never under one step
    with pytest.raises(ValueError):
        plan.young_interval_s(0.0, 10.0)
    with pytest.raises(ValueError):
        plan.checkpoint_every(1.0, 10.0, 0.0)


def test_goodput_arithmetic() -> None:
    assert plan.goodput(90.0, 100.0) == pytest.approx(0.9)
    assert plan.goodput(90.0, 100.0, total_steps=1000, untrusted_steps=250) == pytest.approx(0.675)
    assert plan.goodput(90.0, 100.0, total_steps=1000, untrusted_steps=5000) == 0.0
    assert plan.goodput(90.0, 0.0) is None


# --- recovery as ranks grow ------------------------------------------------------------------


def test_parse_ranks() -> None:
    assert ranks.parse_ranks("16,2,8,4") == [2, 4, 8, 16]
    for bad in ("1,4", "4,x", "4,4", "", "128"):
        with pytest.raises(ValueError, match="--ranks"):
            ranks.parse_ranks(bad)


def test_sweep_workload_runs_the_same_steps_at_every_size() -> None:
    args = argparse.Namespace(epochs=1, features=32, hidden=64, layers=2, batch_size=32,
                              step_seconds=0.2)
    for size in (2, 4, 8, 16):
        w = ranks.sweep_workload(size, 40, args)
        assert w.ranks == size and w.total_steps == 40
        assert "--step-seconds" in w.script_args()


def test_phase_lengths_from_a_cumulative_timeline() -> None:
    names = ("detected", "decided", "replacement_ready", "first_step_done")
    lengths = ranks.phase_lengths({"detected": 0.1, "replacement_ready": 0.4,
                                   "first_step_done": 0.9}, names)
    assert lengths == pytest.approx({"detected": 0.1, "replacement_ready": 0.3,
                                     "first_step_done": 0.5})


def _run(recovery: float, phases: dict[str, float]) -> dict[str, object]:
    return {"rc": 0, "recovery_s": recovery, "phases": phases, "lost_steps": 0}


def test_summary_names_the_slope_and_the_phase_that_grew() -> None:
    tr = {size: [_run(2.0 + size, {"workers_started": 1.0 + size, "group_ready": 1.5 + size,
                                   "first_step_done": 2.0 + size}) for _ in range(3)]
          for size in (2, 4, 16)}
    und = {size: [_run(r, {"detected": 0.05, "replacement_ready": 0.2, "first_step_done": r})
                  for r in (0.40, 0.45, 0.50)] for size in (2, 4, 16)}
    out = ranks.summarize_sizes({"torchrun": tr, "undying": und})
    assert out["torchrun"]["from"] == 4 and out["torchrun"]["to"] == 16
    assert out["torchrun"]["slope"] == pytest.approx(18 / 6 - 1)
    assert out["torchrun"]["grew_most"] == "workers_started"
    u4 = out["undying"]["sizes"][4]["recovery_s"]
    assert (u4["median"], u4["min"], u4["max"]) == (0.45, 0.40, 0.50)
    assert out["undying"]["slope"] == pytest.approx(0.0)


# --- the driver ------------------------------------------------------------------------------

goodput = _load("goodput")


def test_the_driver_asks_the_step_as_often_as_the_distance_needs() -> None:
    """Half the least time the steps left take, so a fault is still armed ahead of its step;
    never more often than every 50 ms, never less than every 10 s."""
    assert goodput.poll_interval(10, 0.1) == pytest.approx(0.5)
    assert goodput.poll_interval(1, 0.1) == goodput.POLL_MIN_S
    assert goodput.poll_interval(0, 0.1) == goodput.POLL_MIN_S
    assert goodput.poll_interval(-3, 0.1) == goodput.POLL_MIN_S  # passed: asked again soon
    assert goodput.poll_interval(10_000, 0.1) == goodput.POLL_MAX_S
    for left in range(0, 400):
        assert goodput.poll_interval(left, 0.1) <= max(goodput.POLL_MIN_S, left * 0.1)


def test_skip_names_runs_the_report_can_do_without() -> None:
    args = goodput.parse_args(["--skip", "torchrun,undying_fault_free", "--no-torchrun-fault-free"])
    assert args.skip == {"torchrun", "undying_fault_free", "torchrun_fault_free"}
    assert goodput.parse_args([]).skip == set()
    for bad in ("reference", "undying", "torchrun,nonsense"):
        with pytest.raises(SystemExit):
            goodput.parse_args(["--skip", bad])
