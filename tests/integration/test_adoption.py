"""Scripts as they are written in the wild keep working and resume at the exact batch."""

from __future__ import annotations

from pathlib import Path

from tests.oracle import Oracle, crash


def test_stateful_dataloader_resumes_at_the_exact_batch(oracle: Oracle, tmp_path: Path) -> None:
    oracle.assert_survives(tmp_path / "job", [crash(1, 13, "forward")],
                           script_args=("--epochs", "2", "--loader", "stateful"))


def test_dataloader_with_worker_processes_resumes_at_the_exact_batch(oracle: Oracle, tmp_path: Path) -> None:
    oracle.assert_survives(tmp_path / "job", [crash(0, 20, "backward")], ranks=2,
                           script_args=("--epochs", "2", "--num-workers", "2"))


def test_script_that_calls_init_process_group_itself(oracle: Oracle, tmp_path: Path) -> None:
    """The replacement's own init_process_group(env://) meets the survivors' new group."""
    outcome = oracle.assert_survives(tmp_path / "job", [crash(3, 9, "backward")],
                                     script_args=("--epochs", "2", "--init-process-group"))
    assert [i["rank"] for i in outcome.incidents] == [3]
