"""Finding 6 of #14, "A full disk": the checkpoint folder fills while the job runs.

Before: saves failed forever (retention ran only after a success), the dying
gasp failed, the launcher exited 75 "preempted with a checkpoint" from an old
one and the final status said success with no warning. Here the folder is a
real tmpfs of a few MB, filled by a real file while real ranks train:

- a save that finds no room prunes the older checkpoints (never the newest
  valid one) and succeeds;
- with the disk full again, saves fail: a ``checkpoint_failed`` incident with
  the OS error, in the status API and the metrics, while training goes on with
  losses identical to the fault-free run, and the end says so;
- SIGTERM with the disk full: the dying gasp says it could not be written, the
  exit code is not 75, the last line counts the steps a resume re-runs, and the
  resume (disk freed) re-runs exactly those, with identical losses.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.jobs import events, job_table, manager_url, start_job, status, wait_for
from tests.oracle import Oracle
from undying.checkpoint import scan
from undying.cli.demo import load_preempted, run_job
from undying.config import EXIT_PREEMPTED, EXIT_PREEMPTED_BEHIND
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.tokens import auth_headers

# 2 ranks, 64 steps; the losses do not depend on --step-seconds: the fault-free baseline is the one
# tests/integration/test_preempt.py and test_checkpoints.py use (ARGS there), cached per session.
BASELINE_ARGS = ["--epochs", "2", "--step-seconds", "0.05"]
RANKS = 2


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MB tmpfs (about 18 checkpoints of the demo model): a real filesystem that really fills."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (this test fills a real filesystem, not a mock)")
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(disk: Path) -> int:
    """Write one more filler file until the filesystem refuses (ENOSPC); the bytes written."""
    written = 0
    index = len(list(disk.glob("filler-*")))
    with open(disk / f"filler-{index}", "wb", buffering=0) as f:  # unbuffered: close has nothing left to flush
        block = b"\0" * 4096
        try:
            while True:
                written += f.write(block) or 0
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return written


def metrics(url: str) -> str:
    request = urllib.request.Request(url + "/metrics", headers=auth_headers(os.environ["UNDYING_TOKEN"], None))
    with urllib.request.urlopen(request, timeout=5) as response:
        return str(response.read().decode())


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in\n{text}")


def valid_steps(disk: Path) -> list[int]:
    return [c.step for c in scan(disk / "checkpoints") if c.valid]


def test_a_save_that_finds_the_disk_full_prunes_older_checkpoints_first(
    small_disk: Path, tmp_path: Path, reap: list[int], oracle: Oracle
) -> None:
    """Finding 6: retention used to run only after a success, so a full disk failed every save for good."""
    job_dir = tmp_path / "job"
    run_args = ["--spares", "0", "--job-id", "job", "--save-every", "4", "--keep", "3",
                "--checkpoint-dir", str(small_disk / "checkpoints")]
    launcher = start_job(job_dir, ["--epochs", "2", "--step-seconds", "0.1"], ranks=RANKS, run_args=run_args,
                         reap=reap)
    manager_url(job_dir)
    db = job_dir / "events.db"
    wait_for(lambda: len(valid_steps(small_disk)) >= 3, 60, "three checkpoints")
    before = valid_steps(small_disk)
    fill(small_disk)  # nothing left: the next save cannot be written without deleting something

    made = wait_for(lambda: events(db, "checkpoint_room_made")[:1], 30, "a save to make room")[0]
    # The older ones went, the newest valid one stayed, and the save that needed the room was written.
    assert made["removed"] and f"step-{max(before):09d}" not in made["removed"], (made, before)
    assert launcher.wait(timeout=120) == 0, (tmp_path / "job.log").read_text(errors="replace")[-3000:]
    saved = [e["step"] for e in events(db, "checkpoint_saved")]
    assert made["step"] in saved and saved[-1] == 64, saved
    assert not events(db, "checkpoint_failed"), "a save failed although pruning made room"
    assert valid_steps(small_disk)[-1] == 64
    assert (small_disk / "filler-0").exists()  # the disk stayed full all along: pruning made every save fit
    comparison = compare_runs(oracle.baseline(BASELINE_ARGS, RANKS), load_run(db))
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons


def test_saves_that_still_fail_are_an_incident_told_everywhere_and_training_goes_on(
    small_disk: Path, tmp_path: Path, reap: list[int], oracle: Oracle
) -> None:
    """Finding 6: a full disk with nothing left to prune: checkpoint_failed in status, API, metrics and the end."""
    job_dir = tmp_path / "job"
    run_args = ["--spares", "0", "--job-id", "job", "--save-every", "4", "--keep", "1",
                "--checkpoint-dir", str(small_disk / "checkpoints")]
    launcher = start_job(job_dir, ["--epochs", "2", "--step-seconds", "0.15"], ranks=RANKS, run_args=run_args,
                         reap=reap)
    url = manager_url(job_dir)
    db = job_dir / "events.db"
    wait_for(lambda: valid_steps(small_disk), 60, "a checkpoint")
    fill(small_disk)  # with --keep 1 the newest checkpoint is all there is, and it is never deleted

    failed = wait_for(lambda: events(db, "checkpoint_failed")[:1], 30, "a failed save")[0]
    assert failed["os_error"] == "ENOSPC: No space left on device", failed
    live = wait_for(lambda: (s := status(url)) and [i for i in s["incidents"] if i["kind"] == "checkpoint_failed"]
                    and s, 10, "the incident in /api/status")
    (incident,) = [i for i in live["incidents"] if i["kind"] == "checkpoint_failed"]
    assert incident["status"] == "open" and incident["detail"]["os_error"] == "ENOSPC: No space left on device"
    assert live["checkpoints"]["health"]["failing"] is True and live["state"] == "running"
    text = metrics(url)
    assert metric(text, "undying_checkpoint_failing") == 1.0
    assert metric(text, "undying_checkpoint_failures_total") >= 1
    assert metric(text, "undying_incidents_open") >= 1
    kept = valid_steps(small_disk)
    assert len(kept) == 1, kept

    # The job trains on to its end, with the fault-free run's losses; the end says the saves failed.
    assert launcher.wait(timeout=120) == 0, (tmp_path / "job.log").read_text(errors="replace")[-3000:]
    run = load_run(db)
    comparison = compare_runs(oracle.baseline(BASELINE_ARGS, RANKS), run)
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons
    job = job_table(db)
    assert job["state"] == "succeeded"
    assert "; warning: the last " in job["exit_reason"], job["exit_reason"]
    assert "ENOSPC: No space left on device" in job["exit_reason"], job["exit_reason"]
    assert f"the newest checkpoint is of step {kept[0]}, {64 - kept[0]} step(s) before the last" in job["exit_reason"]
    last_line = (tmp_path / "job.log").read_text(errors="replace").strip().splitlines()[-1]
    assert "warning:" in last_line and "checkpoint save attempt(s) failed" in last_line, last_line
    (closed,) = [i for i in run.incidents if i["kind"] == "checkpoint_failed"]
    assert closed["status"] == "failed" and closed["detail"]["failed_saves"] >= 2, closed
    assert valid_steps(small_disk) == kept


def test_sigterm_with_a_full_disk_exits_honestly_and_the_resume_reruns_what_it_said(
    small_disk: Path, tmp_path: Path, reap: list[int], oracle: Oracle
) -> None:
    """Finding 6: the dying gasp that could not be written says so; not exit 75; the count of re-run steps is true."""
    job_dir = tmp_path / "job"
    run_args = ["--spares", "0", "--job-id", "job", "--save-every", "4", "--keep", "1",
                "--checkpoint-dir", str(small_disk / "checkpoints"), "--grace-period", "20"]
    launcher = start_job(job_dir, ["--epochs", "2", "--step-seconds", "0.2"], ranks=RANKS, run_args=run_args,
                         reap=reap)
    url = manager_url(job_dir)
    db = job_dir / "events.db"
    wait_for(lambda: valid_steps(small_disk), 60, "a checkpoint")
    fill(small_disk)  # with --keep 1 there is nothing older to prune: every save from now on fails
    (failed, *_) = wait_for(lambda: events(db, "checkpoint_failed"), 30, "a failed save")
    # A few more steps past the last checkpoint (counted, not slept: 1 s was 5 steps when idle, fewer when busy).
    wait_for(lambda: status(url)["step"] >= failed["step"] + 3, 30, "three steps past the failed save")
    sigterm_t = time.time()
    os.kill(launcher.pid, signal.SIGTERM)
    rc = launcher.wait(timeout=60)
    log = (tmp_path / "job.log").read_text(errors="replace")
    assert rc == EXIT_PREEMPTED_BEHIND != EXIT_PREEMPTED, f"exit {rc}\n{log[-3000:]}"

    job = job_table(db)
    preemption = job["preemption"]
    stop_step, saved = preemption["stop_step"], preemption["checkpoint_step"]
    assert saved >= 4 and stop_step > saved, preemption
    assert "No space left on device" in preemption["dying_gasp_error"], preemption
    assert f"the dying gasp of step {stop_step} could not be written (" in job["exit_reason"], job["exit_reason"]
    reruns = preemption["resume_reruns"]
    assert reruns == stop_step - saved, preemption
    last_line = log.strip().splitlines()[-1]
    assert f"exit {EXIT_PREEMPTED_BEHIND}" in last_line and f"re-runs {reruns} step(s)" in last_line, last_line
    assert valid_steps(small_disk) == [saved], "the checkpoint that stands must be untouched"

    # Room again: the same command resumes from that checkpoint and re-runs exactly the steps it said.
    for filler in small_disk.glob("filler-*"):
        filler.unlink()
    assert run_job(job_dir, ["--epochs", "2", "--step-seconds", "0.05"], ranks=RANKS,
                   extra_run_args=run_args) == 0, (tmp_path / "job.log").read_text(errors="replace")[-3000:]
    merged, _ = load_preempted(job_dir, sigterm_t)
    comparison = compare_runs(oracle.baseline(BASELINE_ARGS, RANKS), merged)
    assert comparison.mismatched_steps == [] and comparison.missing_steps == [] and comparison.digests_equal
    assert merged.rerun_steps == list(range(saved + 1, stop_step + 1)), merged.rerun_steps
    assert comparison.lost_steps == reruns


def test_the_default_layout_a_full_job_dir_loses_no_event_and_the_job_ends(
    small_disk: Path, tmp_path: Path, reap: list[int], oracle: Oracle
) -> None:
    """Finding 6, default layout: the checkpoints live in the job dir, so the disk fills under events.db too.

    SQLite then failed mid-handler and the manager stopped hearing its ranks:
    the job hung. Now the log's writes wait in memory, the job trains on, and
    once there is room again everything is written: the oracle reads every
    step from the log.
    """
    job_dir = small_disk  # the job dir is the small disk; checkpoints in <job dir>/checkpoints, as by default
    run_args = ["--spares", "0", "--job-id", "job", "--save-every", "4", "--keep", "1"]
    launcher = start_job(job_dir, ["--epochs", "2", "--step-seconds", "0.15"], ranks=RANKS, run_args=run_args,
                         reap=reap)
    url = manager_url(job_dir)
    log_path = tmp_path / "disk.log"  # (start_job's log, beside the job dir: off the full disk)
    wait_for(lambda: [c for c in scan(job_dir / "checkpoints") if c.valid], 60, "a checkpoint")
    fill(small_disk)
    wait_for(lambda: "events.db cannot be written" in log_path.read_text(errors="replace"), 30,
             "the event log to meet the full disk")
    live = wait_for(lambda: (s := status(url)) and [i for i in s["incidents"] if i["kind"] == "checkpoint_failed"]
                    and s, 30, "the failed saves in /api/status (served from memory)")
    assert live["state"] == "running"
    # A few steps whose rows are held in memory only (counted, not slept).
    wait_for(lambda: status(url)["step"] >= live["step"] + 3, 30, "three steps held in memory")
    for filler in small_disk.glob("filler-*"):
        filler.unlink()

    assert launcher.wait(timeout=120) == 0, log_path.read_text(errors="replace")[-3000:]
    assert "held write(s) committed after" in log_path.read_text(errors="replace")
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(oracle.baseline(BASELINE_ARGS, RANKS), run)
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons
    assert events(job_dir / "events.db", "checkpoint_failed"), "the failed saves were not written once there was room"
    assert job_table(job_dir / "events.db")["state"] == "succeeded"
