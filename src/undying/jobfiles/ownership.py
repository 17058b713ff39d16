"""Whose files undying trusts, and how it makes its own private whatever the umask.

On a shared machine another user must get nothing from a job: not read its
log, checkpoints or token, not plant a ``manager.json`` that sends ``undying
status`` (and the token) to a listener of theirs, not hand it a token they
know. The rules, checked where a file is trusted (``owner_problem``):

- **The job dir** belongs to the job's user (the effective uid) and is
  writable by nobody else (no group or other write bit): a folder others could
  write may already hold files they planted. undying creates it ``0700`` and
  makes an existing one it may use ``0700`` too, so that nothing in it can be
  reached by another user whatever the umask gave the files.
- **A file undying trusts in it** (``token``, ``manager.json``, ``events.db``)
  belongs to the job's user (or to root) and no one else can write it.
- **Root** (the effective uid 0) accepts a job dir of any owner and mode: a
  container runs as root on a volume that often belongs to another uid (a
  host user's folder, a Kubernetes ``fsGroup`` volume) or is ``0777`` (an
  ``emptyDir``). It still makes it ``0700``, and trusts only files in it that
  belong to root or to the job dir's owner and that no one else can write.

A refusal is one line naming the path, its owner and mode, and what to do.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from undying.errors import UsageError

__all__ = ["owner_problem", "check_trusted", "private_dir", "write_private", "make_private"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def owner_problem(st: os.stat_result, what: str, *, euid: int | None = None,
                  dir_uid: int | None = None, is_dir: bool = False) -> str | None:
    """Why ``what`` (a path, as said to the user) with status ``st`` is not to be trusted; None
    when it is.

    ``dir_uid``: the owner of the job dir the file is in (root trusts files of
    the volume's owner); ``is_dir``: ``st`` is the job dir itself.
    """
    euid = os.geteuid() if euid is None else euid
    mode = stat.S_IMODE(st.st_mode)
    if is_dir and euid == 0:
        # root: a container's volume, whatever its owner and mode (it is made 0700 on use)
        return None
    trusted = {euid, 0} if not (euid == 0 and dir_uid is not None) else {0, dir_uid}
    if st.st_uid not in trusted:
        return (f"{what} belongs to {_who(st.st_uid)}, not to you ({_who(euid)}): another user "
                f"made it, so what it holds cannot be trusted; remove it if you did not expect it "
                f"there"
                + (", or pass a --job-dir of your own" if is_dir else ""))
    if mode & 0o022:
        fix = (f"check what is in it, then run `chmod 700 {what}`, or pass a new --job-dir"
               if is_dir else
               f"remove it and run again, or run `chmod go-w {what}` if you trust it")
        by = ("group and others" if mode & 0o022 == 0o022 else "group" if mode & 0o020
              else "others")
        return (f"{what} is writable by {by} "
                f"(mode {mode:04o}), so another user may have changed it: {fix}")
    return None


def check_trusted(st: os.stat_result, what: str, *, dir_uid: int | None = None,
                  is_dir: bool = False) -> None:
    """``owner_problem`` as a ``UsageError`` (one line, exit 2)."""
    problem = owner_problem(st, what, dir_uid=dir_uid, is_dir=is_dir)
    if problem is not None:
        raise UsageError(problem)


def private_dir(path: Path) -> os.stat_result:
    """Create ``path`` (and its parents) or check the existing one, and leave it ``0700``; its
    status.

    The parents keep the umask's modes (they may be shared folders); the
    job dir itself is the job user's alone.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW)
    try:
        st = os.fstat(fd)
        check_trusted(st, str(path), is_dir=True)
        if stat.S_IMODE(st.st_mode) != 0o700:
            # ours (or root's to use): nothing in it is reachable by others from now on
            os.fchmod(fd, 0o700)
            st = os.fstat(fd)
        return st
    finally:
        os.close(fd)


def make_private(path: Path, *, create: bool = False) -> None:
    """Make the user's file ``path`` ``0600``; with ``create``, create it empty and ``0600`` when
    missing.

    By path, never by opening an existing file: closing any descriptor of a
    file drops every POSIX lock the process holds on it, SQLite's included
    (a database must be made private before SQLite opens it, and this is
    how). ``FileNotFoundError`` when it does not exist and ``create`` is off.
    """
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            try:
                os.fchmod(fd, 0o600)  # a umask can only take bits away; make it exactly 0600
            finally:
                os.close(fd)
            return
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path} is not a regular file; remove it and run again")
    check_trusted(st, str(path), dir_uid=path.parent.stat().st_uid)
    if stat.S_IMODE(st.st_mode) & 0o077:
        # (a regular file, in a folder only the user can write: no link to follow)
        os.chmod(path, 0o600)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no other user can ever read it, not even for an instant.

    The file is created 0600 under a temporary name (``O_EXCL``: never one
    that somebody else prepared), fsynced, and renamed over ``path``: a
    reader sees the old content or the new, never half of one.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
