"""The soak's pure parts (bench/soak_plan.py, bench/soak_report.py): its seeded schedule and its verdict.

The soak itself runs real jobs for many minutes and is not part of the suite;
what it decides from its records is tested here, without a process.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"soak_test_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


plan = _load("soak_plan")
report = _load("soak_report")


def test_every_own_kind_comes_at_least_its_share_and_the_rest_is_drawn() -> None:
    deck = plan.schedule(plan.SINGLE, 200, 20, random.Random(1))
    counts = Counter(deck)
    assert plan.faults_of(deck) >= 200
    assert plan.faults_of(deck[:-1]) < 200  # no more than needed
    assert all(counts[k] >= 20 for k in plan.SINGLE if plan.kind(k).own), counts
    assert {k for k in plan.SINGLE if not plan.kind(k).own} & set(counts)  # the rank faults are drawn too
    assert deck == plan.schedule(plan.SINGLE, 200, 20, random.Random(1))  # seeded
    assert deck != plan.schedule(plan.SINGLE, 200, 20, random.Random(2))


def test_the_default_runs_reach_300_faults_with_each_own_kind_20_times() -> None:
    single = plan.schedule(plan.SINGLE, 200, 20, random.Random("1:single"))
    multi = plan.schedule(plan.MULTI, 100, 20, random.Random("1:multi"))
    assert plan.faults_of(single) + plan.faults_of(multi) >= 300
    counts = Counter(single + multi)
    assert all(counts[k] >= 20 for k in plan.OWN), {k: counts[k] for k in plan.OWN}


def test_a_small_run_shares_its_faults_among_the_chosen_kinds() -> None:
    deck = plan.schedule(["zygote-kill", "verifier-kill", "crash"], 3, 20, random.Random(1))
    assert sorted(deck) == ["verifier-kill", "zygote-kill", "zygote-kill"] or \
        sorted(deck) == ["verifier-kill", "verifier-kill", "zygote-kill"]
    assert plan.schedule(["zygote-stop"], 3, 20, random.Random(1)) == ["zygote-stop", "zygote-stop"]  # 2 faults each
    assert plan.soaks_of(["agent-kill", "crash"]) == ["single", "multi"]
    assert plan.soaks_of(["standby-kill"]) == ["multi"]
    with pytest.raises(ValueError, match="unknown fault kind 'zygote'"):
        plan.schedule(["zygote"], 3, 20, random.Random(1))
    with pytest.raises(ValueError, match="at least 1"):
        plan.schedule(["crash"], 0, 20, random.Random(1))


def _result(**over: object) -> dict:
    result = {"outcomes": report.outcomes_by_kind([
        {"scenario": "crash", "outcome": "recovered"}, {"scenario": "disk", "disk": "filled"},
        {"scenario": "launcher-hup", "outcome": "planned-end"}]),
        "launches": [{"rc": 75}, {"rc": 0}], "job_state": "succeeded", "returncode": 0, "identical": True,
        "lost_steps": 0, "leaked_processes": []}
    result.update(over)
    return result


def test_the_soak_holds_only_when_every_scenario_every_launch_and_the_oracle_say_so() -> None:
    assert report.holds(_result(), planned_exits=(75,))
    assert not report.holds(_result(), planned_exits=())  # exit 75 was not a documented end here
    assert not report.holds(_result(launches=[{"rc": -1}, {"rc": 0}]), planned_exits=(75,))  # died on SIGHUP
    assert not report.holds(_result(lost_steps=3), planned_exits=(75,))
    assert not report.holds(_result(identical=False), planned_exits=(75,))
    assert not report.holds(_result(leaked_processes=[123]), planned_exits=(75,))
    assert not report.holds(_result(outcomes={}), planned_exits=(75,))  # nothing ran: nothing held
    failed = report.outcomes_by_kind([{"scenario": "zygote-kill", "outcome": "failed", "why": "ranks [0] lost"},
                                      {"scenario": "zygote-kill", "outcome": "recovered"}])
    assert failed == {"zygote-kill": {"n": 2, "recovered": 1, "planned-end": 0, "failed": 1,
                                      "failures": ["ranks [0] lost"]}}
    assert not report.holds(_result(outcomes=failed), planned_exits=(75,))
