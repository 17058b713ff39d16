"""Finding a job and talking to its manager, for the CLI commands.

A command finds its job with ``--job-dir`` (default: the newest under
./undying-jobs) or ``--manager HOST:PORT``, and the job's token with
``--token-file``, env ``UNDYING_TOKEN``, or the job dir's ``token`` file, in
that order (``undying.jobfiles.tokens.find_token``). ``connect`` puts the three
together; every request then carries the token and, when the job is known
from its job dir, the job's id, so a manager of another job refuses instead
of obeying.

The token goes only to a manager that proved the job's key first, on the same
connection (``undying.protocol.api_proof``): ``manager.json`` or
``--manager`` may name a stranger's listener, and it gets a nonce, never the
token. Where the manager's address is on this host and came from the job dir,
the proof must also name this command's own end of the connection, so a
listener that relays the hello to the real manager is caught too.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import http.client
import ipaddress
import json
import secrets
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from undying.errors import ConflictError, JobNotRunningError, UsageError
from undying.inputs import check_manager_url, is_job_id
from undying.jobfiles.events import LogReader
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.tokens import JOB_HEADER, auth_headers, find_token, find_token_with_source
from undying.protocol.api_proof import (
    HELLO_PATH,
    NONCE_BYTES,
    NONCE_HEADER,
    peer_name,
    proof_key,
    proof_of,
)

__all__ = [
    "add_job_arguments",
    "resolve_job_dir",
    "manager_url",
    "connect",
    "api_for",
    "Api",
    "AccessDeniedError",
    "UnprovenManagerError",
    "api_get",
    "api_post",
    "readable_log",
]


class AccessDeniedError(UsageError):
    """The manager refused the request (401): no token, a wrong one, or another job's manager."""


class UnprovenManagerError(UsageError):
    """The listener did not prove the job's key, so the token was not sent to it."""


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """--job-dir or --manager: how a command finds its job; --token-file: how it proves it may."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--job-dir",
                       help="the job's folder (default: the newest under ./undying-jobs)")
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
    """Around every read of a job's event log by a command: a damaged or foreign file is one line,
    exit 2.

    (SQLite says so at the first query, as ``LogReader.Error``; a row that is not JSON, as a
    ValueError.)
    """
    try:
        yield
    except (LogReader.Error, json.JSONDecodeError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise UsageError(f"{path} is not a readable undying event log ({why}); it may be damaged "
                         "or another program's file: move it aside (checkpoints do not depend on "
                         "it), or pass the --job-dir of another job") from None


def manager_url(manager: str | None, job_dir: str | None) -> str:
    if manager is not None:
        return _base(manager)
    return resolve_job_dir(job_dir).running_manager_url()


def _base(manager: str) -> str:
    return check_manager_url("--manager", manager)


@dataclass(frozen=True)
class Api:
    """A running job's manager, as a command talks to it: its URL, the token to show, the job
    meant."""

    url: str
    token: str | None = None
    job_id: str | None = None
    token_from: str = "nowhere"  # where the token was found, named when the manager refuses it
    # The proof must name this end of the connection (a local manager from the job dir).
    bind: bool = False

    def get(self, path: str, timeout: float = 5.0) -> Any:
        with self._refusal_named():
            return api_get(self.url, path, timeout, token=self.token, job_id=self.job_id,
                           bind=self.bind)

    def post(self, path: str, body: dict[str, Any], timeout: float = 5.0) -> Any:
        with self._refusal_named():
            return api_post(self.url, path, body, timeout, token=self.token, job_id=self.job_id,
                            bind=self.bind)

    @contextlib.contextmanager
    def _refusal_named(self) -> Iterator[None]:
        try:
            yield
        except AccessDeniedError as e:
            if self.token is None:
                raise
            # A stale env UNDYING_TOKEN shadows the job dir's file: say which one was sent.
            raise AccessDeniedError(f"{e} (this command sent the token from "
                                    f"{self.token_from})") from None
        except UnprovenManagerError as e:
            raise UnprovenManagerError(f"{e} (this command's token came from "
                                       f"{self.token_from})") from None


def connect(manager: str | None, job_dir: str | None, token_file: str | None) -> Api:
    """The running job's manager: by ``--manager``, else by the job dir (given or newest); and its
    token.

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
    """The manager of the job in ``jd`` (JobNotRunningError when none runs), with its token and
    job id."""
    url = jd.running_manager_url()
    job_id = (jd.read_manager() or {}).get("job_id")
    if not is_job_id(job_id):
        # A job of a version that let any letter into an id: no header can carry it (headers are
        # Latin-1), and the token alone still says which job this is.
        job_id = None
    token, source = find_token_with_source(jd.path, token_file)
    return Api(url, token, job_id, source, bind=_local(url))


def _local(url: str) -> bool:
    """Whether ``url`` names this host's loopback: no NAT or proxy between the two ends of a
    connection."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"manager address {url} is not an HTTP address with a host; pass "
                         "--manager HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        raise UsageError(f"manager address {url} has no valid port; pass --manager "
                         "HOST:PORT") from None
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname, port, timeout=timeout), parts.path.rstrip("/")


def _prove(conn: http.client.HTTPConnection, url: str, base: str, token: str, job_id: str | None,
           bind: bool) -> None:
    """Ask the listener for the proof of the job's key; ``UnprovenManagerError`` unless it gave
    it."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    job_header = {JOB_HEADER: job_id} if job_id else {}
    conn.request("GET", base + HELLO_PATH, headers={NONCE_HEADER: nonce.hex(), **job_header})
    response = conn.getresponse()
    raw = response.read(1 << 16)
    # A manager of another job (the job header): it says which, and got no token.
    if response.status == 401:
        raise AccessDeniedError(_message(raw, f"{url} refused the hello (401)"))
    job = f"job {job_id}" if job_id else "the job"
    unproven = f"the listener at {url} did not prove it is the manager of {job}"
    after = ("; the token was not sent. If the job dir's manager.json named it, it is stale or "
             "was planted: check that the job is running, and who can write its job dir")
    if response.status != 200:
        raise UnprovenManagerError(f"{unproven} (it answered {response.status} to {HELLO_PATH}: "
                                   f"not an undying manager, or one too old to prove "
                                   f"itself){after}")
    try:
        answer = json.loads(raw)
        said_job, peer = str(answer["job_id"]), str(answer["peer"])
        proof = str(answer["proof"])
    except (ValueError, KeyError, TypeError):
        raise UnprovenManagerError(f"{unproven} (its answer to {HELLO_PATH} is not a "
                                   f"proof){after}") from None
    expected = proof_of(proof_key(token), nonce, said_job, peer)
    if not hmac.compare_digest(expected.encode(), proof.encode("utf-8", "replace")):
        raise UnprovenManagerError(f"{unproven} (its proof does not match the key of this "
                                   f"command's token: a wrong token, stale or another job's, or a "
                                   f"listener that is not the job's manager){after}")
    if job_id is not None and said_job != job_id:
        raise UnprovenManagerError(f"{unproven} (it runs job {said_job}){after}")
    if bind and conn.sock is not None and peer != peer_name(conn.sock.getsockname()):
        raise UnprovenManagerError(f"{unproven} (its proof was made for another connection: a "
                                   f"listener that relays to the manager){after}")


def _message(raw: bytes, fallback: str) -> str:
    try:
        return str(json.loads(raw).get("error", fallback))
    except (ValueError, AttributeError, UnicodeDecodeError):
        return fallback


def _exchange(url: str, method: str, path: str, body: bytes | None, timeout: float,
              token: str | None, job_id: str | None, bind: bool | None) -> Any:
    """One request on a connection of its own; with a token, only after the listener proved the
    job's key."""
    conn, base = _connection(url, timeout)
    try:
        try:
            conn.connect()
            if token is not None:
                _prove(conn, url, base, token, job_id, _local(url) if bind is None else bind)
            headers = auth_headers(token, job_id)
            if body is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, base + path, body=body, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as e:
            raise JobNotRunningError(
                f"no manager answers at {url}{path} ({e}); is the job still running?"
            ) from e
    finally:
        conn.close()
    if response.status >= 400:
        message = _message(raw, f"HTTP Error {response.status}: {response.reason}")
        if response.status == 401:
            raise AccessDeniedError(message)
        if response.status == 409:  # well-formed, but the job's state refuses it now
            raise ConflictError(message)
        raise UsageError(message)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise UsageError(f"the manager at {url} answered {path} with something that is not "
                         "JSON") from None


def api_get(url: str, path: str, timeout: float = 5.0, *, token: str | None = None,
            job_id: str | None = None, bind: bool | None = None) -> Any:
    """GET ``path`` of the manager at ``url``; ``token`` None: env UNDYING_TOKEN if set, else none.

    ``bind``: whether the manager's proof must name this end of the connection
    (default: when ``url`` is on this host's loopback).
    """
    return _exchange(url, "GET", path, None, timeout, _token(token), job_id, bind)


def api_post(url: str, path: str, body: dict[str, Any], timeout: float = 5.0, *,
             token: str | None = None, job_id: str | None = None,
             bind: bool | None = None) -> Any:
    """POST ``body`` as JSON to ``path``; ``token`` and ``bind`` as for ``api_get``."""
    data = json.dumps(body).encode()
    return _exchange(url, "POST", path, data, timeout, _token(token), job_id, bind)


def _token(token: str | None) -> str | None:
    # Env as the last resort: scripts that only know the URL (bench, a test harness) set
    # UNDYING_TOKEN.
    return token if token is not None else find_token(None, None)
