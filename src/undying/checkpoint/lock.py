"""Owner locks: one job at a time on a checkpoint dir, one launcher at a time on a job dir.

Two jobs on one checkpoint dir destroyed each other's checkpoints, and a
second launcher on a live job dir set its log aside. The owner of a folder
(the launcher, or ``undying manager``) holds ``<folder>/undying.lock`` for its
life; another process that asks for it is refused in one line
(``DirInUseError``, exit 2) naming the owner. The rule for a stale lock
depends on what the storage can do (docs/troubleshooting.md):

- **A local folder** (also NFS, where the server keeps the lock): a POSIX
  record lock (``lockf``) on the file. The kernel drops it when its process
  ends, however it ends (SIGKILL, the OOM killer, a crash), so the next run
  gets in at once, and no pid can be mistaken for another. A stopped owner
  (SIGSTOP, a paused VM) still holds it: refused while that process exists.
  The file's words (job, host, pid, since) only name the owner in a refusal:
  a stranger who writes them changes nothing, and the owner writes them
  again within ``BEAT_S``. A stranger who deletes or replaces the file: the
  owner sees within ``BEAT_S`` that the name no longer is its file and takes
  the new one; when another process holds that one, the owner has lost the
  folder (``on_lost``: the manager fails the job before it saves again).
- **An fsspec URL** (object stores have no lock): a lease. The owner writes
  its record and renews its ``beat`` every ``BEAT_S``. A record naming this
  host (its name and boot id) is stale exactly when its pid is gone or is now
  another process (its start time), as a local lock; one of another host when
  its beat is older than ``STALE_S``.
  A taker writes its record, waits ``SETTLE_S`` and reads it back: the last
  writer wins, the other is refused. A taker of the same job id (its
  relaunch on another host, a rescheduled pod) waits for a live-looking
  lease to go stale, at most ``STALE_S`` and two beats, instead of failing
  (as it waits for a local lock that another host holds: an NFS server
  drops a dead client's locks when its lease ends).
  An owner stopped past ``STALE_S`` loses the lease to another host;
  continued, its next renewal finds another's record: ``on_lost``.

A lock's record that cannot be written (a full disk) costs nothing locally:
the lock is the kernel's, the refusal just cannot name the owner. A process
holds a given folder once: asking again is a no-op (the launcher asks before
the manager does). Held locks are released at exit; a killed process's are
released by the kernel (local) or go stale (URL). What the file's record says, and the
stale rule, are ``lock_holder``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from undying.checkpoint.lock_holder import (
    STALE_S,
    Holder,
    boot_id,
    holder_here,
    pid_start,
    stale_reason,
)
from undying.checkpoint.store import Store
from undying.errors import UsageError

__all__ = ["LOCK_NAME", "BEAT_S", "STALE_S", "DirInUseError", "OwnerLock", "hold", "release",
           "hold_job_dir", "live_owner", "release_all", "read_holder"]

log = logging.getLogger("undying.checkpoint")

LOCK_NAME = "undying.lock"
BEAT_S = 5.0  # the owner checks (local) or renews (URL) its lock this often
SETTLE_S = 0.5  # a URL taker reads its record back after this long: the last writer won


class DirInUseError(UsageError):
    """Another process owns the folder (its lock is live); the message names it and what to do."""



class OwnerLock:
    """One held lock: on a local file (``lockf``) or a URL store (a lease)."""

    def __init__(self, store: Store, holder: Holder, on_lost: Callable[[str], None] | None) -> None:
        self.store = store
        self.path = store.join(LOCK_NAME)
        self.holder = holder
        self.on_lost: list[Callable[[str], None]] = [on_lost] if on_lost else []
        self.fd: int | None = None
        self.lost = ""
        self.released = False
        # A child forked without exec inherits this object: it never owns nor releases it
        self.pid = os.getpid()
        self._mutex = threading.Lock()  # the keeper's beat and a release, one at a time

    @property
    def where(self) -> str:
        return self.store.url_of(self.store.root)

    # -- local: the kernel's lock ------------------------------------------------

    def _take_local(self) -> bool:
        """Lock the file now at ``self.path`` (created if missing); False when another process holds
        it."""
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                             0o600)
            except OSError as e:
                how = ("it is a symlink: remove it" if e.errno == errno.ELOOP else
                       (e.strerror or str(e)))
                raise UsageError(f"{self.holder.what} {self.where}: cannot open its lock "
                                 f"{self.path} ({how})") from e
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    os.close(fd)
                    return False
                # A filesystem without record locks (some FUSE mounts): the job runs, unguarded, and
                # says so; the signer rule (discovery.prune, commit) still keeps every other job's
                # checkpoints whole.
                log.warning("%s %s: cannot lock %s (%s): this filesystem has no record locks, so "
                            "a second job here is not refused", self.holder.what, self.where,
                            self.path, e.strerror or e)
            if self._names_fd(fd):
                if self.fd is not None:
                    os.close(self.fd)  # (the replaced file's: ours, nobody else's)
                self.fd = fd
                self._write_local()
                return True
            os.close(fd)  # deleted or replaced between open and lock: take the one there now
        return False

    def _names_fd(self, fd: int) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _write_local(self) -> None:
        assert self.fd is not None
        data = self.holder.to_bytes()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
            os.fsync(self.fd)
        except OSError as e:
            # The lock holds without its words (a full disk): a refusal cannot name us
            log.warning("%s %s: the lock's record could not be written (%s); the lock holds",
                        self.holder.what, self.where, e.strerror or e)

    def _read_fd(self) -> bytes:
        assert self.fd is not None
        try:
            return os.pread(self.fd, 4096, 0)
        except OSError:
            return b""

    def _keep_local(self) -> str:
        if self.fd is not None and self._names_fd(self.fd):
            if self._read_fd() != self.holder.to_bytes():
                self._write_local()  # a stranger's words: ours again
            return ""
        if self._take_local():
            log.warning("%s %s: its lock file was deleted or replaced by another process; "
                        "taken again", self.holder.what, self.where)
            return ""
        other = read_holder(self.store)
        return (f"its lock file {self.path} was replaced, and the new one is held by "
                f"{other.words() if other else 'another process'}")

    # -- URL: a lease -------------------------------------------------------------

    def _take_url(self) -> bool:
        existing, age = _read_url(self.store, self.path)
        there = existing is not None or age is not None
        if there and (existing is None or existing.nonce != self.holder.nonce):
            reason = _stale(existing, age)
            if reason is None:
                return False
            log.warning("%s %s: taking over the lock of %s: %s", self.holder.what, self.where,
                        existing.words() if existing else "an unknown owner", reason)
        self._write_url()
        time.sleep(SETTLE_S)
        back, _ = _read_url(self.store, self.path)
        return back is not None and back.nonce == self.holder.nonce

    def _write_url(self) -> None:
        self.holder = replace(self.holder, beat=time.time())
        self.store.makedirs(self.store.root)
        self.store.write_atomic(self.path, self.holder.to_bytes())

    def _keep_url(self) -> str:
        try:
            existing, _ = _read_url(self.store, self.path)
        except OSError as e:  # unreachable now: renewed at the next beat (stale only after STALE_S)
            log.warning("%s %s: cannot renew the lock (%s)", self.holder.what, self.where, e)
            return ""
        if existing is not None and existing.nonce != self.holder.nonce:
            return f"its lock {self.store.url_of(self.path)} was taken by {existing.words()}"
        try:
            self._write_url()  # (missing or a stranger's bytes: ours again)
        except OSError as e:
            log.warning("%s %s: cannot renew the lock (%s)", self.holder.what, self.where, e)
        return ""

    # -- either -------------------------------------------------------------------

    def take(self) -> bool:
        """Take the lock now: False when another owner holds it; UsageError when the storage
        refuses."""
        try:
            return self._take_local() if self.store.local else self._take_url()
        except OSError as e:
            raise UsageError(f"{self.holder.what} {self.where}: its lock "
                             f"{self.store.url_of(self.path)} cannot be read or written "
                             f"({e.strerror or e})") from e

    def keep(self) -> str:
        """Check (local) or renew (URL) the lock; the reason it is lost, "" while it holds."""
        with self._mutex:
            if self.lost or self.released or os.getpid() != self.pid:
                return self.lost
            self.lost = self._keep_local() if self.store.local else self._keep_url()
            return self.lost

    def check(self) -> None:
        """One beat of the keeper: ``keep``, and tell every ``on_lost`` listener once when the lock
        is lost."""
        was = self.lost
        try:
            reason = self.keep()
        except Exception as e:  # noqa: BLE001 - the keeper never dies: the next beat tries again
            log.warning("%s %s: checking its lock failed: %s", self.holder.what, self.where, e)
            return
        if reason and not was:
            log.error("%s %s: lost: %s", self.holder.what, self.where, reason)
            for listener in self.on_lost:
                with contextlib.suppress(Exception):
                    listener(reason)

    def release(self) -> None:
        """Remove the lock file if it still is ours, then let go of it."""
        with self._mutex:
            if self.released or os.getpid() != self.pid:
                return
            self.released = True
            self._release()

    def _release(self) -> None:
        if self.store.local:
            if self.fd is not None:
                if self._names_fd(self.fd):
                    with contextlib.suppress(OSError):
                        os.unlink(self.path)
                os.close(self.fd)
                self.fd = None
            return
        with contextlib.suppress(Exception):
            existing, _ = _read_url(self.store, self.path)
            if existing is not None and existing.nonce == self.holder.nonce:
                self.store.remove(self.path)


def _stale(holder: Holder | None, age: float | None) -> str | None:
    return stale_reason(holder, now=time.time(), record_age_s=age, host=socket.gethostname(),
                        boot_id=boot_id(), pid_start_here=pid_start, stale_s=STALE_S)


def _read_url(store: Store, path: str) -> tuple[Holder | None, float | None]:
    """The record at ``path`` and its age; (None, None) when there is none."""
    try:
        raw = store.read_bytes(path)
    except FileNotFoundError:
        return None, None
    mtime = store.mtime(path)
    return Holder.parse(raw), (time.time() - mtime) if mtime is not None else 0.0


def read_holder(store: Store) -> Holder | None:
    """Who the lock file under ``store`` names (None: no file, or not a record). Never call it on a
    lock this process holds locally: closing any descriptor of a file drops the process's POSIX
    locks on it."""
    path = store.join(LOCK_NAME)
    try:
        raw = store.read_bytes(path)
    except OSError:
        return None
    return Holder.parse(raw)


def live_owner(root: str | os.PathLike[str] | Store) -> str | None:
    """Who holds the folder now, in words; None when nobody does (a dead owner's file is no owner).

    For a process that does not hold it (``undying checkpoints``): a local lock
    is probed (taken and let go at once), a URL lease judged by the stale rule.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    with _guard:
        mine = _held.get(_key(store))
    # (never probed from here: closing a descriptor of it would drop this process's lock)
    if mine is not None:
        return mine.holder.words()
    path = store.join(LOCK_NAME)
    if not store.local:
        try:
            holder, age = _read_url(store, path)
        except OSError:
            return None
        if (holder is None and age is None) or _stale(holder, age) is not None:
            return None
        return holder.words() if holder else "another process"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            return None
        holder = Holder.parse(os.pread(fd, 4096, 0))
        return holder.words() if holder else "another process"
    finally:
        os.close(fd)  # (a probe that got the lock lets go of it here)
    return None


# -- the locks this process holds --------------------------------------------------

_held: dict[str, OwnerLock] = {}
_guard = threading.Lock()
_keeper: list[threading.Thread] = []


def _key(store: Store) -> str:
    return f"file:{os.path.realpath(store.root)}" if store.local else store.url_of(store.root)


def hold(root: str | os.PathLike[str] | Store, *, job_id: str, what: str = "checkpoint dir",
         on_lost: Callable[[str], None] | None = None, advice: str = "") -> OwnerLock:
    """Own ``root`` for this process's life, or raise DirInUseError naming its owner (one line).

    A folder this process already holds is not asked again (``on_lost`` is
    added to its listeners). ``advice``: what the refused user should do.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    key = _key(store)
    with _guard:
        lock = _held.get(key)
        if lock is not None:
            if on_lost is not None:
                lock.on_lost.append(on_lost)
            return lock
    try:
        store.makedirs(store.root)
    except OSError as e:
        raise UsageError(f"{what} {store.url_of(store.root)} cannot be created "
                         f"({e.strerror or e})") from e
    lock = OwnerLock(store, holder_here(job_id, what), on_lost)
    deadline = time.monotonic() + STALE_S + 2 * BEAT_S
    while not lock.take():
        other = read_holder(store)  # (not ours: reading it drops no lock of this process)
        same_job_elsewhere = other is not None and other.job_id == job_id and (
            not store.local or other.host != socket.gethostname())
        if other is None or not same_job_elsewhere or time.monotonic() > deadline:
            who = other.words() if other is not None else (
                "another process (its lock record is unreadable: a full disk, or another tool "
                "wrote it)")
            raise DirInUseError(f"{what} {lock.where} is in use by {who}: one job at a time"
                                + (f"; {advice}" if advice else ""))
        # The same job's, from another host: its relaunch (a pod rescheduled) waits for the dead
        # one's lease to run out (or an NFS server to drop a dead client's lock) rather than fail; a
        # live one keeps it.
        log.warning("%s %s is held by %s, last renewed %.0fs ago: waiting for it to end or go "
                    "stale (at most %.0fs more)", what, lock.where, other.words(),
                    time.time() - other.beat, deadline - time.monotonic())
        time.sleep(BEAT_S)
    with _guard:
        _held[key] = lock
        if not _keeper:
            thread = threading.Thread(target=_keep_all, name="undying-owner-lock", daemon=True)
            _keeper.append(thread)
            thread.start()
    return lock


def hold_job_dir(path: str | os.PathLike[str]) -> OwnerLock:
    """``hold`` for a job dir (one launcher or manager at a time); its record names the folder as
    the job."""
    return hold(os.fspath(path), job_id=os.path.basename(os.path.abspath(path)), what="job dir",
                advice="pass another --job-dir or --job-id")


def release(root: str | os.PathLike[str] | Store) -> None:
    """Let go of a folder this process holds (a no-op for one it does not)."""
    store = root if isinstance(root, Store) else Store.open(root)
    with _guard:
        lock = _held.pop(_key(store), None)
    if lock is not None:
        lock.release()


def _keep_all() -> None:
    while True:
        time.sleep(BEAT_S)
        with _guard:
            locks = list(_held.values())
        for lock in locks:
            lock.check()


@atexit.register
def release_all() -> None:
    """Let go of every folder this process holds: its job is over."""
    with _guard:
        locks = list(_held.values())
        _held.clear()
    for lock in locks:
        with contextlib.suppress(Exception):
            lock.release()
