"""``--verify-every K`` in a real 4-rank DDP job: a finite bit flip found by a replay elsewhere, rolled back.

The verifier is a real process (the job's script again, outside the job's
process group); the flip is a real drill (``/api/inject bitflip`` with
``grad-finite``: the top mantissa bit of the rank's largest local gradient
value, finite and no spike, so the numeric checks pass it). The oracle: the
same seeded job without the fault (tests/oracle.py's cached baseline).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.integration.jobs import alive, events, manager_url, start_job, wait_for
from tests.oracle import Oracle
from undying.cli.demo import FaultPlan, run_job
from undying.demo.oracle import compare_runs, final_losses, load_run, rolled_back_steps
from undying.jobfiles.events import LogReader
from undying.worker.verify_plan import suspect_of

EPOCHS = ("--epochs", "2")  # the baseline other tests use: 4 ranks, 32 steps
VERIFY_ALL = ("--spares", "0", "--verify-every", "1")


def test_a_finite_gradient_flip_is_found_at_its_step_and_rolled_back(oracle: Oracle, tmp_path: Path) -> None:
    at, rank = 11, suspect_of(11, 1, 4)  # with K=1 the rank whose step 11 is replayed: the flip is caught there
    assert rank == 2
    flip = FaultPlan("bitflip", rank=rank, at_step=at, phase="backward", how="grad-finite", expect="sdc")
    outcome = oracle.run(tmp_path / "job", EPOCHS, 4, [flip], VERIFY_ALL)
    assert outcome.returncode == 0, outcome.log()[-3000:]
    assert outcome.events("fault_injected"), "the flip did not fire"
    (sdc,) = [i for i in outcome.incidents if i["kind"] == "sdc"]
    detail = sdc["detail"]
    assert (sdc["step"], sdc["rank"], sdc["action"], sdc["status"]) == (at, rank, "rolled_back", "recovered"), sdc
    assert not [i for i in outcome.incidents if i["kind"] == "numeric"], "a finite flip passes the numeric checks"
    # Rolled back to the last verified state (step 10's pre-step state: step 10 passed), re-run from there.
    assert detail["rolled_back_to"] == at - 2, detail
    rerun = load_run(outcome.job_dir / "events.db").rerun_steps
    assert rerun == list(range(at - 1, at - 1 + detail["rerun_steps"])), (rerun, detail)
    assert set(rerun) == rolled_back_steps(outcome.incidents), "the oracle's reading of the roll-back"
    # The oracle: after the roll-back every step's loss is the fault-free run's, bit for bit, and so is the state.
    baseline = oracle.baseline(EPOCHS, 4)
    losses, disagree = final_losses([outcome.job_dir / "events.db"])
    assert not disagree and losses == baseline.losses, (disagree, sorted(
        s for s in baseline.losses if losses.get(s) != baseline.losses[s]))
    assert outcome.run.digests == baseline.digests
    # The first run of the steps after the flip trained on the flipped gradient: they differed (it mattered).
    assert outcome.run.inconsistent_steps, "the flip changed no loss: the test would pass without the roll-back"
    (summary,) = outcome.events("verify_summary")
    assert summary["mismatched"] == 1 and summary["not_done"] == 0 and summary["skipped"] == 0, summary
    # Each verdict also went to the manager on its own (a quarantined host requalifies on them): the one mismatch
    # names the flipped rank's step, and the steps before it passed.
    verdicts = outcome.events("verify_result")
    assert [(v["step"], v["suspect"]) for v in verdicts if not v["passed"]] == [(at, rank)], verdicts
    assert {v["step"] for v in verdicts if v["passed"]} >= set(range(1, at)), verdicts


def test_a_stopped_verifier_never_blocks_a_step_and_is_replaced(tmp_path: Path) -> None:
    """SIGSTOP the verifier as it starts: every step still commits; 5 s on it is killed and replaced, the new
    one verifies what still waits, and the job says what went unverified."""
    job = tmp_path / "job"
    args = ["--epochs", "1", "--samples", "5120"]  # 80 steps on 4 ranks: past the 64 verifications that may wait
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(run_job(
        job, args, ranks=4, timeout_s=170, extra_run_args=list(VERIFY_ALL))), daemon=True)
    runner.start()
    pid = 0
    deadline = time.monotonic() + 90
    while not pid and time.monotonic() < deadline and runner.is_alive():
        if (job / "events.db").exists():
            try:
                with LogReader(job / "events.db") as reader:
                    started = reader.events("verify_started")
            except Exception:  # the log being created
                started = []
            pid = int(started[0].data["pid"]) if started else 0
        time.sleep(0.05)
    assert pid, "the verifier never started"
    os.kill(pid, signal.SIGSTOP)
    try:
        runner.join(timeout=175)
        assert result == [0], (result, (tmp_path / "job.log").read_text()[-3000:])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # the job kills it at its end; this only if it did not
    with LogReader(job / "events.db") as reader:
        commits = reader.commit_times()
        overdue = reader.events("verify_overdue")
        restarted = reader.events("verify_restarted")
        (summary,) = reader.events("verify_summary")
    assert {(r, s) for r, s, _ in commits} == {(r, s) for r in range(4) for s in range(1, 81)}
    assert len(commits) == 4 * 80  # every step committed once on every rank
    assert overdue and overdue[0].data["skipped"] >= 1, overdue
    assert [(e.data["old_pid"], e.data["exit"]) for e in restarted] == [(pid, "killed by SIGKILL")], restarted
    data = summary.data
    assert data["restarts"] == 1 and not data["gave_up"] and data["mismatched"] == 0, data
    assert data["verified"] >= 1 and data["passed"] == data["verified"], data  # the new one's work
    assert data["verified"] + data["skipped"] + data["not_done"] + data["errors"] == 80, data
    assert data["skipped"] >= 16, data  # past the 64 that may wait while it was stopped: never verified


def test_a_killed_verifier_is_replaced_and_forged_verify_files_are_refused(
        oracle: Oracle, tmp_path: Path, reap: list[int]) -> None:
    """Issue #25: the verifier SIGKILLed mid-job, and a stranger planting files in the job's verify/ folder.

    The stranger (tests/adversarial/forger.py, a process without the job's key)
    replaces the first pre-step states with zeroed ones and plants a verdict of
    a mismatch for each: before, every rank rolled back and loaded them. Now
    every such file fails the job's MAC and is refused unread. Then the
    verifier is SIGKILLed: rank 0 starts a new one, which verifies the later
    steps. Every loss is the fault-free run's, bit for bit.
    """
    job_dir = tmp_path / "job"
    args = ["--epochs", "2", "--step-seconds", "0.05"]  # test_preempt's 2-rank job: one baseline
    launcher = start_job(job_dir, args, ranks=2, run_args=["--spares", "0", "--job-id", "job", "--verify-every", "1"],
                         reap=reap)
    forger = subprocess.Popen([sys.executable, "-m", "tests.adversarial.forger", str(job_dir / "verify"), "3", "150"],
                              stdout=subprocess.PIPE, env={k: v for k, v in os.environ.items()
                                                           if not k.startswith("UNDYING_")})
    reap.append(forger.pid)
    db = job_dir / "events.db"
    manager_url(job_dir, timeout=90)  # (its log is made by then; a loaded machine starts slowly)
    (started,) = wait_for(lambda: events(db, "verify_started"), 60, "the verifier")
    first = started["pid"]
    wait_for(lambda: (job_dir / "verify" / f"ready-{first}").exists(), 120, "the verifier to be up")
    os.kill(first, signal.SIGKILL)  # as it takes its first requests: the job still owes it the rest
    killed_t = time.time()
    planted = json.loads(forger.communicate(timeout=180)[0])
    assert len(planted["states"]) == 3, planted
    assert launcher.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-3000:]

    run = load_run(db)
    assert not [i for i in run.incidents if i["kind"] == "sdc"], run.incidents  # no forged verdict acted on
    refused = events(db, "verify_refused")
    assert refused and all("refused, not loaded" in e["reason"] for e in refused), refused
    (restarted,) = events(db, "verify_restarted")
    assert restarted["old_pid"] == first and restarted["exit"] == "killed by SIGKILL" and restarted["pid"] != first
    # The verifier carries the agent's mark: it never outlives the job (agent/children.py ends what a rank left).
    assert not alive(restarted["pid"]), "the verifier outlived the job"
    with LogReader(db) as reader:
        later = [e for e in reader.events("verify_result") if e.t > killed_t and e.data["passed"]]
        (summary,) = reader.events("verify_summary")
    assert later, "no step was verified by the new verifier"
    assert summary.data["restarts"] == 1 and summary.data["refused"] >= 1 and not summary.data["gave_up"]
    assert summary.data["mismatched"] == 0, summary.data
    comparison = compare_runs(oracle.baseline(args, 2), run)
    assert comparison.identical and comparison.lost_steps == 0 and not run.rerun_steps, comparison.reasons
    # The end summary says how many steps went unverified, and that the verifier was restarted; so does status.
    said = (tmp_path / "job.log").read_text(errors="replace")
    unverified = summary.data["skipped"] + summary.data["not_done"] + summary.data["errors"]
    assert (f"verification: every 1 step: {summary.data['verified']} verified (0 mismatched), {unverified} not "
            "verified") in said and "the verifier was restarted 1 time" in said, said[-3000:]
    shown = subprocess.run([sys.executable, "-m", "undying", "status", "--job-dir", str(job_dir), "--json"],
                           capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(shown.stdout)["verification"]["unverified"] == unverified
