"""A regroup's record, and what a second fault during one makes of it.

A regroup (``Manager._begin_regroup``) moves an elastic job to the nodes it
has: the live ranks meet in a generation of their own, agree on the newest
clean step, one of them (the restore's donor) saves it, and every one leaves
once the save is confirmed; the job then starts again from that checkpoint.

Faults do not wait for it to end. A member may crash, hang or lose its node
while the donor saves, or the donor itself may die before its checkpoint is
committed. The regroup then does what any recovery does, on its own terms:

- the state is saved already (a member reported the checkpoint): the members
  still there hold nothing more, so they are let go, and the job starts again
  from that checkpoint;
- it is not: the members still alive meet again in a new regroup generation,
  renumbered (a *re-plan*), and one of them saves it. A member that saw the
  group break (a failed collective) reports it; the re-plan waits the
  comm-error grace for an exit that explains it, so one fault opens one
  generation, not one per report;
- no member is left: the job starts from the latest valid checkpoint (the
  planner's last rung), or fails saying there is none.

Whichever it is, the job needs ``MIN`` nodes to start again; with fewer it
waits for a host within the rendezvous timeout and then fails, naming every
fault the regroup met (:meth:`Regroup.cause`). Re-plans are bounded.

The record is kept in the job table of the event log (key ``regroup``) as
it changes, in the same transactions as the agents' report positions, so a
manager restarted mid-regroup reads back exactly what the reports it will
not be sent again told the old one (:meth:`Regroup.from_log`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from undying.config import EXIT_REGROUPED

if TYPE_CHECKING:
    from undying.checkpoint import Checkpoint

__all__ = ["Regroup", "LOG_KEY", "SAVED_KINDS", "max_attempts"]

# The job table's key for the regroup under way (null when none is).
LOG_KEY = "regroup"
# A CheckpointSaved of these kinds, during a regroup, is the regroup's state on disk
# ("existing": the checkpoint of that step was there already, the donor reused it).
SAVED_KINDS = ("regroup", "existing")


def max_attempts(members: int, max_retries: int) -> int:
    """Regroup generations one regroup may open: one per member it can lose,
    plus the link retries' budget.

    Every re-plan after an exit has one member fewer, so only broken links
    (no member lost) could re-plan without end; they get ``max_retries``.
    """
    return members + max(1, max_retries) + 1


@dataclass
class Regroup:
    """The job moving to another set of nodes."""

    why: str
    members: dict[int, int]  # old rank -> its number in the current regroup generation
    step: int  # the newest step a member had committed
    # the regroup generation; -1: no member holds the state, a checkpoint is the source
    generation: int = -1
    started: float = field(default_factory=time.time)  # when the current attempt began
    left: dict[int, int] = field(default_factory=dict)  # member (of any attempt) -> its exit code
    waiting_since: float = 0.0  # every member left, too few nodes: waiting for more to join
    checkpoint: Checkpoint | None = None  # what the job starts from once it has the nodes
    attempt: int = 1  # regroup generations opened for it (a re-plan opens one more)
    first_members: int = 0  # how many members its first attempt had (bounds the re-plans)
    # overlapping faults, in order (named in a failure)
    faults: list[str] = field(default_factory=list)
    saved: str = ""  # where a member reported the regroup's state saved ("": not yet)
    replan_at: float = 0.0  # a re-plan is due at this time (0: none)
    broken: str = ""  # a failed collective that made it due, while no exit explains it
    released: list[int] = field(default_factory=list)  # members let go once the state was saved
    restored_at: float = 0.0  # carried on by a restarted manager since then (0: never restarted)

    # --- what happened ----------------------------------------------------------

    def remaining(self) -> list[int]:
        """Members of the current attempt that have not left."""
        return sorted(set(self.members) - set(self.left))

    def member_left(self, rank: int, returncode: int, fault: str) -> bool:
        """A member's process ended; True when that is a fault (an incident of its own).

        It left as asked (exit 77, once the save was confirmed), or it was let
        go: no fault. Anything else is; while the state is unsaved it breaks
        the current attempt, and a re-plan is due at once.
        """
        self.left[rank] = returncode
        if returncode == EXIT_REGROUPED or rank in self.released:
            return False
        if fault not in self.faults:  # (a node's ranks are lost together: one fault)
            self.faults.append(fault)
        if not self.saved:
            self.broken = ""  # the exit explains the broken group
            self.replan_at = time.time()
        return True

    def group_broke(self, generation: int, what: str, grace_s: float) -> None:
        """A member's collective failed in ``generation``: a re-plan is due after the grace,
        unless it is stale.

        The exit that explains it usually arrives within the grace and makes
        the re-plan due at once; a broken link alone (or a manager restarted
        while the members formed their group) re-plans after the grace.
        """
        if generation != self.generation or self.waiting_since or self.replan_at:
            return
        self.broken = self.broken or what
        if not self.saved:  # (saved: whoever waits for the next attempt is let go, see to_release)
            self.replan_at = time.time() + grace_s

    def on_saved(self, path: str) -> None:
        self.saved = self.saved or path

    # --- what to do next ----------------------------------------------------------

    def to_release(self) -> list[int]:
        """Members still there after a disturbed regroup whose state is saved:
        they hold nothing more."""
        if not self.saved or not (self.faults or self.broken) or self.waiting_since:
            return []
        return [r for r in self.remaining() if r not in self.released]

    def replan_due(self, now: float) -> bool:
        return (bool(self.replan_at) and now >= self.replan_at and not self.saved
                and not self.waiting_since)

    def successor(self, members: list[int], step: int) -> Regroup:
        """The next attempt: ``members`` (the live ones) renumbered;
        what the regroup learned is kept."""
        faults = [*self.faults, self.broken] if self.broken else list(self.faults)
        return Regroup(
            why=self.why, members={r: i for i, r in enumerate(members)},
            step=max(self.step, step), left=dict(self.left), attempt=self.attempt + 1,
            first_members=self.first_members, faults=faults, saved=self.saved,
            released=list(self.released), restored_at=self.restored_at)

    def cause(self) -> str:
        """Why the job regroups, and every fault that overlapped it."""
        if not self.faults:
            return self.why
        return f"{self.why}; during the regroup: {'; '.join(self.faults)}"

    # --- views and the log ------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        return {
            "why": self.why, "members": sorted(self.members), "left": sorted(self.left),
            "step": self.step, "generation": self.generation, "started": self.started,
            "waiting_for_nodes_since": self.waiting_since or None,
            "checkpoint": self.checkpoint.url if self.checkpoint else (self.saved or None),
            "attempt": self.attempt, "faults": list(self.faults),
        }

    def to_log(self) -> dict[str, Any]:
        """What a restarted manager needs to carry the regroup on (plain JSON)."""
        return {
            "why": self.why, "members": {str(r): m for r, m in self.members.items()},
            "step": self.step,
            "generation": self.generation, "started": self.started,
            "left": {str(r): c for r, c in self.left.items()},
            "waiting_since": self.waiting_since, "attempt": self.attempt,
            "first_members": self.first_members, "faults": list(self.faults),
            "saved": self.saved, "released": list(self.released),
        }

    @classmethod
    def from_log(cls, data: dict[str, Any], *, now: float | None = None) -> Regroup:
        """The regroup a dead manager left under way;
        its checkpoint is looked for again when the world forms."""
        return cls(
            why=str(data["why"]), members={int(r): int(m) for r, m in data["members"].items()},
            step=int(data["step"]), generation=int(data["generation"]),
            started=float(data["started"]),
            left={int(r): int(c) for r, c in data.get("left", {}).items()},
            waiting_since=float(data.get("waiting_since", 0.0)),
            attempt=int(data.get("attempt", 1)),
            first_members=int(data.get("first_members", len(data["members"]))),
            faults=[str(f) for f in data.get("faults", [])], saved=str(data.get("saved", "")),
            released=[int(r) for r in data.get("released", [])],
            restored_at=time.time() if now is None else now,
        )
