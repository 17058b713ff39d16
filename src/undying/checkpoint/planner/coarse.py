"""The manager's view today: who failed, and the step the survivors hold.

The manager does not gather every member's holdings; it knows the failed ranks,
the step the survivors committed and the ring. ``coarse_members`` turns that
into the ``Member``s ``plan`` takes (``holdings``): one caller's approximation
of what the members hold, kept apart from the planner that every caller uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from undying.checkpoint.layout import LayoutError
from undying.checkpoint.planner.holdings import Member

__all__ = ["coarse_members"]


def coarse_members(
    world_size: int, failed: Iterable[int], step: int, *,
    replica_of: Mapping[int, int] | None = None, copies_at: int | None = None,
) -> list[Member]:
    """Members as a manager sees them: the failed ranks lost, the others clean at
    ``step``; with a ring (``replica_of``) each survivor keeps its snapshot and its replica
    of ``copies_at`` (default ``step``: replicated every step; with
    ``UNDYING_REPLICATE_EVERY=k``, the last multiple of k)."""
    lost = frozenset(failed)
    for r in lost:
        if type(r) is not int or not 0 <= r < world_size:  # a bool is not a rank
            raise LayoutError(f"failed rank {r!r} is outside 0..{world_size - 1}")
    holders = frozenset(replica_of or ())
    at = step if copies_at is None else copies_at
    snapshots = (at,) if holders and at != step else ()
    return [Member.lost(r, step) if r in lost else
            Member(r, step, snapshots=snapshots, replicas=(at,) if r in holders else ())
            for r in range(world_size)]
