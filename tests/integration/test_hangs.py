"""A rank that stops (SIGSTOP) is found by its missing heartbeats, killed and replaced."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.jobs import events, manager_url, start_job, wait_running
from tests.oracle import Oracle, crash, hang, job_summary
from undying.demo.oracle import compare_runs, load_run

TIMEOUT_S = 2.0


@pytest.mark.parametrize(("rank", "step", "phase"), [(3, 6, "forward"), (0, 9, "backward")])
def test_a_stopped_rank_is_detected_killed_and_replaced(
    oracle: Oracle, tmp_path: Path, rank: int, step: int, phase: str
) -> None:
    outcome = oracle.assert_survives(
        tmp_path / "job", [hang(rank, step, phase)],
        extra_run_args=("--spares", "0", "--heartbeat-timeout", str(TIMEOUT_S)),
    )
    assert len(outcome.incidents) == 1, f"{outcome.incidents}\n{outcome.log()[-3000:]}"
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
    outcome = oracle.run(tmp_path / "job", ["--epochs", "1", "--samples", "96", "--batch-size", "16",
                                            "--step-seconds", "0.8"], ranks=2,
                         extra_run_args=("--spares", "0", "--heartbeat-timeout", "0.5"))
    assert outcome.returncode == 0
    assert outcome.incidents == [] and outcome.events("hang_detected") == []
    done = {c["step"]: c["t"] for c in job_summary(outcome.job_dir)["steps"]}
    assert max(done[s] - done[s - 1] for s in done if s - 1 in done) > 0.5, "steps outlasted the timeout"


STEP_TIMEOUT_S = 2.0


@pytest.mark.parametrize(("rank", "step", "phase", "how"), [
    (1, 7, "forward", "spin"),   # an endless loop while the others wait in the loss all-reduce
    (2, 8, "backward", "block"),  # a deadlock in backward: the others are stuck in the gradient all-reduce
    (0, 6, "optimizer", "spin"),  # after the step's collectives: the others wait in the next step's
])
def test_a_rank_stuck_while_alive_is_found_by_its_progress_and_replaced(
    oracle: Oracle, tmp_path: Path, rank: int, step: int, phase: str, how: str
) -> None:
    """The process lives and beats; only its progress stops. The rank the others wait for is the one killed."""
    outcome = oracle.assert_survives(
        tmp_path / "job", [hang(rank, step, phase, how)],
        extra_run_args=("--spares", "0", "--step-timeout", str(STEP_TIMEOUT_S)),
    )
    assert len(outcome.incidents) == 1, f"{outcome.incidents}\n{outcome.log()[-3000:]}"
    (incident,) = outcome.incidents
    assert incident["kind"] == "hang" and incident["action"] == "replace" and incident["rank"] == rank
    assert STEP_TIMEOUT_S * 0.5 <= incident["phases"]["detected"] <= STEP_TIMEOUT_S + 1.0, incident["phases"]
    assert "no progress" in incident["error"], incident["error"]
    stalls, hangs = outcome.events("stall_detected"), outcome.events("hang_detected")
    assert len(stalls) == 1 and len(hangs) == 1, (stalls, hangs)
    (stall,), (detected,) = stalls, hangs
    assert stall["culprits"] == [rank], stall
    assert detected["rank"] == rank and detected["phase"] == "step"
    killed = [e for e in outcome.events("exited") if e["returncode"] == -9]
    assert [e["rank"] for e in killed] == [rank], "only the stuck rank is killed; the ones waiting for it live"


def test_a_survivor_that_never_leaves_the_old_generation_is_replaced_without_waiting_for_the_step_timeout(
    oracle: Oracle, tmp_path: Path
) -> None:
    """Rank 2 dies at step 8 while rank 1 sits in a wait its peers' failure cannot end (step 7's update).

    The manager watches every survivor leave the generation before; rank 1 neither fails nor joins the
    new one, and a few seconds on (not at the 60 s step timeout) it is killed and replaced in the same
    recovery, named in the crash's incident (no incident of its own: the crash left it there). gloo
    leaves a survivor in that state by itself at times (a send queued to a peer that went away is
    never signalled, so the collective waits out its whole timeout); here a blocked update makes it
    happen every time. The losses are those of the run without faults.
    """
    outcome = oracle.run(tmp_path / "job", ["--epochs", "2"], 4, [hang(1, 7, "optimizer", "block"), crash(2, 8)],
                         extra_run_args=("--spares", "0", "--step-timeout", "60"))
    assert outcome.returncode == 0, outcome.log()[-3000:]
    assert outcome.comparison.identical, outcome.comparison.reasons
    assert outcome.comparison.lost_steps == 0
    (crashed,) = outcome.incidents
    assert crashed["kind"] == "crash" and crashed["rank"] == 2 and crashed["status"] == "recovered", crashed
    assert crashed["detail"]["left_behind"] == [1], crashed["detail"]
    (left,) = outcome.events("left_behind")
    assert left["rank"] == 1 and left["waited_s"] < 30, "judged from the telling, not by the 60 s step timeout"
    assert sorted(e["rank"] for e in outcome.events("spawned") if e["joining"]) == [1, 2]
    assert outcome.events("hang_detected") == [], "no hang of its own"
    assert outcome.events("stall_detected") == [], "the step timeout played no part"


# 64 steps of 0.08 s on 2 ranks: the fault-free reference is test_checkpoints.py's (pacing is no part of it).
PAUSE_ARGS = ["--epochs", "2", "--step-seconds", "0.08"]


def test_a_paused_launcher_declares_no_rank_hung(oracle: Oracle, tmp_path: Path, reap: list[int]) -> None:
    """The launcher (manager and agent in one process) stopped past its heartbeat and step timeouts, then
    continued: its ranks trained on meanwhile, their beats waiting in its sockets. A judge that was not running
    cannot judge silence: it gives every rank a fresh window and declares nothing (docs/architecture.md)."""
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, PAUSE_ARGS, ranks=2, reap=reap,
                         run_args=["--spares", "0", "--heartbeat-timeout", "2", "--step-timeout", "2"])
    assert wait_running(manager_url(job_dir), min_step=5)["step"] < 40
    os.kill(launcher.pid, signal.SIGSTOP)
    try:
        time.sleep(3.0)  # 1.5 times both timeouts
    finally:
        os.kill(launcher.pid, signal.SIGCONT)
    log = job_dir.parent / f"{job_dir.name}.log"
    assert launcher.wait(timeout=120) == 0, log.read_text()[-3000:]
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(oracle.baseline(PAUSE_ARGS, 2), run)
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons
    assert run.incidents == [], run.incidents
    assert not [kind for kind in ("hang_detected", "stall_detected") if events(job_dir / "events.db", kind)]
    assert "agent did not run for" in log.read_text(), log.read_text()[-3000:]
