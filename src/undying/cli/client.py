"""Finding a job and talking to its manager, for the CLI commands.

A command finds its job with ``--job-dir`` (default: the newest under
./undying-jobs) or ``--manager HOST:PORT``, and the job's token with
``--token-file``, env ``UNDYING_TOKEN``, or the job dir's ``token`` file, in
that order (``undying.manager.auth.find_token``). ``connect`` puts the three
together; every request then carries the token and, when the job is known
from its job dir, the job's id, so a manager of another job refuses instead
of obeying.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from undying.errors import JobNotRunningError, UsageError
from undying.inputs import check_manager_url, is_job_id
from undying.manager.auth import auth_headers, find_token, find_token_with_source
from undying.manager.events import LogReader
from undying.manager.jobdir import JobDir

__all__ = [
    "add_job_arguments",
    "resolve_job_dir",
    "manager_url",
    "connect",
    "api_for",
    "Api",
    "AccessDeniedError",
    "api_get",
    "api_post",
    "readable_log",
]


class AccessDeniedError(UsageError):
    """The manager refused the request (401): no token, a wrong one, or another job's manager."""


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """--job-dir or --manager: how a command finds its job; --token-file: how it proves it may."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--job-dir", help="the job's folder (default: the newest under ./undying-jobs)")
    where.add_argument("--manager", help="the manager's address, HOST:PORT or http://HOST:PORT")
    parser.add_argument(
        "--token-file", metavar="PATH",
        help="file holding the job's token (default: env UNDYING_TOKEN, else <job dir>/token, "
        "which the manager writes readable only by you)",
    )


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


@contextlib.contextmanager
def readable_log(path: Path) -> Iterator[None]:
    """Around every read of a job's event log by a command: a damaged or foreign file is one line, exit 2.

    (SQLite says so at the first query, as ``LogReader.Error``; a row that is not JSON, as a ValueError.)
    """
    try:
        yield
    except (LogReader.Error, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is not a readable undying event log ({' '.join(str(e).split()) or type(e).__name__}); "
                         "it may be damaged or another program's file: move it aside (checkpoints do not depend on "
                         "it), or pass the --job-dir of another job") from None


def manager_url(manager: str | None, job_dir: str | None) -> str:
    if manager is not None:
        return _base(manager)
    return resolve_job_dir(job_dir).running_manager_url()


def _base(manager: str) -> str:
    return check_manager_url("--manager", manager)


@dataclass(frozen=True)
class Api:
    """A running job's manager, as a command talks to it: its URL, the token to show, the job meant."""

    url: str
    token: str | None = None
    job_id: str | None = None
    token_from: str = "nowhere"  # where the token was found, named when the manager refuses it

    def get(self, path: str, timeout: float = 5.0) -> Any:
        with self._refusal_named():
            return api_get(self.url, path, timeout, token=self.token, job_id=self.job_id)

    def post(self, path: str, body: dict[str, Any], timeout: float = 5.0) -> Any:
        with self._refusal_named():
            return api_post(self.url, path, body, timeout, token=self.token, job_id=self.job_id)

    @contextlib.contextmanager
    def _refusal_named(self) -> Iterator[None]:
        try:
            yield
        except AccessDeniedError as e:
            if self.token is None:
                raise
            # A stale env UNDYING_TOKEN shadows the job dir's file: say which one was sent.
            raise AccessDeniedError(f"{e} (this command sent the token from {self.token_from})") from None


def connect(manager: str | None, job_dir: str | None, token_file: str | None) -> Api:
    """The running job's manager: by ``--manager``, else by the job dir (given or newest); and its token.

    The address comes first, so "no running job" is said before any word
    about tokens. With ``--manager`` alone the token comes from
    ``--token-file`` or env; none at all is not an error here: a manager with
    open status answers reads without one, and one that needs it says so.
    """
    if manager is not None:
        token, source = find_token_with_source(None, token_file)
        return Api(_base(manager), token, token_from=source)
    jd = resolve_job_dir(job_dir)
    return api_for(jd, token_file)


def api_for(jd: JobDir, token_file: str | None = None) -> Api:
    """The manager of the job in ``jd`` (JobNotRunningError when none runs), with its token and job id."""
    url = jd.running_manager_url()
    job_id = (jd.read_manager() or {}).get("job_id")
    if not is_job_id(job_id):
        # A job of a version that let any letter into an id: no header can carry it (headers are Latin-1),
        # and the token alone still says which job this is.
        job_id = None
    token, source = find_token_with_source(jd.path, token_file)
    return Api(url, token, job_id, source)


def _request(request: urllib.request.Request, timeout: float) -> Any:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", str(e))
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            message = str(e)
        if e.code == 401:
            raise AccessDeniedError(message) from None
        raise UsageError(message) from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise JobNotRunningError(
            f"no manager answers at {request.full_url} ({getattr(e, 'reason', e)}); is the job still running?"
        ) from e


def api_get(url: str, path: str, timeout: float = 5.0, *, token: str | None = None,
            job_id: str | None = None) -> Any:
    """GET ``path`` of the manager at ``url``; ``token`` None: env UNDYING_TOKEN if set, else none."""
    return _request(urllib.request.Request(url + path, headers=_headers(token, job_id)), timeout)


def api_post(url: str, path: str, body: dict[str, Any], timeout: float = 5.0, *, token: str | None = None,
             job_id: str | None = None) -> Any:
    """POST ``body`` as JSON to ``path``; ``token`` as for ``api_get``."""
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", **_headers(token, job_id)},
    )
    return _request(request, timeout)


def _headers(token: str | None, job_id: str | None) -> dict[str, str]:
    # Env as the last resort: scripts that only know the URL (bench, a test harness) set UNDYING_TOKEN.
    return auth_headers(token if token is not None else find_token(None, None), job_id)
