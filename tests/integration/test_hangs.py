"""A rank that stops (SIGSTOP) is found by its missing heartbeats, killed and replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.oracle import Oracle, hang, job_summary

TIMEOUT_S = 2.0


@pytest.mark.parametrize(("rank", "step", "phase"), [(3, 6, "forward"), (0, 9, "backward")])
def test_a_stopped_rank_is_detected_killed_and_replaced(
    oracle: Oracle, tmp_path: Path, rank: int, step: int, phase: str
) -> None:
    outcome = oracle.assert_survives(
        tmp_path / "job", [hang(rank, step, phase)],
        extra_run_args=("--spares", "0", "--heartbeat-timeout", str(TIMEOUT_S)),
    )
    (incident,) = outcome.incidents
    assert incident["kind"] == "hang" and incident["action"] == "replace" and incident["rank"] == rank
    # Detected within the timeout + 1 s of the SIGSTOP (the fault time).
    assert TIMEOUT_S * 0.5 <= incident["phases"]["detected"] <= TIMEOUT_S + 1.0, incident["phases"]
    (detected,) = outcome.events("hang_detected")
    assert detected["rank"] == rank and detected["phase"] == "heartbeat"
    killed = [e for e in outcome.events("exited") if e["rank"] == rank and e["returncode"] == -9]
    assert len(killed) == 1, "the stopped process was killed, not left behind"


def test_a_slow_job_is_not_a_hang(oracle: Oracle, tmp_path: Path) -> None:
    """Every rank slow alike keeps beating: no incident even with steps longer than the timeout."""
    outcome = oracle.run(tmp_path / "job", ["--epochs", "1", "--samples", "96", "--hidden", "2048",
                                            "--layers", "12", "--batch-size", "16"], ranks=2,
                         extra_run_args=("--spares", "0", "--heartbeat-timeout", "0.5"))
    assert outcome.returncode == 0
    assert outcome.incidents == [] and outcome.events("hang_detected") == []
    done = {c["step"]: c["t"] for c in job_summary(outcome.job_dir)["steps"]}
    assert max(done[s] - done[s - 1] for s in done if s - 1 in done) > 0.5, "steps outlasted the timeout"
