"""The other paths that replace a rank's state: the start, the two roll-backs, the regroup.

Recovery decides rank by rank from what every member holds (``holdings.plan``).
Every other path that replaces a rank's state gives every rank one copy, and
its decision is made here too, so that one package answers "where does this
rank's state come from, and why" whatever the path:

- ``plan_start``: a replacement receives its state from the members (then
  ``plan`` says from whom), a launch with a checkpoint loads it, any other
  starts from the script's own initial state;
- ``plan_numerics_rollback``: each rank's own in-memory snapshot of the newest
  pre-step state that every rank's ring still holds, at most N steps back (the
  suspect there is the data, not a rank's memory);
- ``plan_verify_rollback``: the holder's file of the last verified state, never
  a rank's own memory, and never the suspect's own copy of an unverified step;
- ``plan_regroup``: the members' own state of their newest step (saved, and the
  new world starts from that save), or, when the survivors cannot hold it whole
  (a sharded state), the latest checkpoint; then the checkpoint the new world
  starts from, and the steps it re-runs.

Each returns a ``StatePlan``: what it is for, the source (its kind, the rank
that holds it, its step, its file or checkpoint), the committed step every rank
holds after it, the committed steps undone, and the reason in words. Pure: it is
given what exists (a checkpoint found, what every ring holds) and decides; the
callers read and load.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from undying.checkpoint.layout import LayoutError
from undying.checkpoint.planner.holdings import UNREAD, PersistedState, Source, Unread
from undying.errors import NoStateSourceError

__all__ = [
    "Occasion", "StatePlan", "plan_start", "plan_numerics_rollback", "plan_verify_rollback",
    "plan_regroup",
]


class Occasion(str, enum.Enum):
    """Which path replaces the state (recovery's plans are ``RestorePlan``s, rank by rank)."""

    START = "start"
    NUMERICS_ROLLBACK = "numerics_rollback"
    VERIFY_ROLLBACK = "verify_rollback"
    REGROUP = "regroup"


@dataclass(frozen=True)
class StatePlan:
    """Where every rank's state comes from on one path, and why.

    ``step``: the committed step every rank holds once it is carried out (None:
    the checkpoint's own, known once it is read; or, for a replacement, the
    step of the members' restore plan). ``lost_steps``: committed steps undone
    (re-run, or skipped with their batches).
    """

    occasion: Occasion
    source: Source
    step: int | None
    reason: str
    lost_steps: int = 0

    def describe(self) -> str:
        """One line for a log or an event: the source and the reason."""
        return f"{self.occasion.value}: {self.source}; {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"occasion": self.occasion.value, "source": self.source.to_dict(), "step": self.step,
                "reason": self.reason, "lost_steps": self.lost_steps}


def _whole(value: object, what: str, lowest: int) -> int:
    if type(value) is not int or value < lowest:  # a bool is not a step
        raise LayoutError(f"{what} must be a whole number from {lowest}, got {value!r}")
    return value


def plan_start(*, joining: bool, checkpoint: PersistedState | None) -> StatePlan:
    """A process starting: where its state comes from before its first step.

    ``joining``: it replaces a lost rank (the members hand it their state, by the
    plan they make when it joins; a checkpoint is not read). ``checkpoint``: the
    one the job resumes from (the manager's latest valid one, or the one it was
    started on), None when there is none.
    """
    if joining:
        return StatePlan(Occasion.START, Source("peer"), None,
                         "a replacement for a lost rank: its state comes from the members, by "
                         "the restore plan they make when it joins")
    if checkpoint is not None:
        where = f" ({checkpoint.path})" if checkpoint.path else ""
        source = Source("checkpoint", step=checkpoint.step, path=checkpoint.path)
        return StatePlan(Occasion.START, source, checkpoint.step,
                         f"the job resumes from the checkpoint of step {checkpoint.step}{where}")
    return StatePlan(Occasion.START, Source("fresh", step=0), 0,
                     "no checkpoint to resume from: the script's own initial state, from step 1")


def plan_numerics_rollback(
    *, step: int, rollback_steps: int, oldest: Sequence[int | None]
) -> StatePlan:
    """Step ``step`` failed its numeric check twice the same way: back at most ``rollback_steps``
    steps.

    ``oldest``: for every rank, the oldest step whose pre-step state its
    snapshot ring holds (None: none); a ring holds every step from it to
    ``step``. Every rank goes back to the same step: the latest pre-state that
    every ring holds, ``step - rollback_steps + 1`` at the earliest. When that
    is ``step`` itself no state is replaced (the batch is skipped).
    """
    _whole(step, "the failed step", 1)
    _whole(rollback_steps, "the steps to roll back", 1)
    if not oldest:
        raise LayoutError("a numerics roll-back needs every rank's ring (none given)")
    for held in oldest:
        if held is not None and (_whole(held, "a ring's oldest step", 1) > step):
            raise LayoutError(f"a ring holds the pre-state of step {held} at the earliest, "
                              f"after the failed step {step}: it belongs to another loop")
    back_to = max([step - rollback_steps + 1,
                   *(step if held is None else held for held in oldest)])
    if back_to >= step:
        return StatePlan(Occasion.NUMERICS_ROLLBACK, Source("self", step=step - 1), step - 1,
                         f"no earlier state held (the ring starts at step {step}): the batch is "
                         "skipped")
    return StatePlan(Occasion.NUMERICS_ROLLBACK, Source("snapshot", step=back_to - 1), back_to - 1,
                     f"every rank loads its own snapshot of the state before step {back_to}, the "
                     f"newest every rank's ring holds ({rollback_steps} step(s) back at most); "
                     f"the batches of steps {back_to}..{step} are skipped",
                     lost_steps=step - back_to)


def plan_verify_rollback(*, world_size: int, bad_step: int, bad_rank: int, rollback_to: int,
                         holder: int, committed: int, file: str = "") -> StatePlan:
    """Rank ``bad_rank``'s gradients of ``bad_step`` differ from their replay: back to a verified
    state.

    ``rollback_to``: the step whose pre-step state every rank loads (the last
    verified one, or ``bad_step``'s own, which the replay started from);
    ``holder``: the rank that wrote that state to ``file``; ``committed``: the
    step the job had committed. Every rank loads the file, never its own
    memory (a rank whose memory is corrupt must not restore its own copy), and
    an unverified state is never the suspect's: NoStateSourceError then.
    """
    _whole(world_size, "the world size", 1)
    _whole(bad_step, "the failed step", 1)
    _whole(rollback_to, "the step to roll back to", 1)
    _whole(committed, "the committed step", 0)
    for rank, what in ((bad_rank, "the suspect"), (holder, "the holder")):
        if type(rank) is not int or not 0 <= rank < world_size:
            raise LayoutError(f"{what} rank {rank!r} is outside 0..{world_size - 1}")
    if rollback_to > bad_step or rollback_to > committed + 1:
        raise LayoutError(f"a roll-back to the state before step {rollback_to} is not back: the "
                          f"failed step is {bad_step}, the job committed step {committed}")
    verified = rollback_to < bad_step
    if not verified and holder == bad_rank and world_size > 1:
        raise NoStateSourceError(
            f"step {bad_step}: the only state named to roll back to is rank {bad_rank}'s own "
            f"pre-step copy, and rank {bad_rank} is the suspect: its memory may be the corrupt "
            "one; the job stops rather than load it")
    which = ("the last verified one" if verified else
             "the failed step's own, which the replay started from")
    source = Source("holder_file", holder, rollback_to - 1, file)
    return StatePlan(Occasion.VERIFY_ROLLBACK, source, rollback_to - 1,
                     f"step {bad_step}: rank {bad_rank}'s gradients differ from their replay: "
                     f"every rank loads the state after step {rollback_to - 1} ({which}) from "
                     f"rank {holder}'s file, not from its own memory",
                     lost_steps=committed - rollback_to + 1)


def plan_regroup(*, members: Sequence[int], newest: int, sharded: bool,
                 checkpoint: PersistedState | Unread = UNREAD) -> StatePlan:
    """An elastic job moves to the nodes it has: which state the new world starts from.

    Before anything is saved (``checkpoint`` UNREAD): ``members`` (the live
    ranks) hold ``newest``, the newest step a rank committed; they keep it,
    save it and leave (``Source("self")``), unless the state is sharded (not
    whole on the survivors: a lost node's shards and their replicas were there)
    or none is left: then the latest checkpoint. Once saved (``checkpoint``: the
    members' save, else the newest valid one): every rank of the new world
    loads it, and the steps after it are re-run.
    """
    _whole(newest, "the newest step", 0)
    if isinstance(checkpoint, PersistedState):
        where = f" ({checkpoint.path})" if checkpoint.path else ""
        lost = max(0, newest - checkpoint.step)
        source = Source("checkpoint", step=checkpoint.step, path=checkpoint.path)
        rerun = (f"; steps {checkpoint.step + 1}..{newest} are re-run" if lost else
                 ", no step lost")
        return StatePlan(Occasion.REGROUP, source, checkpoint.step,
                         "the new world starts from the checkpoint of step "
                         f"{checkpoint.step}{where}" + rerun,
                         lost_steps=lost)
    live = sorted(members)
    if live and not sharded:
        return StatePlan(Occasion.REGROUP, Source("self", step=newest), newest,
                         f"ranks {live} hold step {newest}: they agree on it (the restore plan of "
                         "their regroup generation), save it, and the job starts again from that "
                         "save")
    why = ("a sharded state is not whole on the survivors (a lost node's shards and their "
           "replicas were there)" if live else "no rank is left to save the state")
    return StatePlan(Occasion.REGROUP, Source("checkpoint"), None,
                     f"{why}: the job starts again from its latest checkpoint, its steps since "
                     "re-run")
