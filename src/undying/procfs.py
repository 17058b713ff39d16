"""What Linux's ``/proc`` says of a process: its state letter, its parent.

Several parts judge another process by it (a stopped manager, a hung rank, the holder of a
job dir's lock), so it is read in one place, on the contract floor every layer may import.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["process_state", "parent_pid", "is_zombie"]


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``R`` running, ``S`` sleeping, ``D`` in I/O, ``T``
    stopped, ``t`` held by a debugger, ``Z`` exited and not yet collected), or ``?`` where
    ``/proc`` does not say (gone, not Linux)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        return stat[stat.rindex(")") + 2]  # (the name in parentheses may hold spaces and ')')
    return "?"


def parent_pid(pid: int) -> int | None:
    """The PID of ``pid``'s parent, or None where ``/proc`` does not say (gone, not Linux)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        return int(stat[stat.rindex(")") + 2:].split()[1])
    return None


def is_zombie(pid: int) -> bool:
    """Exited, its exit status not collected yet: it holds nothing and runs no more, though its
    PID still answers ``kill(pid, 0)`` (an orphan waits for whoever adopts it to collect it)."""
    return process_state(pid) in ("Z", "X")
