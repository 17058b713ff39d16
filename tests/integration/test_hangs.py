"""A rank that stops (SIGSTOP) is found by its missing heartbeats, killed and replaced."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.integration.jobs import (
    events,
    manager_url,
    rank_events,
    start_job,
    wait_for,
    wait_running,
)
from tests.oracle import Oracle, crash, hang, job_summary
from undying.demo.oracle import compare_runs, load_run

TIMEOUT_S = 2.0


# Each in one job, one after the other: a stop's recovery is over long before the next one's step.
STOPS = [hang(3, 6, "forward"), hang(0, 9, "backward")]


def test_a_stopped_rank_is_detected_killed_and_replaced(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(
        tmp_path / "job", STOPS, extra_run_args=("--spares", "0", "--heartbeat-timeout", str(TIMEOUT_S)),
    )
    incidents = outcome.incidents
    assert [(i["kind"], i["action"], i["rank"]) for i in incidents] == [("hang", "replace", s.rank) for s in STOPS], (
        f"{incidents}\n{outcome.log()[-3000:]}")
    for incident in incidents:
        # Detected within the timeout + 1 s of the SIGSTOP (the fault time).
        assert TIMEOUT_S * 0.5 <= incident["phases"]["detected"] <= TIMEOUT_S + 1.0, incident["phases"]
    detected = outcome.events("hang_detected")
    assert [(e["rank"], e["phase"]) for e in detected] == [(s.rank, "heartbeat") for s in STOPS], detected
    for stop in STOPS:
        killed = [e for e in outcome.events("exited") if e["rank"] == stop.rank and e["returncode"] == -9]
        assert len(killed) == 1, f"rank {stop.rank}'s stopped process was killed, not left behind"


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


# Each in one job, one after the other: each recovery is over before the next one's step. The
# optimizer's comes last: while a rank spins there the others go on to the next step (to wait in its
# collectives), where a fault of theirs would fire too (two ranks stuck at once: one stall naming both).
STUCK = [
    hang(1, 7, "forward", "spin"),  # an endless loop while the others wait in the loss all-reduce
    hang(2, 8, "backward", "block"),  # a deadlock in backward: the others are stuck in the gradient all-reduce
    hang(0, 11, "optimizer", "spin"),  # after the step's collectives: the others wait in the next step's
]


def test_a_rank_stuck_while_alive_is_found_by_its_progress_and_replaced(oracle: Oracle, tmp_path: Path) -> None:
    """The process lives and beats; only its progress stops. The rank the others wait for is the one killed."""
    outcome = oracle.assert_survives(
        tmp_path / "job", STUCK, extra_run_args=("--spares", "0", "--step-timeout", str(STEP_TIMEOUT_S)),
    )
    incidents = outcome.incidents
    assert [(i["kind"], i["action"], i["rank"]) for i in incidents] == [("hang", "replace", s.rank) for s in STUCK], (
        f"{incidents}\n{outcome.log()[-3000:]}")
    for incident in incidents:
        assert STEP_TIMEOUT_S * 0.5 <= incident["phases"]["detected"] <= STEP_TIMEOUT_S + 1.0, incident["phases"]
        assert "no progress" in incident["error"], incident["error"]
    stalls, hangs = outcome.events("stall_detected"), outcome.events("hang_detected")
    assert [e["culprits"] for e in stalls] == [[s.rank] for s in STUCK], stalls
    assert [(e["rank"], e["phase"]) for e in hangs] == [(s.rank, "step") for s in STUCK], hangs
    killed = [e for e in outcome.events("exited") if e["returncode"] == -9]
    assert [e["rank"] for e in killed] == [s.rank for s in STUCK], "only the stuck ranks are killed; the ones waiting live"


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


# 2 ranks, 2 epochs of 32 steps paced at 0.05 s (the reference runs unpaced: the same losses).
KEPT_ARGS = ["--epochs", "2", "--step-seconds", "0.05"]


def test_a_stuck_last_holder_is_waited_for_and_the_round_goes_on_when_it_leaves(
        oracle: Oracle, tmp_path: Path, reap: list[int]) -> None:
    """Rank 1 stops (SIGSTOP) and rank 0 is killed: rank 1, stuck in the old generation past the 5 s the
    survivors have to leave it, is judged left behind, but it alone holds the job's state, so it is kept
    (`left_behind_kept`), not killed (which would end the job). Continued, it leaves as a survivor whose
    collective ended at last (gloo's own timeout, in the fault this stands for): the round opens a new
    generation where it meets rank 0's replacement, which takes its state from it. The losses are those of
    the run without faults."""
    job_dir = tmp_path / "job"
    db = job_dir / "events.db"
    launcher = start_job(job_dir, KEPT_ARGS, ranks=2, reap=reap,
                         run_args=["--spares", "0", "--heartbeat-timeout", "60"])
    assert wait_running(manager_url(job_dir), min_step=5)["step"] < 40
    pids = {e["rank"]: e["pid"] for e in rank_events(db, "spawned")}
    os.kill(pids[1], signal.SIGSTOP)
    try:
        os.kill(pids[0], signal.SIGKILL)
        wait_for(lambda: events(db, "left_behind_kept"), 60, "rank 1 to be kept as the last holder")
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert launcher.wait(timeout=120) == 0, (job_dir.parent / "job.log").read_text()[-3000:]
    run = load_run(db)
    comparison = compare_runs(oracle.baseline(KEPT_ARGS, 2), run)
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons
    (crashed,) = run.incidents
    assert (crashed["kind"], crashed["rank"], crashed["action"], crashed["status"]) == (
        "crash", 0, "replace", "recovered"), crashed
    (kept,) = rank_events(db, "left_behind_kept")
    assert (kept["rank"], kept["pid"]) == (1, pids[1]) and kept["waited_s"] >= 5.0, kept
    assert events(db, "left_behind") == [] and events(db, "hang_detected") == []
    assert [e["rank"] for e in rank_events(db, "spawned") if e["joining"]] == [0], "rank 1 kept its process"
    assert any("at last" in e["reason"] for e in events(db, "generation_opened")), events(db, "generation_opened")


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
