"""A job's folder: its event log, the address of its running manager, its logs.

The folder is the job user's alone (``undying.jobfiles.ownership``): created
``0700`` (an existing one is made so), its log and ``manager.json`` ``0600``
from their first byte, whatever the umask; a folder or a ``manager.json``
another user made or could write is refused in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from undying.checkpoint.lock import hold_job_dir, release_all
from undying.errors import JobNotRunningError, UsageError
from undying.jobfiles.events import fold_wal
from undying.jobfiles.ownership import check_trusted, make_private, private_dir, write_private
from undying.procfs import is_zombie

__all__ = ["JobDir", "default_job_dir", "pid_alive"]


def default_job_dir(job_id: str) -> Path:
    return Path.cwd() / "undying-jobs" / job_id


@dataclass(frozen=True)
class JobDir:
    path: Path

    @property
    def events_db(self) -> Path:
        return self.path / "events.db"

    @property
    def manager_file(self) -> Path:
        return self.path / "manager.json"

    def prepare(self, *, keep_log: bool = False) -> None:
        """Create the folder and prove it is writable, or say why not.

        ``keep_log``: a restarted manager carries on the job's log instead of starting a new one.
        """
        try:
            private_dir(self.path)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".write-test-"):
                pass
        except OSError as e:
            raise UsageError(
                f"job dir {self.path} is not writable ({e.strerror or e}); pass --job-dir with a "
                "folder you can write"
            ) from e
        # One launcher (or manager) at a time, before anything here is touched (checkpoint.lock;
        # released by clear_manager, or by the kernel when this process ends however it ends).
        hold_job_dir(self.path)
        if self.manager_file.exists():
            info = self.read_manager()
            if info and pid_alive(int(info.get("pid", 0))):
                raise UsageError(
                    f"job dir {self.path} belongs to a running job (launcher pid {info['pid']}); "
                    "pass another --job-dir or --job-id"
                )
        if self.events_db.exists() and not keep_log:
            self.archive_log()
        # The script error of an earlier launch (worker.boot) is not this launch's.
        with contextlib.suppress(FileNotFoundError):
            (self.path / "script-error.txt").unlink()

    def private_log(self) -> None:
        """Before the log is opened: ``events.db`` created ``0600`` (SQLite gives its ``-wal`` and
        ``-shm`` the database's mode), or an existing one made so with its ``-wal`` and ``-shm``.
        Never after SQLite opened it: that would drop SQLite's locks
        (``ownership.make_private``)."""
        make_private(self.events_db, create=True)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                make_private(Path(str(self.events_db) + suffix))

    def archive_log(self) -> Path:
        """Set the last launch's log aside whole, as ``events.<time>.db``, and return where.

        A new launch starts a new log (its generations, incidents and steps are
        its own), so the old one is kept beside it, and ``undying status`` lists
        it. Whole means with its write-ahead log: a launcher killed mid-run
        leaves events in ``events.db-wal`` that are in no other file. Opening
        the database recovers them and a checkpoint folds them in; a log that
        cannot be opened moves with its ``-wal`` and ``-shm`` under the new name,
        where SQLite finds them. Nothing is ever deleted.
        """
        stamp = int(self.events_db.stat().st_mtime)
        target = self.path / f"events.{stamp}.db"
        n = 1
        while target.exists():
            target = self.path / f"events.{stamp}-{n}.db"
            n += 1
        fold_wal(self.events_db)
        for suffix in ("", "-wal", "-shm"):
            part = Path(str(self.events_db) + suffix)
            if part.exists():
                os.replace(part, Path(str(target) + suffix))
        return target

    def earlier_logs(self) -> list[Path]:
        """The logs of earlier launches in this job dir, oldest first."""
        return sorted(self.path.glob("events.*.db"), key=lambda p: p.stat().st_mtime)

    def write_manager(self, info: dict[str, Any]) -> None:
        write_private(self.manager_file, json.dumps(info).encode())

    def read_manager(self) -> dict[str, Any] | None:
        """What ``manager.json`` says, None when there is none or it is not JSON.

        One that another user made or could write is refused (``UsageError``):
        it would send the commands, and the token, wherever its writer likes.
        """
        try:
            fd = os.open(self.manager_file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None
            check_trusted(st, str(self.manager_file), dir_uid=self.path.stat().st_uid)
            raw = f.read(1 << 20)
        try:
            info = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return info if isinstance(info, dict) else None

    def running_manager_url(self) -> str:
        info = self.read_manager()
        if info is None or not pid_alive(int(info.get("pid", 0))):
            raise JobNotRunningError(
                f"no running job in {self.path}; start one with `undying run`, or pass the "
                "--job-dir of a running job"
            )
        return str(info["url"])

    def clear_manager(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.manager_file.unlink()
        release_all()  # the job is over: this dir's lock and its checkpoint dir's (checkpoint.lock)


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (one of another user's counts), a zombie not: it
    exited and holds nothing (a killed launcher whose parent died with it stays one until
    whoever adopts it collects it)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # (another user's: it exists)
    return not is_zombie(pid)
