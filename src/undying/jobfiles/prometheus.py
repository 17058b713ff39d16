"""How Prometheus finds every job of a user on a machine, and how it authenticates to them.

**Targets.** Each job's manager writes one Prometheus ``file_sd`` target file,
``undying-<job id>-<pid>.json``, into a known per-user folder (``folder``:
env ``UNDYING_PROMETHEUS_DIR``, default ``~/.local/state/undying/prometheus``;
``off`` writes none). It holds the address of the manager's HTTP API and the
job's labels, is written atomically (aside, fsync, rename) once the API
serves, and removed when the manager closes. A job killed with SIGKILL leaves
its file behind: the file names its writer (its PID, the process's start time
and the machine's boot) in ``__meta_`` labels, which Prometheus drops after
relabelling, so any later job of the user recognises the file as stale and
removes it (``sweep``). Prometheus scrapes a stale target as down meanwhile.

**The scrape credential.** A job's token cannot travel in a ``file_sd`` file
(Prometheus reads no credential from one), and a per-job token would need a
scrape config per job. So the folder also holds ``scrape-credential``: one
random secret per user, 0600, made by the first job that finds none; every
job of that user accepts it for ``GET /metrics`` and for nothing else.
Prometheus sends it with ``authorization: credentials_file:``.

**Trust.** The folder must belong to the user (or root) and be writable by no
one else; a folder that fails this gets no file and gives no credential (one
warning line, the job runs on). In it, only the user's own regular files
named ``undying-*.json`` are ever read or removed: another user's file, a
link, or a file of another name (a target the user wrote by hand) is left
alone and never trusted. Nothing here stops a job: every failure (a full
disk, a read-only home) is one warning line and the job trains on.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from undying.checkpoint.lock_holder import boot_id, pid_start
from undying.errors import UsageError
from undying.jobfiles.jobdir import pid_alive
from undying.jobfiles.ownership import owner_problem
from undying.jobfiles.tokens import read_token_file
from undying.protocol.env import PROMETHEUS_DIR_ENV

__all__ = ["DEFAULT_FOLDER", "CREDENTIAL_FILE", "folder", "Publisher", "TargetFile",
           "scrape_credential", "sweep", "target_address"]

log = logging.getLogger("undying.prometheus")

DEFAULT_FOLDER = "~/.local/state/undying/prometheus"
CREDENTIAL_FILE = "scrape-credential"
_PREFIX, _SUFFIX = "undying-", ".json"
_MAX_FILE = 64 * 1024
_MAX_SWEPT = 4096  # files looked at by one sweep (each job's start sweeps again)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_PID, _SINCE, _BOOT = "__meta_undying_pid", "__meta_undying_since", "__meta_undying_boot"


def folder(env: dict[str, str] | None = None) -> Path | None:
    """The user's target folder: env ``UNDYING_PROMETHEUS_DIR`` (``off``: None), else the
    default, as an absolute path."""
    raw = (os.environ if env is None else env).get(PROMETHEUS_DIR_ENV, "").strip()
    if raw.lower() == "off":
        return None
    return Path(os.path.abspath(os.path.expanduser(raw or DEFAULT_FOLDER)))


def _usable(path: Path) -> None:
    """Create ``path`` (0755: Prometheus may run as another user) or check it; ``UsageError`` when
    it is not the user's alone to write."""
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path} is not a folder; set {PROMETHEUS_DIR_ENV} to a folder of yours")
    problem = owner_problem(st, str(path))
    if problem is not None:
        raise UsageError(f"{problem}; or set {PROMETHEUS_DIR_ENV} to a folder of yours")


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, from /proc); "" where unknown."""
    return str(pid_start(pid) or "")


def target_address(url: str) -> str:
    """``host:port`` of the API at ``url`` as a scraper on this machine reaches it (a wildcard
    host is loopback)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class TargetFile:
    """What one target file says: the scrape address, the job's labels, and who wrote it."""

    address: str
    job_id: str
    job_dir: str
    pid: int
    since: str
    boot: str

    def group(self) -> list[dict[str, Any]]:
        """The file's content: one Prometheus target group."""
        return [{"targets": [self.address],
                 "labels": {"undying_job": self.job_id, "undying_job_dir": self.job_dir,
                            _PID: str(self.pid), _SINCE: self.since, _BOOT: self.boot}}]

    @classmethod
    def parse(cls, data: Any) -> TargetFile | None:
        """The file read back; None when it is not one undying writes."""
        try:
            (group,) = data
            (address,) = group["targets"]
            labels = group["labels"]
            return cls(str(address), str(labels["undying_job"]), str(labels["undying_job_dir"]),
                       int(labels[_PID]), str(labels[_SINCE]), str(labels[_BOOT]))
        except (TypeError, ValueError, KeyError, AttributeError):
            return None

    def stale(self) -> bool:
        """Whether its writer is gone: another boot, no such process, or another process under
        its PID."""
        if self.boot and self.boot != boot_id():
            return True
        if not pid_alive(self.pid):
            return True
        return bool(self.since) and self.since != _started(self.pid)


def _own_target(path: Path) -> TargetFile | None:
    """The target file at ``path`` when it is the user's own regular file in undying's form,
    else None (never followed through a link, never another user's)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or owner_problem(st, str(path)) is not None:
            return None
        if st.st_uid != os.geteuid():
            return None  # (root's file, for a user: trusted as a file, but not ours to remove)
        raw = f.read(_MAX_FILE + 1)
    try:
        return TargetFile.parse(json.loads(raw)) if len(raw) <= _MAX_FILE else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def sweep(where: Path) -> list[Path]:
    """Remove the stale target files of the user's dead jobs in ``where``; the paths removed."""
    removed = []
    with contextlib.suppress(OSError):
        for path in itertools.islice(where.glob(f"{_PREFIX}*{_SUFFIX}"), _MAX_SWEPT):
            target = _own_target(path)
            if target is not None and target.stale():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
    return removed


def _write(path: Path, data: bytes, mode: int, *, exclusive: bool = False) -> None:
    """``data`` written aside and fsynced, then renamed onto ``path`` (``exclusive``: linked,
    so an existing file wins: ``FileExistsError``); nothing is left behind on failure."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def scrape_credential(where: Path) -> str:
    """The user's scrape credential in ``where`` (made, 0600, when there is none); ``UsageError``
    or ``OSError`` when it cannot be had."""
    _usable(where)
    path = where / CREDENTIAL_FILE
    if not (path.exists() or path.is_symlink()):
        with contextlib.suppress(FileExistsError):  # another job made it first: theirs holds
            _write(path, secrets.token_urlsafe(32).encode("ascii") + b"\n", 0o600,
                   exclusive=True)
    return read_token_file(path)


def _why(e: BaseException) -> str:
    """An error as a warning line names it: ``ENOSPC: No space left on device``."""
    if isinstance(e, OSError) and e.errno:
        return f"{errno.errorcode.get(e.errno, f'errno {e.errno}')}: {os.strerror(e.errno)}"
    return str(e)


class Publisher:
    """One manager's target file and the credential it accepts, kept for as long as it serves."""

    def __init__(self, where: Path | None = None, *, env: dict[str, str] | None = None) -> None:
        self.folder = where if where is not None else folder(env)
        self.path: Path | None = None

    def credential(self) -> str | None:
        """The scrape credential this manager accepts; None (one warning) when there is none."""
        if self.folder is None:
            return None
        try:
            return scrape_credential(self.folder)
        except (UsageError, OSError) as e:
            log.warning("no scrape credential: %s (GET /metrics takes the job's token only)",
                        _why(e))
            return None

    def publish(self, url: str, job_id: str, job_dir: str) -> Path | None:
        """Write the target file for the API at ``url`` (stale ones of the user's dead jobs
        removed first); its path, or None (one warning) when it cannot be written."""
        if self.folder is None:
            return None
        pid = os.getpid()
        path = self.folder / f"{_PREFIX}{job_id}-{pid}{_SUFFIX}"
        target = TargetFile(target_address(url), job_id, os.path.abspath(job_dir), pid,
                            _started(pid), boot_id())
        try:
            _usable(self.folder)
            sweep(self.folder)
            _write(path, json.dumps(target.group(), indent=1).encode() + b"\n", 0o644)
        except (UsageError, OSError) as e:
            log.warning("job %s: no Prometheus target file in %s: %s", job_id, self.folder,
                        _why(e))
            return None
        self.path = path
        return path

    def withdraw(self) -> None:
        """Remove this manager's target file (the job is over)."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None
