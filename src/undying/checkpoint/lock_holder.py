"""Who holds an owner lock: the record its file holds, this process's own, and when a record no
longer holds.

``checkpoint/lock.py`` takes, keeps and lets go of the locks; this is what their
file says (``Holder``, one JSON record), how this process describes itself
(``holder_here``: its host, boot, pid and the pid's start time, so a reused pid
is not taken for the owner) and the stale rule of a URL lease (``stale_reason``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["STALE_S", "Holder", "boot_id", "pid_start", "holder_here", "stale_reason"]

STALE_S = 60.0  # a URL lock not renewed this long is stale (12 missed renewals)


@dataclass(frozen=True)
class Holder:
    """What a lock file says about its owner."""

    job_id: str
    what: str  # "checkpoint dir", "job dir"
    host: str
    boot_id: str
    pid: int
    # The pid's start time in clock ticks since boot (tells a reused pid from the owner)
    pid_start: int
    nonce: str
    since: float
    beat: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        """The record, or None for anything that is not one (empty, a stranger's bytes)."""
        try:
            d = json.loads(raw)
            return cls(str(d["job_id"]), str(d["what"]), str(d["host"]), str(d["boot_id"]),
                       int(d["pid"]), int(d["pid_start"]), str(d["nonce"]), float(d["since"]),
                       float(d["beat"]))
        except (ValueError, KeyError, TypeError):
            return None

    def words(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"job {self.job_id} (pid {self.pid} on host {self.host}, since {since})"


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_start(pid: int) -> int:
    """The start time of ``pid`` (clock ticks since boot), 0 when it does not exist or cannot be
    read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def holder_here(job_id: str, what: str) -> Holder:
    """The record this process writes as a folder's owner (``what``: "checkpoint dir", "job
    dir")."""
    now = time.time()
    pid = os.getpid()
    return Holder(job_id, what, socket.gethostname(), boot_id(), pid, pid_start(pid),
                  secrets.token_hex(8), now, now)


def stale_reason(holder: Holder | None, *, now: float, record_age_s: float | None, host: str,
                 boot_id: str, pid_start_here: Callable[[int], int],
                 stale_s: float = STALE_S) -> str | None:
    """Why a URL lock's record no longer holds its folder, or None while it does (pure but for the
    callable).

    ``record_age_s``: how long ago the store says the record was written (None:
    it does not say); ``pid_start_here``: a pid's start time on this host (0: gone).
    """
    if holder is None:
        if record_age_s is not None and record_age_s > stale_s:
            return f"its record is unreadable and {record_age_s:.0f}s old"
        return None  # a stranger's scribble over a live owner's record: the owner writes it again
    if holder.host == host and holder.boot_id == boot_id and holder.boot_id:
        started = pid_start_here(holder.pid)
        if started == 0:
            return f"its process {holder.pid} on this host is gone"
        if holder.pid_start and started != holder.pid_start:
            return f"its pid {holder.pid} on this host is now another process"
        # Its process exists here (running, or stopped: it may wake and write), whatever its beat
        return None
    age = now - holder.beat
    if age > stale_s:
        return f"it was last renewed {age:.0f}s ago (stale after {stale_s:.0f}s)"
    return None
