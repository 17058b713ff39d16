"""Finding 5, "A relaunch deletes the killed run's log", and the interrupted state of finding 9.

Before: ``JobDir.prepare`` set the old ``events.db`` aside and unlinked its
``-wal`` and ``-shm``. After a launcher SIGKILL the events still in the WAL were
in no other file, so a relaunch erased them; and ``undying status`` on the
killed job said "running" forever. Now the relaunch archives the log whole (the
WAL folded in, nothing deleted), ``undying status`` lists the earlier launch, and
a log whose launcher is gone reads "interrupted" with how to resume.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.integration.jobs import manager_url, start_job, wait_running

SCRIPT_ARGS = ["--epochs", "3", "--step-seconds", "0.05"]


def _all_events(db: Path) -> list[tuple[int, str, str]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute("SELECT id, kind, data FROM events ORDER BY id").fetchall()
    finally:
        con.close()


def _status(job_dir: Path) -> tuple[dict[str, object], str]:
    argv = [sys.executable, "-m", "undying", "status", "--job-dir", str(job_dir)]
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60, check=True)
    text = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "COLUMNS": "200"})
    return json.loads(as_json.stdout), text.stdout


def test_a_relaunch_after_a_launcher_sigkill_keeps_every_event_and_status_shows_both(
    tmp_path: Path, reap: list[int]
) -> None:
    job_dir = tmp_path / "job"
    args = ["--spares", "0", "--job-id", "kept", "--save-every", "10"]
    first = start_job(job_dir, SCRIPT_ARGS, ranks=2, reap=reap, run_args=args)
    wait_running(manager_url(job_dir), min_step=25)
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and every worker, as a lost machine would
    first.wait(timeout=30)
    assert (job_dir / "events.db-wal").exists()  # events the killed launcher had in its WAL only
    before = _all_events(job_dir / "events.db")
    assert any(kind == "generation_opened" for _, kind, _ in before) and len(before) >= 5

    status, text = _status(job_dir)
    assert status["state"] == "interrupted", status
    assert "run the same `undying run` command again" in str(status["exit_reason"])
    assert "interrupted" in text

    second = start_job(job_dir, SCRIPT_ARGS, ranks=2, reap=reap, run_args=args)
    assert second.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-3000:]
    (archived,) = sorted(job_dir.glob("events.*.db"))
    assert _all_events(archived) == before, "the relaunch lost events of the killed launch"

    status, text = _status(job_dir)
    assert status["state"] == "succeeded"
    (earlier,) = status["earlier_runs"]  # type: ignore[misc]
    assert earlier["log"] == archived.name and earlier["state"] == "interrupted"
    assert earlier["events"] == len(before) and earlier["step"] >= 20  # steps reach the log in batches
    assert f"earlier launch in this job dir: {archived.name}: interrupted" in text
