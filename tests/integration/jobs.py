"""Starting ``undying run`` in the background for tests that interact with a live job."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from undying.cli.client import api_get
from undying.demo import TRAIN_SCRIPT
from undying.jobdir import JobDir


def start_job(job_dir: Path, script_args: list[str], *, ranks: int = 4, run_args: list[str] | None = None,
              script: Path = TRAIN_SCRIPT, reap: list[int]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "undying", "run", "-n", str(ranks), "--port", "0", "--job-dir", str(job_dir),
            "--stop-grace", "3", *(run_args or []), str(script), *script_args]
    log = open(job_dir.parent / f"{job_dir.name}.log", "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    reap.append(process.pid)
    return process


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


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
