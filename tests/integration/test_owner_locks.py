"""One job per checkpoint dir, one launcher per job dir, and a relaunch that says what it re-runs (#25 items 11, 13).

Before: a second job on a running job's ``--checkpoint-dir`` ran, both exited 0,
and each destroyed the other's checkpoints; a second launcher on a live job dir
set the first's log aside and died with a 38-line traceback; a relaunch after
the newest checkpoints were deleted re-ran steps the log shows committed and
said nothing. Real launchers, real SIGKILL, real files, and the oracle.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from tests.integration.jobs import events, manager_url, start_job, wait_running
from tests.oracle import Oracle
from undying.checkpoint import scan
from undying.cli.demo import load_preempted
from undying.demo.oracle import compare_runs

# The losses do not depend on --step-seconds: the baseline is test_checkpoints.py's (ARGS there, cached).
BASELINE_ARGS = ["--epochs", "2", "--step-seconds", "0.05"]
SCRIPT_ARGS = ["--epochs", "2", "--step-seconds", "0.15"]  # (time for the refusals while it runs)
RELAUNCH_ARGS = ["--epochs", "2", "--step-seconds", "0.02"]


def _one_line(process: subprocess.Popen[bytes], log: Path) -> str:
    assert process.wait(timeout=60) == 2, log.read_text()[-3000:]
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("undying: error: "), lines
    return lines[0]


def test_a_second_job_or_launcher_is_refused_and_a_relaunch_says_what_it_re_runs(
    tmp_path: Path, reap: list[int], oracle: Oracle
) -> None:
    ckpts, job_dir = tmp_path / "ckpts", tmp_path / "job"
    args = ["--spares", "0", "--job-id", "owner", "--checkpoint-dir", str(ckpts), "--save-every", "4"]
    first = start_job(job_dir, SCRIPT_ARGS, ranks=2, reap=reap, run_args=args)
    manager_url(job_dir)  # (its manager.json is written once it holds both folders)

    # While it runs: another job on its checkpoint dir, and another launcher on its job dir (both at once).
    other = start_job(tmp_path / "other", SCRIPT_ARGS, ranks=2, reap=reap,
                      run_args=["--spares", "0", "--job-id", "other", "--checkpoint-dir", str(ckpts)])
    (tmp_path / "alias").symlink_to(job_dir)  # (another name for the same folder: its own log file here)
    again = start_job(tmp_path / "alias", SCRIPT_ARGS, ranks=2, reap=reap, run_args=["--spares", "0", "--job-id", "owner"])
    line = _one_line(other, tmp_path / "other.log")
    assert f"checkpoint dir {ckpts} is in use by job owner (pid {first.pid} on host" in line, line
    assert "--checkpoint-dir" in line and not (tmp_path / "other").exists(), "the refused job made its job dir"
    line = _one_line(again, tmp_path / "alias.log")
    assert f"job dir {tmp_path / 'alias'} is in use by" in line and f"pid {first.pid}" in line, line
    assert first.poll() is None and not list(job_dir.glob("events.*.db")), "the first launch's log was set aside"

    # The first one, killed with its workers (a lost machine), leaves its lock to the kernel: a relaunch of
    # the same job gets in at once. Its two newest checkpoints are deleted first: the resume re-runs the
    # steps after the third, which the log shows committed, and says so.
    wait_running(manager_url(job_dir), min_step=14)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    found = [c for c in scan(ckpts) if c.valid]
    assert len(found) >= 3, [c.name for c in scan(ckpts)]
    for gone in found[-2:]:
        shutil.rmtree(gone.path)
    relaunch = start_job(job_dir, RELAUNCH_ARGS, ranks=2, reap=reap, run_args=args)
    assert relaunch.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-3000:]

    (resumed,) = events(job_dir / "events.db", "resumed")
    rerun = resumed["rerun"]
    assert resumed["step"] == found[-3].step and rerun["first"] == found[-3].step + 1
    assert rerun["last"] >= found[-1].step  # (steps reach the log in batches: a SIGKILL loses the last few)
    assert rerun["why"] == f"the last launch's checkpoint of step {found[-1].step} is gone from {ckpts} (deleted or moved)"
    text = (tmp_path / "job.log").read_text()
    words = f"re-runs {rerun['steps']} step(s) (steps {rerun['first']}..{rerun['last']}) the last launch committed"
    assert f"resuming from checkpoint {found[-3].path}" in text and words in text, text[-3000:]
    assert f"this launch {words}" in text, "the end summary does not say it"
    merged, _ = load_preempted(job_dir, 0.0)
    comparison = compare_runs(oracle.baseline(BASELINE_ARGS, 2), merged)
    assert comparison.mismatched_steps == [] and comparison.missing_steps == [] and comparison.digests_equal
    assert not (ckpts / "undying.lock").exists() and not (job_dir / "undying.lock").exists()
