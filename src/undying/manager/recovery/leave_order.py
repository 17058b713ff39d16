"""The survivors of a generation a recovery leaves behind: told to leave it, judged if they do not.

Every survivor must leave the old generation. Where nothing ended by itself
(a collective stuck on every rank, a retry of a link, a planned move), each is
told to at once (an ``abort``: its group's connections break, so its
collective fails). Where the fault's process is gone (a crash, a hang killed),
the survivors are first only watched: their links to it close, so a
collective that needs it fails by itself, and one that does not (the lost rank
had sent its part of the step before it died) finishes; breaking that
survivor's links at once would throw a finished step away and run it again.
They are also told at once which steps can finish nowhere (``from_step``: past
the newest step any rank committed, ``worker_wire.Abort``): a survivor in one
of those leaves now, rather than when its neighbour in gloo's ring gives up
(the failure travels the ring a rank at a time); one finishing an earlier step
leaves at the next step's start. One still in the old generation after the
step in flight had time to end (``abort_due``: at least ``_ABORT_MIN_S``, at
least the longest step) waits on a peer that waits too, and is told then.

A survivor that has still neither failed nor joined the new generation a
while later (``stuck``) is in a wait that will never end: gloo leaves a send
queued to a peer that went away unsignalled, so its collective waits out the
whole collective timeout however its sockets end. Such a rank is killed and
replaced in the round (``left_behind.py``).

Every time counts from the telling or from the manager's return from a stall
of its own (``protocol/judge_clock.py``), whichever is later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from undying.jobfiles.records import RankInfo, RankState

__all__ = ["LeaveOrder"]

# How long a watched survivor may take to end its step in flight before it is told to leave: at
# least this, and at least the job's longest step.
_ABORT_MIN_S = 1.0
# How long a survivor may take to leave before it counts as stuck: at least this, and at least
# _LEAVE_STEPS of the job's longest step (a rank inside a long step's compute leaves at its next
# collective, which fails at once).
_LEAVE_MIN_S = 5.0
_LEAVE_STEPS = 3


@dataclass
class LeaveOrder:
    """The survivors of generation ``previous`` that must leave it, by the process each had then."""

    previous: int
    reason: str
    t: float  # when it was given
    aborted: bool  # whether they were told (their links broken), or only watched so far
    told: dict[int, int] = field(default_factory=dict)  # rank -> the process that must leave

    def lingering(self, ranks: dict[int, RankInfo], generation: int, now: float, resumed: float,
                  limit: float) -> list[RankInfo]:
        """Those still running in a generation before ``generation``, ``limit`` seconds on."""
        if now - max(self.t, resumed) <= limit:
            return []
        return [info for info in ranks.values()
                if self.told.get(info.rank) == info.pid and info.pid
                and info.state is RankState.RUNNING and info.generation < generation]

    def abort_due(self, ranks: dict[int, RankInfo], generation: int, now: float, resumed: float,
                  longest_step_s: float) -> list[RankInfo]:
        """Watched survivors still in the step in flight after it had its time: to be told now."""
        if self.aborted:
            return []
        return self.lingering(ranks, generation, now, resumed, max(_ABORT_MIN_S, longest_step_s))

    def stuck(self, ranks: dict[int, RankInfo], generation: int, now: float, resumed: float,
              longest_step_s: float) -> list[RankInfo]:
        """Survivors that neither failed nor joined ``generation`` in time: gloo never lets go."""
        limit = max(_LEAVE_MIN_S, _LEAVE_STEPS * longest_step_s)
        return self.lingering(ranks, generation, now, resumed, limit)
