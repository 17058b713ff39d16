"""Goodput, progress, the end summary and the step export of a real job with one SIGKILL (2 ranks).

One seeded job, a rank killed in its backward pass at step 20, recovered with
losses identical to the fault-free run (the oracle). Its goodput and named
losses add up to the job's wall time as its log records it, each loss agrees
with the incident's own timeline and the saves' stalls, and what `undying run`
printed and `undying status` shows say the same.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tests.integration.jobs import manager_url, start_job, wait_running
from tests.oracle import Oracle, Outcome, crash
from undying.cli.status import watch
from undying.cli.summary import end_summary, logged_account
from undying.jobfiles.events import LogReader

SCRIPT_ARGS = ("--epochs", "2", "--step-seconds", "0.02")  # 64 steps of at least 20 ms; the losses are the unpaced run's
RUN_ARGS = ("--spares", "0", "--save-every", "16")  # a cold replacement (a wait for it) and checkpoint stalls


@pytest.fixture
def crashed(oracle: Oracle) -> Outcome:
    """The one job (of the session, not of each worker) that these tests read."""
    return oracle.shared_survival([crash(1, 20, "backward")], ranks=2, script_args=SCRIPT_ARGS,
                                  extra_run_args=RUN_ARGS)


def _facts(db: Path) -> dict[str, Any]:
    con = sqlite3.connect(db)
    try:
        return {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM job")}
    finally:
        con.close()


def _first_step_done(db: Path) -> float:
    with LogReader(db) as reader:
        return max(c.t for c in reader.commits_of_step(1) if c.generation == 0)


def test_goodput_and_its_named_losses_add_up_to_the_wall_time(crashed: Outcome) -> None:
    db = crashed.job_dir / "events.db"
    facts = _facts(db)
    wall = facts["ended_at"] - facts["started_at"]
    g = logged_account(db).goodput.to_dict()
    losses = g["losses"]
    assert g["wall_s"] == pytest.approx(wall, abs=0.01)
    assert abs(g["goodput_s"] + sum(losses.values()) - wall) <= 0.02 * wall, g
    # Each named loss agrees with what the job recorded elsewhere.
    (incident,) = crashed.incidents
    phases = incident["phases"]
    (cost,) = g["incidents"]
    assert cost["id"] == incident["id"] and cost["detection_s"] == pytest.approx(phases["detected"], abs=0.002)
    assert cost["spare_wait_s"] == pytest.approx(phases["replacement_ready"] - phases["decided"], abs=0.002)
    restored = max(phases["group_rebuilt"], phases["state_restored"], phases["replacement_ready"])
    assert cost["recovery_s"] == pytest.approx(phases["decided"] - phases["detected"]
                                               + restored - phases["replacement_ready"], abs=0.002)
    assert cost["spare_wait_s"] > 0, "a replacement with no spare ready (--spares 0) is waited for"
    assert 0 < cost.get("rerun_s", 0.0) < 1.0, "the step in flight at the kill was lost"
    stalls = sum(e["blocking_s"] for e in crashed.events("checkpoint_saved"))
    assert stalls > 0 and losses["checkpoint"] == pytest.approx(stalls, abs=0.002)
    assert losses["startup"] == pytest.approx(_first_step_done(db) - facts["started_at"], abs=0.002)
    assert losses["shutdown"] > 0 and losses["in_flight"] == 0 and losses["preemption"] == 0
    # The steps that count: 63 paced steps after the first (which is start-up's), less than all the rest.
    assert 63 * 0.02 <= g["goodput_s"] < wall - losses["startup"]
    assert g["ratio"] == pytest.approx(g["goodput_s"] / g["wall_s"], abs=1e-3)


def test_progress_and_the_last_values_of_the_finished_job(crashed: Outcome) -> None:
    progress = logged_account(crashed.job_dir / "events.db").progress
    assert (progress.step, progress.total_steps, progress.epoch, progress.epochs) == (64, 64, 1, 2)
    assert progress.values_step == 64
    assert progress.values["loss"] == pytest.approx(crashed.run.losses[64], rel=1e-6)
    assert progress.eta_s is None and progress.steps_per_s is None  # it ended


def test_the_end_summary_and_the_banner_say_how_the_job_went(crashed: Outcome) -> None:
    lines = end_summary(crashed.job_dir)
    assert all(len(line) <= 80 or len(line.split()) == 1 for line in lines), lines
    text = " ".join(" ".join(lines).split())  # (an entry wider than 80 columns goes on over lines)
    assert lines[0].startswith(f"undying: job {crashed.job_dir.name} succeeded: step 64 of 64, wall time ")
    assert "goodput " in text and "lost: " in text and "start-up" in text
    assert "incidents: 1, 1 recovered, mean MTTR" in text and "#1 crash of rank 1 at step 20: replace" in text
    assert "steps re-run: 0" in text
    assert f"checkpoints: {crashed.job_dir / 'checkpoints'} (newest: step 64" in text
    assert f"details: undying status --job-dir {crashed.job_dir}" in text
    printed = crashed.log()  # what `undying run` wrote: the banner first, the same summary last
    assert f"undying: job {crashed.job_dir.name} started, 2 ranks" in printed
    assert f"status: undying status --job-dir {crashed.job_dir}" in " ".join(printed.split())
    assert "status page: http://127.0.0.1:" in printed
    assert lines[0] in printed and lines[-1] in printed
    # The launcher's own verdict stays the last line (a resume's count of re-run steps is read there).
    assert f"job {crashed.job_dir.name} succeeded: 2 ranks" in printed.strip().splitlines()[-1]


def _status(job_dir: Path, *args: str, columns: int = 80) -> str:
    argv = [sys.executable, "-m", "undying", "status", "--job-dir", str(job_dir), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": str(columns)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_status_of_the_finished_job_at_80_columns_and_its_step_export(crashed: Outcome) -> None:
    text = _status(crashed.job_dir)
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    assert "progress: step 64 of 64 (100%), epoch 2 of 2" in text and "goodput " in text
    assert "#1 cost in wall time: " in text
    rows = list(csv.DictReader(io.StringIO(_status(crashed.job_dir, "--steps"))))
    assert len(rows) == 64 * 2 and {r["rank"] for r in rows} == {"0", "1"}
    losses = {int(r["step"]): float(r["loss"]) for r in rows if r["rank"] == "0"}
    assert losses == pytest.approx(crashed.run.losses, rel=1e-6)
    exported = json.loads(_status(crashed.job_dir, "--steps", "--json"))["steps"]
    assert [(r["step"], r["rank"]) for r in exported] == [(int(r["step"]), int(r["rank"])) for r in rows]
    status = json.loads(_status(crashed.job_dir, "--json"))
    assert status["progress"]["step"] == 64 and status["goodput"]["ratio"] > 0
    assert len(status["step_values"]) == 64 * 2


def test_watch_follows_a_live_job_with_its_progress_to_its_end(tmp_path: Path, reap: list[int]) -> None:
    """`undying status --watch` on a real job: rate and ETA while it runs, a bar, and it ends when the job does."""
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, ["--epochs", "3", "--step-seconds", "0.05"], ranks=2, run_args=["--spares", "0"],
                         reap=reap)
    wait_running(manager_url(job_dir), min_step=2)
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)  # every frame, as a terminal
    assert watch(str(job_dir), None, console, interval=0.2) == 0
    assert launcher.wait(timeout=60) == 0
    frames = out.getvalue()
    assert "steps/s" in frames and "samples/s" in frames and "ETA " in frames, "a running job's rate and ETA"
    assert "progress: step 96 of 96 (100%), epoch 3 of 3" in frames and "96/96" in frames
    assert "succeeded" in frames and "goodput " in frames
