"""Preemption end to end: the demo's front door, a rank too slow for the grace period, the job check on resume.

Real launchers, real SIGTERM and SIGKILL, real files. Every resumed run is
compared with the fault-free run of the same arguments (the oracle).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pty
import select
import signal
import threading
import time
from pathlib import Path

from tests.integration.jobs import (
    alive,
    events,
    job_table,
    manager_url,
    run_demo_json,
    start_job,
    wait_for,
    wait_running,
)
from tests.oracle import Oracle
from undying.checkpoint import scan
from undying.cli.client import api_post
from undying.cli.demo import load_preempted, run_job
from undying.config import EXIT_PREEMPTED, EXIT_PREEMPTED_BEHIND
from undying.demo.oracle import compare_runs, load_run

# 2 ranks, 32 steps an epoch; steps of at least 50 ms (the same job as test_checkpoints: one baseline).
ARGS = ["--epochs", "2", "--step-seconds", "0.05"]


# -- the front door ---------------------------------------------------------------


def test_demo_fault_preempt_json_keeps_the_demo_contract(tmp_path: Path, reap: list[int]) -> None:
    """`undying demo --fault preempt --json`: one JSON object, a preempt incident dumped and resumed, nothing lost."""
    result, stderr = run_demo_json(["--fault", "preempt", "--epochs", "1", "--keep"], tmp_path, reap,
                           timeout=240)  # ~40 s on a quiet machine

    # The contract every fault shares (issue #3).
    assert result["fault"] == "preempt"
    assert result["identical"] is True and result["final_state_identical"] is True
    assert result["lost_steps"] == 0
    assert result["steps"] == 128  # one epoch of the seeded job
    assert result["ok"] is True and result["reasons"] == []
    assert result["exit_codes"] == {"fault_free": 0, "preempted": EXIT_PREEMPTED, "with_fault": 0}
    (incident,) = result["incidents"]
    assert {"kind", "rank", "step", "action", "status", "mttr_s", "phases"} <= set(incident)
    assert incident["kind"] == "preempt" and incident["action"] == "dump" and incident["status"] == "recovered"
    assert incident["step"] >= 10  # SIGTERM once the job was at step 10
    phases = incident["phases"]
    order = ["detected", "decided", "checkpoint_written", "exited", "relaunched", "state_restored", "first_step_done"]
    assert list(phases) == order, phases
    times = [phases[p] for p in order]
    assert all(t >= 0 for t in times) and times == sorted(times), phases
    assert incident["mttr_s"] == phases["first_step_done"] > 0

    # What the JSON claims is on disk: the dying gasp of the step the resumed launch started from.
    with_fault = Path(result["job_dirs"]["with_fault"])
    assert with_fault.is_relative_to(tmp_path)
    (resumed,) = events(with_fault / "events.db", "resumed")
    gasp = [c for c in scan(with_fault / "checkpoints") if c.kind == "dying-gasp"]
    assert [c.step for c in gasp] == [resumed["step"]] and gasp[0].valid
    assert resumed["kind"] == "dying-gasp" and resumed["step"] >= 10
    assert "identical" in stderr or "SIGTERM" in stderr  # the human-readable part went to stderr


# -- the grace period runs out ----------------------------------------------------


def _checkpoint_files(root: Path) -> dict[str, str]:
    """Every file under every committed ``step-*`` folder, with its sha256: "untouched" made exact."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for d in sorted(root.glob("step-*")) for p in sorted(d.rglob("*")) if p.is_file()
    }


def _slow_down_rank_1(url: str, db: Path) -> int:
    """Rank 1's forward pass takes 100x as long from its next step on (~5 s); returns that step.

    The step the job then agrees to stop at cannot finish within a 2 s grace
    period, on rank 1 nor on rank 0 that waits for it in the step's first
    all-reduce. Through the API, as `undying inject slow --rank 1 --factor 100`
    does: the CLI's own start-up takes seconds here, the whole job a few.
    """
    api_post(url, "/api/inject", {"kind": "slow", "rank": 1, "factor": 100, "phase": "compute"})
    (slowed,) = wait_for(lambda: [e for e in events(db, "fault_injected") if e.get("kind") == "slow"], 30,
                         "the slowdown")
    return int(slowed["step"])


def test_a_rank_too_slow_for_the_grace_period_is_killed_and_the_last_checkpoint_stands(
    tmp_path: Path, reap: list[int], oracle: Oracle
) -> None:
    job_dir = tmp_path / "job"
    run_args = ["--spares", "0", "--job-id", "job", "--save-every", "5", "--grace-period", "2"]
    launcher = start_job(job_dir, ARGS, ranks=2, run_args=run_args, reap=reap)
    url = manager_url(job_dir)
    running = wait_running(url, min_step=11)
    workers = [r["pid"] for r in running["ranks"]]
    reap.extend(workers)
    db = job_dir / "events.db"
    at_step = _slow_down_rank_1(url, db)
    # Rank 1 is in its long step; the last save that was due before it is written.
    saved_step = (at_step - 1) // 5 * 5
    wait_for(lambda: saved_step in [e["step"] for e in events(db, "checkpoint_saved")], 10,
             f"the periodic checkpoint of step {saved_step}")
    before = _checkpoint_files(job_dir / "checkpoints")
    assert before, "no periodic checkpoint was written"
    sigterm_t = time.time()
    os.kill(launcher.pid, signal.SIGTERM)
    rc = launcher.wait(timeout=30)
    took = time.time() - sigterm_t
    log = (tmp_path / "job.log").read_text(errors="replace")
    # Finding 6 (#14): 75 promises a resume loses nothing; this checkpoint is older than the stop step.
    assert rc == EXIT_PREEMPTED_BEHIND, f"exit {rc}\n{log[-3000:]}"
    assert took < 2 + 5, f"the launcher took {took:.1f}s after SIGTERM with a grace period of 2 s"
    wait_for(lambda: not any(alive(p) for p in workers), 10, "every worker to be gone")

    # Said what happened: the grace period ran out, who was still running, no dying gasp, what stands.
    (exceeded,) = events(db, "grace_exceeded")
    # Rank 1 sleeps in its forward pass, rank 0 waits for it in the step's first all-reduce: neither makes it.
    assert exceeded["grace_period_s"] == 2 and exceeded["step"] == at_step and exceeded["ranks"] == [0, 1], exceeded
    job = job_table(db)
    assert job["state"] == "preempted"
    reason = job["exit_reason"]
    assert reason == (
        f"preempted, checkpoint at step {saved_step} (the dying gasp of step {at_step} was not taken (ranks 0, 1 "
        f"still running when the grace period of 2.0s ran out, killed); the latest valid checkpoint "
        f"step-{saved_step:09d} (periodic) stands: steps {saved_step + 1}..{at_step - 1} will be re-run); "
        "run the same command to resume"
    ), reason
    preemption = job["preemption"]
    assert preemption["checkpoint_step"] == saved_step and preemption["checkpoint"].endswith(f"step-{saved_step:09d}")
    assert preemption["killed_ranks"] == [0, 1] and preemption["dying_gasp_write_s"] is None
    (incident,) = [i for i in load_run(db).incidents if i["kind"] == "preempt"]
    assert incident["status"] == "dumped" and incident["action"] == "dump"
    assert incident["detail"]["checkpoint_step"] == saved_step and incident["detail"]["killed_ranks"] == [0, 1]
    assert "checkpoint_written" not in incident["phases"]
    # Killed at the deadline: SIGKILL, no handler run.
    exits = {e["pid"]: e["returncode"] for e in events(db, "exited")}
    assert {exits[p] for p in workers} == {-signal.SIGKILL}, exits

    # The previous checkpoints are untouched, and no dying gasp was committed.
    assert _checkpoint_files(job_dir / "checkpoints") == before
    found = scan(job_dir / "checkpoints")
    assert [c.kind for c in found if c.valid][-1] == "periodic" and found[-1].step == saved_step

    # The same command again resumes from the latest valid checkpoint; every loss is the uninterrupted run's.
    assert run_job(job_dir, ARGS, ranks=2, extra_run_args=run_args) == 0, (tmp_path / "job.log").read_text()[-3000:]
    (resumed,) = events(db, "resumed")
    assert resumed["step"] == saved_step and resumed["kind"] == "periodic"
    merged, _ = load_preempted(job_dir, sigterm_t)
    comparison = compare_runs(oracle.baseline(ARGS, 2), merged)
    assert comparison.mismatched_steps == [] and comparison.missing_steps == [] and comparison.digests_equal
    # The steps committed after the checkpoint were run again, and counted as lost.
    assert merged.rerun_steps == list(range(saved_step + 1, at_step))
    assert comparison.lost_steps == at_step - 1 - saved_step



def test_with_no_checkpoint_at_all_the_grace_period_kill_exits_143(tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, ARGS, ranks=2, reap=reap,
                         run_args=["--spares", "0", "--job-id", "job", "--grace-period", "2"])
    url = manager_url(job_dir)
    workers = [r["pid"] for r in wait_running(url, min_step=4)["ranks"]]
    reap.extend(workers)
    db = job_dir / "events.db"
    at_step = _slow_down_rank_1(url, db)
    os.kill(launcher.pid, signal.SIGTERM)
    rc = launcher.wait(timeout=30)
    assert rc == 143, f"exit {rc}\n{(tmp_path / 'job.log').read_text(errors='replace')[-3000:]}"
    wait_for(lambda: not any(alive(p) for p in workers), 10, "every worker to be gone")
    job = job_table(db)
    assert job["state"] == "preempted"
    assert job["exit_reason"] == (
        f"preempted, no checkpoint: the dying gasp of step {at_step} was not taken (ranks 0, 1 still running when "
        "the grace period of 2.0s ran out, killed) and there is no checkpoint"
    ), job["exit_reason"]
    assert job["preemption"]["checkpoint_step"] == -1 and job["preemption"]["killed_ranks"] == [0, 1]
    (incident,) = [i for i in load_run(db).incidents if i["kind"] == "preempt"]
    assert incident["status"] == "failed"
    assert not [c for c in scan(job_dir / "checkpoints") if c.valid]


# -- the job check on resume ------------------------------------------------------


def test_another_jobs_checkpoint_is_refused_under_a_given_job_id_and_resumed_without_one(
    tmp_path: Path, reap: list[int]
) -> None:
    """Two jobs, one checkpoint folder: `--job-id b` refuses job a's checkpoint; no --job-id resumes it, and says so."""
    ckpts = tmp_path / "ckpts"
    common = ["--spares", "0", "--checkpoint-dir", str(ckpts), "--save-every", "8"]
    first = start_job(tmp_path / "a", ["--epochs", "1"], ranks=2, reap=reap, run_args=[*common, "--job-id", "a"])
    assert first.wait(timeout=90) == 0, (tmp_path / "a.log").read_text()[-3000:]
    before = _checkpoint_files(ckpts)
    (latest,) = [c for c in scan(ckpts) if c.valid][-1:]
    assert latest.manifest is not None and latest.manifest.job_id == "a" and latest.step == 32

    refused = start_job(tmp_path / "b", ["--epochs", "2"], ranks=2, reap=reap, run_args=[*common, "--job-id", "b"])
    assert refused.wait(timeout=60) == 2
    errors = [line for line in (tmp_path / "b.log").read_text().splitlines() if line.startswith("undying: error")]
    assert errors == [
        f"undying: error: checkpoint {latest.url} (step 32) belongs to job 'a', not to this job 'b'; "
        "pass --job-id a to resume it, or another --checkpoint-dir to start fresh"
    ], (tmp_path / "b.log").read_text()[-3000:]
    # Refused before any rank started, and undone: the refused launch left no event log behind (issue #25).
    assert not (tmp_path / "b" / "events.db").exists()
    assert _checkpoint_files(ckpts) == before

    # No --job-id: the id is random per launch, so the folder's checkpoint is this command's to continue.
    resumed = start_job(tmp_path / "c", ["--epochs", "2"], ranks=2, reap=reap, run_args=common)
    assert resumed.wait(timeout=90) == 0, (tmp_path / "c.log").read_text()[-3000:]
    log = (tmp_path / "c.log").read_text()
    assert f"resuming job a's checkpoint at step 32 ({latest.url}) as job job-" in log, log[-3000:]
    (event,) = events(tmp_path / "c" / "events.db", "resumed")
    assert event["step"] == 32 and event["job_id"] == "a"
    assert [c.step for c in scan(ckpts) if c.valid][-1] == 64  # and it trained on: epoch 2


# -- the terminal hangs up (issue #25 item 3) ----------------------------------------------


class _Terminal:
    """A real pseudo-terminal whose other end the test holds, read in a thread (nothing blocks on a full one)."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        self.said = bytearray()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if select.select([self.master], [], [], 0.05)[0]:
                try:
                    self.said += os.read(self.master, 65536)
                except OSError:
                    return

    def hang_up(self) -> None:
        """Close the terminal (as a closed window or a dropped ssh session does): the kernel sends SIGHUP."""
        self._stop.set()
        self._reader.join(timeout=5)
        os.close(self.master)

    def close(self) -> None:
        if not self._stop.is_set():
            self.hang_up()
        with contextlib.suppress(OSError):
            os.close(self.slave)


def test_a_hung_up_terminal_preempts_with_a_dying_gasp_and_the_resume_is_identical(
    tmp_path: Path, reap: list[int], oracle: Oracle
) -> None:
    """The launcher's controlling terminal closes mid-run: SIGHUP is a preemption, as SIGTERM is.

    The ranks agree on a stop step, rank 0 writes the dying gasp, exit 75;
    every write to the dead terminal fails (EIO) and none aborts it: the rest
    of the launcher's output goes to <job dir>/launcher.log. The same command
    resumes, and every step's loss is the uninterrupted run's.
    """
    job_dir = tmp_path / "job"
    run_args = ["--spares", "0", "--job-id", "job"]
    terminal = _Terminal()
    try:
        launcher = start_job(job_dir, ARGS, ranks=2, run_args=run_args, reap=reap, tty=terminal.slave)
        os.close(terminal.slave)  # the launcher and its ranks hold it now; the test holds only the master
        url = manager_url(job_dir, timeout=90)  # (a loaded machine starts slowly)
        workers = [r["pid"] for r in wait_running(url, min_step=10)["ranks"]]
        reap.extend(workers)
        assert b"undying: job job started" in terminal.said  # it did write to the terminal
        hangup_t = time.time()
        terminal.hang_up()
        rc = launcher.wait(timeout=60)
    finally:
        terminal.close()
    log_file = job_dir / "launcher.log"
    after = log_file.read_text(errors="replace") if log_file.exists() else ""
    assert rc == EXIT_PREEMPTED, f"exit {rc}\n{after[-3000:]}\n{bytes(terminal.said)[-2000:]!r}"
    wait_for(lambda: not any(alive(p) for p in workers), 10, "every worker to be gone")
    db = job_dir / "events.db"
    job = job_table(db)
    assert job["state"] == "preempted" and job["preemption"]["reason"] == "SIGHUP to the launcher", job["preemption"]
    gasp = [c for c in scan(job_dir / "checkpoints") if c.kind == "dying-gasp"]
    assert [c.step for c in gasp] == [job["preemption"]["checkpoint_step"]] and gasp[0].valid
    # What it said after the hang-up is in the job dir, down to the last line (the resume hint).
    assert "SIGHUP (the terminal hung up): preempted, taking the dying gasp" in after and "run the same command to resume" in after, after[-3000:]
    assert "undying: job job preempted" in after, after[-3000:]  # the end summary

    assert run_job(job_dir, ARGS, ranks=2, extra_run_args=run_args) == 0, (tmp_path / "job.log").read_text()[-3000:]
    (resumed,) = events(db, "resumed")
    assert resumed["kind"] == "dying-gasp" and resumed["step"] == gasp[0].step >= 10
    merged, _ = load_preempted(job_dir, hangup_t)
    comparison = compare_runs(oracle.baseline(ARGS, 2), merged)
    assert comparison.identical and comparison.lost_steps == 0 and not merged.rerun_steps, comparison.reasons


def test_under_nohup_a_hang_up_leaves_the_job_running_to_its_end(
    tmp_path: Path, reap: list[int], oracle: Oracle
) -> None:
    """`nohup undying run ...`: the launcher starts with SIGHUP ignored, and it stays ignored (as the user
    asked: the job outlives its terminal). A hang-up (SIGHUP to the launcher's whole session, ranks and all)
    mid-run neither preempts the job nor loses a rank: it ends succeeded, every loss the uninterrupted run's."""
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, ARGS, ranks=2, run_args=["--spares", "0", "--job-id", "job"], reap=reap,
                         ignoring=(signal.SIGHUP,))
    url = manager_url(job_dir, timeout=90)
    running = wait_running(url, min_step=10)
    reap.extend(r["pid"] for r in running["ranks"])
    os.killpg(launcher.pid, signal.SIGHUP)  # (start_new_session: its group is its session, the terminal's reach)
    rc = launcher.wait(timeout=120)
    said = (tmp_path / "job.log").read_text(errors="replace")
    assert rc == 0, f"exit {rc}\n{said[-3000:]}"
    job = job_table(job_dir / "events.db")
    assert job["state"] == "succeeded" and "preemption" not in job, job
    run = load_run(job_dir / "events.db")
    assert run.incidents == [], run.incidents
    comparison = compare_runs(oracle.baseline(ARGS, 2), run)
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons
