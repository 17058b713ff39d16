"""The manager's restore plan after an incident: where every rank's state comes from, and why.

The manager decides a recovery's rung from the one restore planner
(``checkpoint/planner``), asked with the manager's view of the members: the
ranks that failed (the incident's, the exited, the replacements still waiting
for state) hold nothing, every other holds the newest committed step, and, for
a sharded state with ring replicas, its snapshot and replica of the last
replicated step. The checkpoint is read only when no step has every shard in
memory; the plan that read it is the one the restart rung carries out.
"""

from __future__ import annotations

from undying.checkpoint import Checkpoint
from undying.checkpoint.layout import Layout, LayoutError
from undying.checkpoint.planner.coarse import coarse_members
from undying.checkpoint.planner.holdings import (
    UNREAD,
    MissingShardsError,
    PersistedState,
    RestorePlan,
    Unread,
    plan,
    ring_replica_of,
)
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore

__all__ = ["plan_after"]


def plan_after(core: JobCore, checkpoints: Checkpoints,
               failed: set[int]) -> tuple[RestorePlan | None, str, Checkpoint | None]:
    """The plan when the ranks ``failed`` hold nothing, its words, and the checkpoint it read (None:
    none). No plan (None): no complete state exists, and the words say which shard is missing."""
    world = core.book.world_size
    newest = core.book.newest_step()
    layout, replica_of, every = Layout(dp=world), {}, 0
    if checkpoints.sharded:
        # Every rank holds a shard of its own (dp=1, tp=world); a ring replica is on rank +
        # offset, replicated every `every` steps.
        state_layout = checkpoints.state_layout
        offset = int(state_layout.get("offset", 0))
        layout = Layout(dp=1, tp=world)
        if checkpoints.ring and offset > 0:
            replica_of = ring_replica_of(world, offset)
            every = max(1, int(state_layout.get("every", 1)))

    def plan_at(step: int, checkpoint: PersistedState | Unread | None) -> RestorePlan:
        members = coarse_members(world, failed, step, replica_of=replica_of,
                                 copies_at=step - step % every if every else None)
        return plan(layout, members, replica_of=replica_of, checkpoint=checkpoint)

    read: Checkpoint | None = None
    try:
        # from memory; the checkpoint is read only when no step is whole
        found = plan_at(newest, UNREAD)
        if found.read_checkpoint:
            ckpt = checkpoints.latest()
            # (ranks that resumed from the checkpoint and committed nothing yet report step 0)
            found = (plan_at(max(newest, ckpt.step), PersistedState(ckpt.step, path=ckpt.url))
                     if ckpt else plan_at(newest, None))
            read = ckpt
    except (MissingShardsError, LayoutError) as e:
        return None, str(e), None
    return found, found.describe(), read
