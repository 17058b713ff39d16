"""A planned move (``undying migrate``): a rank leaves at a step boundary for a warm spare, nothing lost.

One seeded 2-rank job (the configuration of test_goodput, whose fault-free
baseline the oracle caches): once it runs with a warm spare, rank 1 is moved.
The per-step losses and the final state equal the run without the move, no
step completed twice, and the incident log holds one planned ``migration``
incident, recovered, with its timeline and the warm spare that took the rank.
"""

from __future__ import annotations

from pathlib import Path

from tests.oracle import Oracle
from undying.cli.demo import FAULTS

SCRIPT_ARGS = ("--epochs", "2", "--step-seconds", "0.02")  # test_goodput's: its baseline is shared


def test_a_rank_migrates_to_a_warm_spare_with_identical_losses(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", [FAULTS["migrate"]], ranks=2, script_args=SCRIPT_ARGS,
                                     extra_run_args=("--spares", "1"), when_warm=True)
    assert outcome.run.rerun_steps == []  # no step completed twice (the oracle says so too)
    [incident] = outcome.incidents
    assert (incident["kind"], incident["rank"], incident["action"]) == ("migration", 1, "migrate")
    assert incident["detail"]["replacement"] == "warm spare"
    moved = incident["detail"]["migration"]
    [planned] = outcome.events("migration_planned")
    # It left at a boundary: its last committed step is the one the incident names, at or past the plan's.
    assert moved["boundary_step"] == incident["step"] >= planned["boundary"]
    phases = incident["phases"]
    for phase in ("detected", "decided", "replacement_ready", "group_rebuilt", "state_restored", "first_step_done"):
        assert phase in phases, phases
    assert incident["mttr_s"] is not None and incident["mttr_s"] > 0
    # The replacement's state came from the other rank, at the boundary: the step after it ran once, there.
    assert incident["detail"]["restored_step"] == incident["step"]
