"""What a rank's beats say about it: alive, hung (silent) or stalled (beating without progress).

A pure judgement of one rank at one moment, kept apart from the agent's loop
that watches every rank (``HangWatch``, agent/hang_watch.py) so that the rule reads in
one place and is tested without processes.

The watch judges silence only over time the agent itself ran: its loop ticks a
judge clock (``watch_clock``, ``protocol/judge_clock.py``), and after a stall of
the agent's own (the agent stopped, paused or starved) every rank and spare
gets a fresh window: an agent continued after a pause declares nothing about
it. A stall is judged by the beats' own times (the rank's clock), which a
pause of the agent does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from undying.config import AUTO_STEP_TIMEOUT_FACTOR, AUTO_STEP_TIMEOUT_FLOOR_S, Timeouts
from undying.procfs import process_state
from undying.protocol.judge_clock import JudgeClock
from undying.protocol.kinds import WorkerPhase
from undying.protocol.worker_wire import Heartbeat

__all__ = ["Silence", "judge_silence", "step_timeout", "is_stalled", "stall_to_report",
           "process_state", "has_exited", "watch_clock"]


@dataclass(frozen=True)
class Silence:
    """A rank silent past its limit: ``phase`` is ``heartbeat`` (it beat before) or ``init``
    (never)."""

    phase: str
    silent_s: float
    limit_s: float


def watch_clock(node: int, timeouts: Timeouts) -> JudgeClock:
    """The judge clock of a node's watch over its ranks and spares (ticked once a pass of the
    watch)."""
    heartbeat_s = timeouts.heartbeat_timeout
    return JudgeClock(min(0.2, heartbeat_s / 5), heartbeat_s, f"node {node}'s agent")


def judge_silence(now: float, started: float, last_seen: float, timeouts: Timeouts,
                  step_api: bool, clock: JudgeClock | None = None) -> Silence | None:
    """The rank is hung when nothing came from it for its limit: the heartbeat timeout, or before
    its first message the init timeout (none for a script that never speaks to undying: whole-group
    restarts).

    Times are the wall clock's. With the watch's ``clock``, silence counts only
    from the agent's return from a stall of its own (a fresh window).
    """
    if last_seen:
        phase, since, limit = "heartbeat", last_seen, timeouts.heartbeat_timeout
    elif not step_api:
        return None
    else:
        phase, since, limit = "init", started, timeouts.init_timeout
    silent = now - (clock.counts_from(since, wall=True) if clock is not None else since)
    return Silence(phase, silent, limit) if silent > limit else None


def step_timeout(configured: float | None, slowest_recent_step_s: float | None) -> float:
    """The stall limit in a step: ``--step-timeout`` as given, or with auto (None) derived here, its
    one place, from the observed step times: ``AUTO_STEP_TIMEOUT_FACTOR`` x the slowest recent step,
    at least ``AUTO_STEP_TIMEOUT_FLOOR_S`` (a step that needs a minute now and then is not a
    hang)."""
    if configured is not None:
        return configured
    if slowest_recent_step_s is None:
        return AUTO_STEP_TIMEOUT_FLOOR_S
    return max(AUTO_STEP_TIMEOUT_FLOOR_S, AUTO_STEP_TIMEOUT_FACTOR * slowest_recent_step_s)


def is_stalled(beat: Heartbeat, step_timeout: float, timeouts: Timeouts) -> bool:
    """Beating without progress past the limit of its phase, by the beat's own clock
    (``step_timeout``: the limit in a step, as ``step_timeout()`` gives it).

    The beat's time, not the agent's: beats queued behind a busy loop are not a stall.
    """
    limit = (step_timeout if beat.phase == WorkerPhase.STEP
             else timeouts.init_timeout if beat.phase == WorkerPhase.INIT else 0)
    return bool(limit) and beat.t - beat.progress_t > limit


def stall_to_report(beat: Heartbeat, reported: tuple[float, float], now: float,
                    step_timeout: float, timeouts: Timeouts) -> bool:
    """Whether to report a rank's stall: stalled (``is_stalled``) and either a new one (another
    progress time than the one last reported, ``reported[0]``) or one that lasted another
    ``step_timeout`` since it was reported (at ``reported[1]``): the manager may have judged the
    first report too early (a rank behind that still moved) and must hear it again."""
    new = beat.progress_t != reported[0] or now - reported[1] > step_timeout
    return new and is_stalled(beat, step_timeout, timeouts)


def has_exited(pid: int) -> bool:
    """A silent rank that has already exited is not hung: its exit is on its way to the agent.

    A worker forked by the zygote stays a zombie until the agent has recorded
    its exit, which the zygote reports over its channel; on a host loaded
    enough to delay that report past the heartbeat timeout, the rank's
    silence would otherwise be taken for a hang and its orderly exit (a
    regroup member that saved and left) recovered as a fault.
    """
    return process_state(pid) in ("Z", "X")
