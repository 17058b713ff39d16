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
