"""Faults that overlap end recovered or in a clear failure, never in a stuck job.

Each case adds a second fault where the first one's recovery is weakest: a
survivor that hangs as it starts recovering, a replacement that crashes or
hangs once it has joined, every rank gone at once.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.oracle import Oracle, crash, hang, job_summary

HEARTBEAT_S = 2.0


def test_a_survivor_that_hangs_as_it_starts_recovering(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(
        tmp_path / "job", [crash(1, 6, "backward"), hang(2, 1, "recovery")],
        extra_run_args=("--spares", "0", "--heartbeat-timeout", str(HEARTBEAT_S)),
    )
    kinds = sorted((i["kind"], i["rank"], i["action"]) for i in outcome.incidents)
    assert kinds == [("crash", 1, "replace"), ("hang", 2, "replace")], outcome.incidents
    assert {i["recovery"] for i in outcome.incidents} == {1}, "both are handled by one recovery round"


def test_the_replacement_crashes_once_it_has_joined(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", [crash(2, 6, "backward"), crash(2, 1, "rejoin")])
    crashes = [i for i in outcome.incidents if i["kind"] == "crash"]
    assert [(i["rank"], i["action"]) for i in crashes] == [(2, "replace"), (2, "replace")], outcome.incidents
    spawned = [e for e in outcome.events("spawned") if e["rank"] == 2]
    assert len(spawned) == 3, "the first process, the replacement that crashed, and its replacement"


def test_the_replacement_hangs_once_it_has_joined(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(
        tmp_path / "job", [crash(3, 7, "forward"), hang(3, 1, "rejoin")],
        extra_run_args=("--spares", "0", "--heartbeat-timeout", str(HEARTBEAT_S)),
    )
    assert sorted((i["kind"], i["rank"]) for i in outcome.incidents) == [("crash", 3), ("hang", 3)]


def test_a_replacement_that_always_dies_ends_in_a_clear_failure(oracle: Oracle, tmp_path: Path) -> None:
    """The same rank lost at the same step past --max-step-recoveries: a bug, not bad luck; the job fails and says so."""
    started = time.monotonic()
    outcome = oracle.run(tmp_path / "job", ["--epochs", "2"], 4,
                         [crash(0, 5, "forward"), crash(0, 1, "rejoin")],
                         extra_run_args=("--spares", "0", "--max-step-recoveries", "1"))
    assert outcome.returncode == 1
    assert time.monotonic() - started < 90, "failed promptly, not after a timeout"
    summary = job_summary(outcome.job_dir)["job"]
    assert summary["state"] == "failed"
    assert "already recovered 1 time(s)" in summary["exit_reason"], summary["exit_reason"]
    assert outcome.incidents[-1]["status"] == "failed"


def test_every_rank_killed_at_once_without_a_checkpoint_fails_with_a_report(oracle: Oracle, tmp_path: Path) -> None:
    faults = [crash(rank, 6, "backward") for rank in range(4)]
    outcome = oracle.run(tmp_path / "job", ["--epochs", "2"], 4, faults)
    assert outcome.returncode == 1
    summary = job_summary(outcome.job_dir)["job"]
    assert summary["state"] == "failed"
    assert "no peer to restore from" in summary["exit_reason"], summary["exit_reason"]
    # The restore planner names what is missing.
    assert any("no complete state" in i["detail"].get("restore_plan", "") for i in outcome.incidents), outcome.incidents
