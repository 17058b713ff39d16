"""The job's token: where it is kept, where a caller finds it, how a request shows it.

The manager's API can kill ranks and stop the job, so it answers only callers
that show the job's token. The manager takes the token from env
``UNDYING_TOKEN`` when it is set (a Kubernetes Secret, a scheduler's secret
store), else keeps the one already in ``<job dir>/token`` (a restarted manager
keeps its callers working), else makes a new one; either way it writes it to
``<job dir>/token`` with mode 0600, so the user who started the job, and only
that user, can read it there.

Callers find it (``find_token``) in ``--token-file PATH``, env
``UNDYING_TOKEN``, or the job dir's token file, in that order: the most
explicit first. They send it as ``Authorization: Bearer <token>`` (or, where a
proxy eats ``Authorization``, as ``X-Undying-Token``), and may name the job
they mean in ``X-Undying-Job`` so that a command aimed at the wrong manager is
refused instead of faulting someone else's job.

This module is pure (no aiohttp): the manager, the CLI and the agents share
it. The manager's check of what a caller shows (``token_from_headers``,
``tokens_match``) is the manager's own: ``undying.manager.http.access``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from undying.errors import UsageError
from undying.jobfiles.ownership import check_trusted, owner_problem, private_dir, write_private
from undying.protocol.keys import TOKEN_ENV
from undying.user_files import open_user_file

__all__ = [
    "TOKEN_FILE",
    "TOKEN_ENV",
    "AUTH_HEADER",
    "TOKEN_HEADER",
    "JOB_HEADER",
    "ensure_token",
    "ensure_token_with_source",
    "find_token",
    "find_token_with_source",
    "read_token_file",
    "auth_headers",
    "check_shared_token",
    "where_the_token_is",
]

TOKEN_FILE = "token"
AUTH_HEADER = "Authorization"
TOKEN_HEADER = "X-Undying-Token"
JOB_HEADER = "X-Undying-Job"
# A token travels in an HTTP header: printable ASCII without spaces, and not a novel.
_MAX_TOKEN = 4096


def _check(token: str, source: str) -> str:
    token = token.strip()
    if not token:
        raise UsageError(f"the token in {source} is empty; put the job's token there, or remove it "
                         "to get a new one")
    if len(token) > _MAX_TOKEN or not all("!" <= c <= "~" for c in token):
        raise UsageError(
            f"the token in {source} is not a header-safe token (printable ASCII, no spaces, at "
            f"most {_MAX_TOKEN} characters); use e.g. the output of `python -c 'import secrets; "
            f"print(secrets.token_urlsafe(32))'`"
        )
    return token


def _env_token() -> str | None:
    """The token from env, or None when unset or empty (``UNDYING_TOKEN=`` means "not given")."""
    value = os.environ.get(TOKEN_ENV, "")
    return _check(value, f"env {TOKEN_ENV}") if value.strip() else None


def read_token_file(path: Path, *, private: bool = True) -> str:
    """The token kept in ``path``.

    ``private``: refuse a file that group or others can read, as ssh refuses a
    loose private key: its token may already be known to others. The job dir's
    file is ours and must stay 0600. A ``--token-file`` the user names is read
    as it is (a Kubernetes Secret mounted with fsGroup is 0440, and refusing it
    would only push people to copy the token somewhere worse).

    Either way the file must belong to the user (or root) and be writable by
    no one else (``undying.jobfiles.ownership``): a token file another user
    made holds a token that user knows, whatever its mode says.
    """
    # (a folder, a FIFO, a missing file: one line from the one reader of files the user names)
    fd = open_user_file(path, "token file", "pass the --token-file the manager wrote",
                        follow=not private)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        mode = st.st_mode
        if not stat.S_ISREG(mode):
            raise UsageError(f"token file {path} is not a regular file; pass the file that holds "
                             "the token")
        dir_uid = _owner(Path(path).parent) if private else None
        check_trusted(st, f"token file {path}", dir_uid=dir_uid)
        if private and mode & 0o077:
            raise UsageError(
                f"token file {path} is readable by group or others "
                f"(mode {stat.S_IMODE(mode):04o}), so its token may be known to others: run "
                f"`chmod 600 {path}` if it is still secret, or delete it and restart the manager "
                "to get a new token"
            )
        raw = f.read(_MAX_TOKEN + 1)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise UsageError(f"token file {path} does not hold a token (not ASCII text)") from None
    return _check(text, f"token file {path}")


def check_shared_token(job_dir: Path) -> str:
    """The token another node's manager wrote to ``<job_dir>/token``, checked as one of ours;
    UsageError (one line naming the path and what to do) when another user may have made it.

    The nodes of a Slurm job run as one user, and the first node's manager makes the job dir
    itself (0700) and the token in it (0600): a job dir or a token that is a link, or that
    another user owns or may write, was planted, and its token is known to that user, who could
    then reach the job's manager and its stores. Root gets no exception here: the job dir must be
    its own too (``read_token_file`` trusts a root-run job's files of the job dir's owner).
    """
    fix = "remove it, or pass a --job-dir of your own, and start the job again"
    try:
        st = os.lstat(job_dir)
    except OSError as e:
        raise UsageError(f"cannot read the job dir {job_dir} ({e.strerror or e}); pass a "
                         "--job-dir every node of the job can read") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise UsageError(f"the job dir {job_dir} is {kind}, not the folder the first node's "
                         f"manager makes: another user may have planted it; {fix}")
    problem = owner_problem(st, str(job_dir))  # (judged as a file: root's own, too)
    if problem is not None:
        raise UsageError(f"the job dir {problem}")
    path = Path(job_dir) / TOKEN_FILE
    try:
        link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        link = False
    if link:
        raise UsageError(f"token file {path} is a symbolic link, not the file the first node's "
                         "manager writes: another user may know the token it leads to; remove "
                         "it and start the job again")
    return read_token_file(path)


def _owner(folder: Path) -> int | None:
    try:
        return folder.stat().st_uid
    except OSError:
        return None


def _write_private(path: Path, token: str) -> None:
    """Write ``token`` to ``path``, 0600 from its first byte (``ownership.write_private``)."""
    write_private(path, token.encode("ascii") + b"\n")


def ensure_token(job_dir: Path, token_file: str | None = None) -> str:
    """The manager's token for the job in ``job_dir`` (``ensure_token_with_source`` without the
    source)."""
    return ensure_token_with_source(job_dir, token_file)[0]


def ensure_token_with_source(job_dir: Path, token_file: str | None = None) -> tuple[str, str]:
    """The manager's token for the job in ``job_dir``, written to ``<job dir>/token`` (mode
    0600), and its source.

    ``--token-file`` wins, then env ``UNDYING_TOKEN`` (either is written
    there, so commands given the job dir find it); else an existing token
    file of the user's is kept, so a restarted manager does not lock out the
    agents and users holding its token; else a new random one is made. The
    source, in words, is what the start line names.
    """
    path = Path(job_dir) / TOKEN_FILE
    try:
        private_dir(Path(job_dir))
        given: str | None = (read_token_file(Path(token_file), private=False)
                             if token_file is not None else _env_token())
        source = f"--token-file {token_file}" if token_file is not None else f"env {TOKEN_ENV}"
        token = given
        if token is None:
            if path.exists() or path.is_symlink():
                return read_token_file(path), str(path)
            token, source = secrets.token_urlsafe(32), f"{path} (new)"
        elif path.exists() and not path.is_symlink():
            with contextlib.suppress(UsageError):
                if read_token_file(path) == token:
                    return token, source
        _write_private(path, token)
    except OSError as e:
        raise UsageError(
            f"cannot write the job's token to {path} ({e.strerror or e}); pass a --job-dir you "
            "can write"
        ) from e
    return token, source


def find_token(job_dir: Path | None, token_file: str | None) -> str | None:
    """The token a command sends: ``--token-file``, else env ``UNDYING_TOKEN``, else
    ``<job dir>/token``.

    None when there is none: the request goes without one, and a manager
    that needs one says so (a manager with open status does not, for reads).
    """
    return find_token_with_source(job_dir, token_file)[0]


def find_token_with_source(job_dir: Path | None, token_file: str | None) -> tuple[str | None, str]:
    """``find_token``, and where the token came from in words, for a refusal to name (a stale
    env, say)."""
    if token_file is not None:
        return read_token_file(Path(token_file), private=False), f"--token-file {token_file}"
    token = _env_token()
    if token is not None:
        return token, f"env {TOKEN_ENV}"
    if job_dir is not None:
        path = Path(job_dir) / TOKEN_FILE
        if path.exists() or path.is_symlink():
            return read_token_file(path), str(path)
    return None, "nowhere"


def auth_headers(token: str | None, job_id: str | None = None) -> dict[str, str]:
    """The headers a request carries: the token (if any) and the job it is meant for (if known)."""
    headers: dict[str, str] = {}
    if token is not None:
        headers[AUTH_HEADER] = f"Bearer {token}"
    if job_id is not None:
        headers[JOB_HEADER] = job_id
    return headers


def where_the_token_is(job_dir: Path | str) -> str:
    """One sentence for error messages: where a caller finds the token."""
    return (
        f"the token is in {Path(os.path.abspath(job_dir)) / TOKEN_FILE} (readable only by the "
        "user who started the job); `undying` commands read it from there with --job-dir, or "
        f"pass --token-file PATH or set {TOKEN_ENV}"
    )
