"""Starting ``undying run`` in the background for tests that interact with a live job."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

from undying.cli.client import api_get
from undying.demo import TRAIN_SCRIPT
from undying.demo.cluster import wait_for
from undying.jobfiles.jobdir import JobDir

__all__ = ["start_job", "wait_for", "manager_url", "status", "wait_running", "alive", "events", "rank_events",
           "job_table",
           "run_demo_json"]


def start_job(job_dir: Path, script_args: list[str], *, ranks: int = 4, run_args: list[str] | None = None,
              script: Path = TRAIN_SCRIPT, reap: list[int], tty: int | None = None,
              ignoring: tuple[signal.Signals, ...] = ()) -> subprocess.Popen[bytes]:
    """``undying run`` in the background, its output in ``<job dir>.log`` (or on ``tty``, a terminal's fd),
    started with ``ignoring``'s signals ignored (as `nohup` ignores SIGHUP)."""
    argv = [sys.executable, "-m", "undying", "run", "-n", str(ranks), "--port", "0", "--job-dir", str(job_dir),
            "--stop-grace", "3", *(run_args or []), str(script), *script_args]
    log = open(job_dir.parent / f"{job_dir.name}.log", "wb") if tty is None else tty  # noqa: SIM115

    def in_the_child() -> None:
        # On a terminal: it is the controlling terminal of the launcher's session, as in a shell (its close is a
        # hang-up).
        if tty is not None:
            fcntl.ioctl(1, termios.TIOCSCTTY, 0)
        for sig in ignoring:
            signal.signal(sig, signal.SIG_IGN)

    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL if tty is not None else None, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=None if tty is None and not ignoring else in_the_child)
    reap.append(process.pid)
    return process


def events(db: Path, kind: str) -> list[dict[str, Any]]:
    """Every event of ``kind`` in a job's log, oldest first."""
    con = sqlite3.connect(db)
    try:
        return [json.loads(d) for (d,) in con.execute("SELECT data FROM events WHERE kind = ? ORDER BY id", (kind,))]
    finally:
        con.close()


def rank_events(db: Path, kind: str) -> list[dict[str, Any]]:
    """Every event of ``kind``, oldest first, each with its ``rank`` and ``generation`` (columns of the log,
    not of the event's data)."""
    con = sqlite3.connect(db)
    try:
        return [{"rank": rank, "generation": generation, **json.loads(data)} for rank, generation, data in
                con.execute("SELECT rank, generation, data FROM events WHERE kind = ? ORDER BY id", (kind,))]
    finally:
        con.close()


def job_table(db: Path) -> dict[str, Any]:
    """A job's key/value facts (state, exit reason, preemption, ...)."""
    con = sqlite3.connect(db)
    try:
        return {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM job")}
    finally:
        con.close()


def manager_url(job_dir: Path, timeout: float = 30) -> str:
    return str(wait_for(lambda: (JobDir(job_dir).read_manager() or {}).get("url"), timeout, "the manager"))


def status(url: str) -> dict[str, Any]:
    return dict(api_get(url, "/api/status"))


def wait_running(url: str, min_step: int = 1, timeout: float = 60) -> dict[str, Any]:
    return dict(wait_for(
        lambda: (s := status(url))["state"] == "running" and s["step"] >= min_step and s,
        timeout, f"the job to run past step {min_step}",
    ))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def run_demo_json(args: list[str], root: Path, reap: list[int], *, timeout: float) -> tuple[dict[str, Any], str]:
    """`undying demo ARGS --json` on one host, its job dirs under ``root``, to its end within ``timeout``:
    its one JSON object, once it exited 0 and printed nothing else on stdout, and its stderr."""
    env = {**os.environ, "TMPDIR": str(root)}  # the demo's job dirs land here and go with the test
    process = subprocess.Popen([sys.executable, "-m", "undying", "demo", *args, "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env, start_new_session=True)
    reap.append(process.pid)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_demo(process, root)
        raise
    stdout, stderr = out.decode(), err.decode(errors="replace")
    assert process.returncode == 0, f"demo exited {process.returncode}\nstdout: {stdout}\nstderr: {stderr[-3000:]}"
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must hold exactly one JSON object, got {stdout!r}"
    result: dict[str, Any] = json.loads(lines[0])
    return result, stderr


def _stop_demo(process: subprocess.Popen[bytes], root: Path) -> None:
    """A demo past its time: Ctrl-C has it kill the launcher it runs; a launcher left behind is killed by PID.

    Each launcher runs in a session of its own (so reaping the demo's misses
    it) and takes its workers with it when it dies.
    """
    process.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    for manager_file in root.glob("undying-demo-*/*/manager.json"):
        pid = (JobDir(manager_file.parent).read_manager() or {}).get("pid")
        if isinstance(pid, int):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
