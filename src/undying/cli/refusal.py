"""A launch that is refused leaves the disk as it found it: what it created in the job dir is
removed.

``undying run`` checks what it can before it creates anything (its options,
the environment, the script). Some refusals can only come later: a port
another process holds, a checkpoint folder whose checkpoints are another
job's or all broken, a manager that refuses a node. By then the launch has
made the job dir, its token and event log, and set the last launch's log
aside. ``Ledger.take`` notes what the job dir holds before the launch;
``undo`` (called only for a refusal, a ``UsageError``, which comes before any
rank trained) puts back what the launch moved (the archived log) and
removes what it created, and the folders it made on the way to the job dir
when they are empty again. It deletes nothing that was there before (an
entry is the same one when it has the same device and inode), and nothing
at all while another live launcher holds the job dir. Not undone: a
file the launch replaced in place (the token, when env ``UNDYING_TOKEN``
gave another) and the script-error note of the launch before, which every
launch clears.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from undying.checkpoint.lock import release_all
from undying.jobfiles.jobdir import JobDir, pid_alive

__all__ = ["Ledger"]

_Ident = tuple[int, int]


def _entries(folder: Path) -> dict[str, _Ident] | None:
    """Each entry of ``folder`` by name: (device, inode); None when it cannot be listed (gone, not
    a folder)."""
    try:
        with os.scandir(folder) as it:
            return {e.name: (s.st_dev, s.st_ino)
                    for e in it for s in [e.stat(follow_symlinks=False)]}
    except OSError:
        return None


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


@dataclass(frozen=True)
class Ledger:
    """The job dir's entries before a launch, and the folders missing on the way to it."""

    path: Path
    # None: the job dir was there and could not be listed (then nothing is undone).
    before: dict[str, _Ident] | None
    missing: tuple[Path, ...]  # the job dir and each missing parent, deepest first

    @classmethod
    def take(cls, job_dir: str | os.PathLike[str]) -> Ledger:
        path = Path(os.path.abspath(job_dir))
        missing: list[Path] = []
        here = path
        while not (here.exists() or here.is_symlink()) and here != here.parent:
            missing.append(here)
            here = here.parent
        return cls(path, {} if missing else _entries(path), tuple(missing))

    def undo(self) -> None:
        """Put back what the launch moved in the job dir, remove what it created; never raises.

        Nothing at all while another live launcher holds the job dir (a refusal for that very
        reason): what appeared meanwhile is that job's. This process's own locks go first: the undo
        removes their files, and a keeper still holding one would log it missing at its next beat.
        """
        release_all()
        info = JobDir(self.path).read_manager() or {}
        with contextlib.suppress(OSError, TypeError, ValueError):
            pid = int(info.get("pid", 0))
            if pid != os.getpid() and pid_alive(pid):
                return
        with contextlib.suppress(OSError):
            self._undo()

    def _undo(self) -> None:
        now = _entries(self.path)
        if self.before is None or now is None:
            return  # (what was there is not known, or the folder is gone: nothing to judge by)
        old_name = {ident: name for name, ident in self.before.items()}
        known = set(self.before.values())
        # Moved aside by the launch (the last launch's log): back in place.
        for name, ident in now.items():
            was = old_name.get(ident)
            if was is not None and was != name:
                at_old = self.path / was
                if was in now and now[was] not in known:
                    _remove(at_old)  # (what the launch created in its place)
                os.rename(self.path / name, at_old)
        for name, ident in (_entries(self.path) or {}).items():
            if ident not in known:
                _remove(self.path / name)
        for folder in self.missing:  # the job dir and the parents the launch made, when empty again
            try:
                folder.rmdir()
            except OSError:
                break
