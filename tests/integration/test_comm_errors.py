"""A collective that fails while every process lives is retried in place."""

from __future__ import annotations

from pathlib import Path

from tests.oracle import Oracle, comm_error

# Both in one job, one after the other: the first's retry is over long before the second's step.
COMM_ERRORS = [comm_error(1, 6, "backward"), comm_error(0, 11, "forward")]


def test_comm_error_is_retried_with_the_same_processes(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", COMM_ERRORS)
    assert [(i["kind"], i["action"], i["rank"]) for i in outcome.incidents] == [
        ("comm-error", "retry", e.rank) for e in COMM_ERRORS], outcome.incidents
    assert all(i["detail"]["injected"] is True for i in outcome.incidents)
    assert not [e for e in outcome.events("spawned") if e["joining"]], "no process was replaced"
    assert not [e for e in outcome.events("exited") if e["returncode"] != 0], "no process died"
    assert [e["generation"] for e in outcome.events("generation_opened")] == [0, 1, 2], "a generation per retry"


def test_a_comm_error_that_repeats_past_max_retries_replaces_the_rank(oracle: Oracle, tmp_path: Path) -> None:
    """Retry, retry, then the ladder's next rung: the rank whose links keep failing is replaced."""
    faults = [comm_error(1, 6, "backward") for _ in range(3)]
    outcome = oracle.assert_survives(tmp_path / "job", faults,
                                     extra_run_args=("--spares", "0", "--max-retries", "2"))
    actions = [(i["kind"], i["rank"], i["step"], i["action"]) for i in outcome.incidents]
    assert actions == [("comm-error", 1, 6, "retry")] * 2 + [("comm-error", 1, 6, "replace")], actions
    assert "--max-retries 2" in outcome.incidents[-1]["detail"]["reason"]
    replaced = [e for e in outcome.events("spawned") if e["joining"]]
    assert [e["rank"] for e in replaced] == [1]
    killed = [e for e in outcome.events("exited") if e["rank"] == 1 and e["returncode"] == -9]
    assert len(killed) == 1
