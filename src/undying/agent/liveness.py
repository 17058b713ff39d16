"""What a rank's beats say about it: alive, hung (silent) or stalled (beating without progress).

A pure judgement of one rank at one moment, kept apart from the agent's loop
that watches every rank (``Agent._watch_heartbeats``) so that the rule reads in
one place and is tested without processes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from undying.config import Timeouts
from undying.protocol.kinds import WorkerPhase
from undying.protocol.worker_wire import Heartbeat

__all__ = ["Silence", "judge_silence", "is_stalled", "process_state", "has_exited"]


@dataclass(frozen=True)
class Silence:
    """A rank silent past its limit: ``phase`` is ``heartbeat`` (it beat before) or ``init`` (never)."""

    phase: str
    silent_s: float
    limit_s: float


def judge_silence(now: float, started: float, last_seen: float, timeouts: Timeouts,
                  step_api: bool) -> Silence | None:
    """The rank is hung when nothing came from it for its limit: the heartbeat timeout, or before its
    first message the init timeout (none for a script that never speaks to undying: whole-group restarts)."""
    if last_seen:
        phase, silent, limit = "heartbeat", now - last_seen, timeouts.heartbeat
    elif not step_api:
        return None
    else:
        phase, silent, limit = "init", now - started, timeouts.init
    return Silence(phase, silent, limit) if silent > limit else None


def is_stalled(beat: Heartbeat, step_timeout_s: float, timeouts: Timeouts) -> bool:
    """Beating without progress past the limit of its phase, by the beat's own clock.

    The beat's time, not the agent's: beats queued behind a busy loop are not a stall.
    """
    limit = (step_timeout_s if beat.phase == WorkerPhase.STEP
             else timeouts.init if beat.phase == WorkerPhase.INIT else 0)
    return bool(limit) and beat.t - beat.progress_t > limit


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``R`` running, ``S`` sleeping, ``D`` in I/O, ``T`` stopped,
    ``Z`` exited and not yet collected), or ``?`` where ``/proc`` does not say (gone, not Linux)."""
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]  # (the name in parentheses may hold spaces and ')')
    return "?"


def has_exited(pid: int) -> bool:
    """A silent rank that has already exited is not hung: its exit is on its way to the agent.

    A worker forked by the zygote stays a zombie until the agent has recorded
    its exit, which the zygote reports over its channel; on a host loaded
    enough to delay that report past the heartbeat timeout, the rank's
    silence would otherwise be taken for a hang and its orderly exit (a
    regroup member that saved and left) recovered as a fault.
    """
    return process_state(pid) in ("Z", "X")
