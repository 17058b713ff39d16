"""A regroup's decisions, pure functions of the regroup's record and the job's facts.

When an elastic job grows, when the world forms again once every member left
(or waits for nodes, or fails), when a broken regroup re-plans, and when a
wait has lasted too long. ``regrouping.Regrouping`` is the executor: it opens
generations, aborts and kills ranks, looks for the saved checkpoint, and logs.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from undying.manager.regroup.record import Regroup, max_attempts

__all__ = ["Grow", "grow", "World", "WorldNext", "waiting_for_members", "form_world", "Replan",
           "replan", "overdue"]


@dataclass(frozen=True)
class Grow:
    """Regroup to take in ``nodes``: the job grows to ``size`` nodes."""

    nodes: list[int]
    size: int

    @property
    def named(self) -> str:
        return f"node{'s' if len(self.nodes) > 1 else ''} {', '.join(map(str, self.nodes))}"


def grow(*, elastic: bool, available: Sequence[int], trained: Sequence[int], nnodes: int,
         running: bool, recovering: bool, any_done: bool) -> Grow | None:
    """An elastic job below MAX with a node here it does not train on grows,
    only while it runs undisturbed.

    A node that joins during a recovery is taken once it completed; none once a
    rank finished its last step.
    """
    extra = [n for n in available if n not in trained]
    if not elastic or not extra or not running or recovering or len(trained) >= nnodes or any_done:
        return None
    return Grow(extra, min(nnodes, len(trained) + len(extra)))


class WorldNext(str, enum.Enum):
    FAIL = "fail"  # nothing to start from
    WAIT_FOR_NODES = "wait-for-nodes"  # the state is saved; fewer than MIN nodes are here
    FORM = "form"  # start the job on ``nodes`` from the checkpoint


@dataclass(frozen=True)
class World:
    next: WorldNext
    nodes: list[int] = field(default_factory=list)
    reason: str = ""
    lost_steps: int = 0  # steps committed after the checkpoint, which the new world re-runs
    first_wait: bool = False  # the wait for nodes begins now (said once)


def waiting_for_members(regroup: Regroup, *, now: float, heartbeat_s: float,
                        all_attached: bool) -> bool:
    """Members that have not left yet,
    or a restarted manager giving its agents their heartbeat to come back."""
    if regroup.remaining():
        return True
    return (bool(regroup.restored_at) and now - regroup.restored_at < heartbeat_s
            and not all_attached)


def form_world(regroup: Regroup, *, checkpoint_step: int | None, checkpoint_dir: str,
               available: Sequence[int], nnodes: int, fewest: int) -> World:
    """Every member left: start on the nodes here from the checkpoint, wait for nodes,
    or fail saying why.

    ``checkpoint_step``: the regroup's checkpoint (the members' save, else the
    newest valid one); None when there is none.
    """
    if checkpoint_step is None:
        return World(WorldNext.FAIL, reason=(
            f"{regroup.cause()}: no rank saved the state (exits: {regroup.left or 'none alive'}) "
            f"and there is no checkpoint in {checkpoint_dir} to start from"))
    nodes = list(available[:nnodes])
    if len(nodes) < fewest:
        return World(WorldNext.WAIT_FOR_NODES, nodes, first_wait=not regroup.waiting_since)
    return World(WorldNext.FORM, nodes, lost_steps=max(0, regroup.step - checkpoint_step))


class Replan(str, enum.Enum):
    NONE = "none"
    AGAIN = "again"  # the live members meet in a new regroup generation
    FAIL = "fail"  # it broke as often as it may


def replan(regroup: Regroup, *, now: float, max_retries: int) -> Replan:
    """A second fault broke the regroup before the state was saved: re-plan, within the bound."""
    if not regroup.replan_due(now):
        return Replan.NONE
    limit = max_attempts(regroup.first_members, max_retries)
    return Replan.FAIL if regroup.attempt >= limit else Replan.AGAIN


def overdue(regroup: Regroup, *, now: float, rendezvous_s: float, recovery_s: float, fewest: int,
            available: Sequence[int], saved_step: int, saved_at: str, resumed: float = 0.0) -> str:
    """Why the regroup fails now ("" while it may go on): no node came within the rendezvous
    timeout, or the members did not save and leave within the recovery timeout.

    ``resumed``: when the manager came back from a stall of its own (``protocol/judge_clock.py``;
    0.0: never). A wait counts from its start or from then, whichever is later: a manager that did
    not run heard none of the joins and reports that waited unread meanwhile.
    """
    if regroup.waiting_since:
        if now - max(regroup.waiting_since, resumed) <= rendezvous_s:
            return ""
        return (f"{regroup.cause()}; the job needs {fewest} node(s) and has {len(available)} "
                f"({list(available)}), and none joined within the rendezvous timeout "
                f"({rendezvous_s:.0f}s). The state of step {saved_step} is saved in {saved_at}: "
                "start the missing nodes (`undying run --node-rank I --manager ...`) and run the "
                "job again to resume from it")
    if now - max(regroup.started, resumed) > recovery_s:
        still = sorted(set(regroup.members) - set(regroup.left))
        return (f"{regroup.cause()}; ranks {still} did not save and leave within the recovery "
                f"timeout ({recovery_s:.0f}s)")
    return ""
