"""SIGKILL of ranks at every part of a step is recovered with bit-identical losses.

Each test runs the seeded demo job with real processes and real SIGKILLs and
compares it with the fault-free run (tests/oracle.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.oracle import Oracle, crash

# One kill at each part of a step, one after another in one job: each one's recovery is done (its
# first step after it committed) before the next one's step comes (4 jobs -> 1: 3 fewer zygotes and
# references to pay for on the suite's 2 cores).
KILLS = [
    crash(2, 5, "backward"),  # during the gradient all-reduce
    crash(0, 7, "forward"),  # rank 0, mid forward
    crash(1, 9, "optimizer"),  # in the optimizer step, after the all-reduce completed
    crash(3, 17, "step"),  # between steps, at an epoch boundary
]


def test_crash_at_any_part_of_a_step(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", KILLS)
    assert [(i["rank"], i["action"]) for i in outcome.incidents] == [(k.rank, "replace") for k in KILLS], (
        outcome.incidents)
    for kill, incident in zip(KILLS, outcome.incidents, strict=True):
        assert incident["step"] == kill.at_step, incident
        assert incident["detail"]["restore_plan"].startswith(f"rank {kill.rank} <- peer rank "), incident["detail"]
        phases = incident["phases"]
        for name in ("detected", "decided", "replacement_ready", "group_rebuilt", "state_restored",
                     "first_step_done"):
            assert name in phases, phases
        assert 0 <= phases["detected"] <= phases["decided"] <= phases["first_step_done"] == incident["mttr_s"]
    generations = [i["detail"].get("generation") for i in outcome.incidents]
    assert len(set(generations)) == len(KILLS), f"each kill a recovery of its own: {generations}"


def test_survivors_keep_their_processes_and_the_replacement_gets_state_from_a_peer(
    oracle: Oracle, tmp_path: Path
) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", [crash(1, 6, "backward")])
    spawned = outcome.events("spawned")
    first_pids = {e["rank"]: e["pid"] for e in spawned if not e["joining"]}
    replacements = [e for e in spawned if e["joining"]]
    assert [e["rank"] for e in replacements] == [1], "only the dead rank is replaced"
    restored = outcome.events("state_restored")
    donors = {e["donor"] for e in restored}
    assert len(donors) == 1 and donors.pop() != 1, "the state came from a surviving peer"
    assert all(e["receivers"] == [1] for e in restored), "only the replacement received state"
    # Survivors committed steps both before and after the fault with the same PID.
    exits = {e["pid"] for e in outcome.events("exited")}
    for rank in (0, 2, 3):
        assert first_pids[rank] in exits  # they ran to the end ...
    assert not [e for e in outcome.events("exited") if e["pid"] in {first_pids[r] for r in (0, 2, 3)} and e["returncode"] != 0]


def test_two_ranks_killed_at_once(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", [crash(0, 8, "backward"), crash(3, 8, "backward")])
    assert sorted(i["rank"] for i in outcome.incidents) == [0, 3]


def test_second_kill_while_a_recovery_is_under_way(oracle: Oracle, tmp_path: Path) -> None:
    # Rank 1 dies in step 6's all-reduce; rank 2 dies the moment it starts recovering from that.
    outcome = oracle.assert_survives(tmp_path / "job", [crash(1, 6, "backward"), crash(2, 1, "recovery")])
    assert sorted(i["rank"] for i in outcome.incidents) == [1, 2]
    assert len({i["detail"].get("generation") for i in outcome.incidents}) == 1, "one recovery handled both"


def test_a_warm_spare_replaces_the_dead_rank(oracle: Oracle, tmp_path: Path) -> None:
    """With a spare warm, the replacement is that process: no interpreter start, no torch import.

    Behaviour only (how fast it is, is bench/recovery.py's to say): it was a test of the slow
    part of the suite, run alone, for a bound of 1.5 s on the replacement's readiness."""
    outcome = oracle.assert_survives(
        tmp_path / "job", [crash(1, 6, "optimizer")], script_args=("--epochs", "6", "--samples", "4096"),
        extra_run_args=("--spares", "1"), when_warm=True,
    )
    (incident,) = outcome.incidents
    assert incident["detail"]["replacement"] == "warm spare"
    spawned = [e for e in outcome.events("spawned") if e["joining"]]
    assert [e["spare"] for e in spawned] == [True]


def test_recovery_needs_no_numpy(oracle: Oracle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch does not install NumPy; a fresh environment must recover without it."""
    hidden = tmp_path / "no-numpy" / "numpy"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError('NumPy is hidden by this test', name='numpy')\n")
    monkeypatch.setenv("PYTHONPATH", str(hidden.parent))
    oracle.assert_survives(tmp_path / "job", [crash(3, 7, "backward")])
