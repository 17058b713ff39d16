"""Finding a job and talking to its manager, for the CLI commands."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from undying.errors import JobNotRunningError, UsageError
from undying.jobdir import JobDir

__all__ = ["add_job_arguments", "resolve_job_dir", "manager_url", "api_get", "api_post"]


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """--job-dir or --manager: how a command finds its job."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--job-dir", help="the job's folder (default: the newest under ./undying-jobs)")
    where.add_argument("--manager", help="the manager's address, HOST:PORT or http://HOST:PORT")


def resolve_job_dir(job_dir: str | None) -> JobDir:
    """The given job dir, or the most recently started one under ./undying-jobs."""
    if job_dir is not None:
        path = Path(job_dir)
        if not path.is_dir():
            raise UsageError(f"job dir {job_dir} does not exist; pass the --job-dir of a job")
        return JobDir(path)
    root = Path.cwd() / "undying-jobs"
    candidates = [p for p in root.glob("*") if (p / "events.db").exists()] if root.is_dir() else []
    if not candidates:
        raise JobNotRunningError(
            "no job found: pass --job-dir or --manager, or run this where `undying run` was started"
        )
    return JobDir(max(candidates, key=lambda p: (p / "events.db").stat().st_mtime))


def manager_url(manager: str | None, job_dir: str | None) -> str:
    if manager is not None:
        return manager if manager.startswith("http") else f"http://{manager}"
    return resolve_job_dir(job_dir).running_manager_url()


def _request(request: urllib.request.Request, timeout: float) -> Any:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", str(e))
        except (json.JSONDecodeError, AttributeError):
            message = str(e)
        raise UsageError(message) from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise JobNotRunningError(
            f"no manager answers at {request.full_url} ({getattr(e, 'reason', e)}); is the job still running?"
        ) from e


def api_get(url: str, path: str, timeout: float = 5.0) -> Any:
    return _request(urllib.request.Request(url + path), timeout)


def api_post(url: str, path: str, body: dict[str, Any], timeout: float = 5.0) -> Any:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    return _request(request, timeout)
