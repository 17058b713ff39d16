"""A collective that fails while every process lives is retried in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.oracle import Oracle, comm_error


@pytest.mark.parametrize(("rank", "step", "phase"), [(1, 6, "backward"), (0, 11, "forward")])
def test_comm_error_is_retried_with_the_same_processes(
    oracle: Oracle, tmp_path: Path, rank: int, step: int, phase: str
) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", [comm_error(rank, step, phase)])
    (incident,) = outcome.incidents
    assert incident["kind"] == "comm-error" and incident["action"] == "retry"
    assert incident["rank"] == rank and incident["detail"]["injected"] is True
    assert not [e for e in outcome.events("spawned") if e["joining"]], "no process was replaced"
    assert not [e for e in outcome.events("exited") if e["returncode"] != 0], "no process died"
    assert outcome.events("generation_opened")[-1]["generation"] == 1


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
