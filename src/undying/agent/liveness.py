"""What a rank's beats say about it: alive, hung (silent) or stalled (beating without progress).

A pure judgement of one rank at one moment, kept apart from the agent's loop
that watches every rank (``Agent._watch_heartbeats``) so that the rule reads in
one place and is tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from undying.config import Timeouts
from undying.protocol.kinds import WorkerPhase
from undying.protocol.worker_wire import Heartbeat

__all__ = ["Silence", "judge_silence", "is_stalled"]


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
