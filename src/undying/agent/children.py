"""The agent's own children: every worker is one, and nothing a rank starts outlives it.

Decision (issue #25: the zygote is a fork server and nothing more). The agent
is a child subreaper (``PR_SET_CHILD_SUBREAPER``) while it runs, and its
zygote forks each worker detached (a go-between that exits at once,
worker/zygote.py), so every worker is the agent's child whether it was forked
or started as a fresh interpreter. So:

- the agent sees a worker's exit itself (a pidfd per worker, read by its
  event loop: ``ChildProcess``), and collects the status with its own
  ``waitpid`` of that PID: a killed or stopped zygote changes neither;
- a worker dies with the agent (its parent-death signal names the agent, not
  the zygote), so no worker is ever an orphan;
- a process a rank started, that the rank no longer holds (its parent died,
  the rank itself included), is re-parented to the agent, not to init,
  whatever session or process group it made for itself (``setsid``): the
  agent ends it (``Orphans``). A rank the agent ends has its whole tree ended
  first (``kill_tree``), the descendants it still holds included.

Why the reasons once given against a subreaper do not hold here:

- *process-wide state in the launcher's process* (which may host the manager
  and, in tests, pytest): the attribute is set when an agent starts and
  cleared when it closes; it only decides who receives the orphans of this
  process's descendants, which would otherwise go to init and live on;
- *it adopts every orphaned grandchild, whose zombies it must reap without
  stealing the statuses of its other subprocesses*: the agent never waits for
  "any child". It reaps a PID it holds a pidfd for (its workers), and an
  adopted orphan only when that process carries this agent's mark
  (``UNDYING_AGENT_PID`` with the agent's PID in its environment, inherited
  from a worker): a subprocess of anything else in the process (a
  ``subprocess.Popen`` of the manager's or a test's) is not adopted (it has
  its parent), and an orphan without the mark is left to whoever waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import time

from undying.protocol.env import AGENT_PID_ENV

__all__ = ["ChildProcess", "become_subreaper", "release_subreaper", "descendants", "kill_tree",
           "Orphans", "WATCHED"]

log = logging.getLogger("undying.agent")

_PR_SET_CHILD_SUBREAPER = 36
# PIDs of the workers this process watches (until their exit is read): never taken for orphans.
WATCHED: set[int] = set()


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphans of this process's descendants come to it, not to init; False where the platform
    cannot."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def release_subreaper() -> None:
    _prctl(_PR_SET_CHILD_SUBREAPER, 0)


class ChildProcess:
    """A worker that is this process's child (forked detached by the zygote), watched by a pidfd.

    The interface of ``PopenProcess``: ``pid``, ``returncode`` (as Popen says
    it: -N for signal N), ``wait()``. The PID stays this process's zombie until
    the exit is read here, so it is never reused while the agent may signal it.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        loop = asyncio.get_running_loop()
        self._done: asyncio.Future[int] = loop.create_future()
        try:
            self._fd = os.pidfd_open(pid)
        except OSError:  # (already reaped by someone else: nothing to watch, nothing known)
            self._fd = -1
            self._exited(-signal.SIGKILL)
            return
        WATCHED.add(pid)
        loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            # not ours after all (no subreaper): it is gone, its status unknown
            pid, status = self.pid, 9
        if pid == 0:
            return  # (a stop is not an exit: waitpid without WUNTRACED reports only exits)
        asyncio.get_running_loop().remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        WATCHED.discard(self.pid)
        self._exited(os.waitstatus_to_exitcode(status))

    def _exited(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._done.set_result(returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc (a process gone meanwhile is skipped)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), whatever session or group each made."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant of it (own sessions and groups
    included)."""
    below = descendants(pid)
    for target in [pid, *below]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # (a leader's group; a non-leader has none of that number)
            os.killpg(target, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)


def _own_children() -> list[int]:
    """This process's children (of every thread of it)."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for task in tasks:
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/children") as f:
            pids.extend(int(p) for p in f.read().split())
    return pids


def _marked(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


class Orphans:
    """Processes a rank started and no longer holds, adopted by the agent: ended, then reaped.

    ``sweep`` runs on the agent's watch (every fraction of a second). An adopted
    process is given ``grace_s`` to end by itself first (a rank's ``tee`` or
    a helper finishing its last write when its rank exits), then SIGKILLed with
    its own descendants. ``known`` is what the agent started itself (workers,
    spares, its zygote): never an orphan.
    """

    def __init__(self, grace_s: float = 1.0) -> None:
        self.grace_s = grace_s
        # (what every worker's environment holds)
        self._mark = f"{AGENT_PID_ENV}={os.getpid()}".encode()
        self._seen: dict[int, float] = {}  # adopted PID -> when first seen
        self.ended: list[int] = []  # (for the log and tests)

    def sweep(self, known: set[int], now: float | None = None,
              grace_s: float | None = None) -> list[int]:
        """End adopted orphans past their grace, reap the dead ones; the PIDs ended this time."""
        now = time.monotonic() if now is None else now
        ended: list[int] = []
        current: set[int] = set()
        for pid in _own_children():
            # Seen marked while alive, or marked now (a zombie's environment reads empty: it counts
            # as ours only if it was seen before it died; one that died unseen is left to whoever
            # waits).
            if pid in known or pid in WATCHED or (pid not in self._seen
                                                  and not _marked(pid, self._mark)):
                continue
            current.add(pid)
            if self._reap(pid):
                current.discard(pid)
                continue
            first = self._seen.setdefault(pid, now)
            if now - first >= (self.grace_s if grace_s is None else grace_s):
                log.warning("pid %d, started by a rank that no longer holds it, "
                            "outlived it by %.1fs: ended", pid, now - first)
                kill_tree(pid)
                ended.append(pid)
                self.ended.append(pid)
        for pid in set(self._seen) - current:
            del self._seen[pid]
        return ended

    @staticmethod
    def _reap(pid: int) -> bool:
        """Reap ``pid`` if it has exited (True); it is this process's adopted child, no one else's
        status."""
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        return done != 0

    async def end_all(self, known: set[int], timeout: float = 2.0) -> None:
        """At the agent's end: every orphan ended now and reaped (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            self.sweep(known, grace_s=0.0)
            if not self._seen or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.05)
