"""Recovery's plan: after a fault, where every rank's state comes from
(docs/architecture.md).

One pure function, ``plan``, of the parallel layout, what every member holds
and the persisted checkpoint: the manager calls it with its view to decide,
and every worker with the holdings all members exchanged (so all get the same
plan without asking anyone), then carries it out. No torch, no I/O here.

The world is a ``dp x tp x pp`` grid numbered by ``order`` (fastest first;
the default is Megatron-LM's). A rank's *shard* is its ``(tp, pp)``: every
rank of a data-parallel group holds the same. DDP is ``dp = world``, a fully
sharded state (FSDP) ``tp = world``. A copy of a shard at a step is, best
first: the rank's own live state (``self``), its in-memory ``snapshot``, a
``peer``'s live state (same shard), a ring ``replica`` kept by another rank
(``replica_of[holder] = owner``), the ``checkpoint``. Receivers (lowest first)
are dealt round-robin over the donors (lowest first): deterministic, spread.

The plan's step (``target``) is the newest at which every shard has a copy in
memory, so no completed work is thrown away and steps are never mixed; only
when there is none does the checkpoint count. One older than the members'
state rolls every rank back (every shard must be in it); one of the current
step (a dying gasp) only fills the gaps. Without any such step ``plan``
raises ``MissingShardsError`` naming every shard without a copy.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

from undying.checkpoint.layout import Layout, LayoutError, Shard
from undying.errors import NoStateSourceError

__all__ = [
    "Member",
    "PersistedState",
    "UNREAD",
    "Unread",
    "Source",
    "SourceKind",
    "RestorePlan",
    "MissingShardsError",
    "ring_replica_of",
    "plan",
]


@dataclass(frozen=True)
class PersistedState:
    """What a persisted checkpoint offers: the step it holds and which shards (None: all
    of them).

    A torch.distributed.checkpoint save is complete for any layout (it reshards
    on load): leave ``shards`` None. Per-shard files (e.g. dying-gasp files of
    only the leaving ranks) list the shards they hold.
    """

    step: int
    shards: frozenset[Shard] | None = None
    path: str = ""

    def __post_init__(self) -> None:
        if self.step < 0:
            raise LayoutError(f"a checkpoint step must be >= 0, got {self.step}")
        if self.shards is not None:
            object.__setattr__(self, "shards",
                               frozenset(Shard(*s) for s in self.shards))

    def holds(self, shard: Shard) -> bool:
        return self.shards is None or shard in self.shards


class Unread(enum.Enum):
    """A checkpoint not read (reading checks every file: I/O a restore from memory must
    not pay)."""

    UNREAD = "unread"


UNREAD: Final = Unread.UNREAD


class Member(NamedTuple):
    """What one member holds after the fault: a worker reports its own; the manager knows
    less.

    ``step`` is the last step it committed (0: none yet); ``clean`` says its
    live state is that step's (False when a failed step's optimizer already
    stepped); ``has_state`` is False for a lost rank or a replacement that has
    received nothing. ``snapshots`` are steps of its own in-memory snapshots,
    ``replicas`` steps of the copies it keeps of ``replica_of[rank]``'s shard.
    """

    rank: int
    step: int = 0
    clean: bool = True
    has_state: bool = True
    snapshots: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()

    @classmethod
    def lost(cls, rank: int, step: int = 0) -> Member:
        """A rank whose state is gone (``step``: the last it committed, for the count of
        lost steps)."""
        return cls(rank, step, clean=False, has_state=False)

    def live_at(self, step: int) -> bool:
        return self.has_state and self.clean and self.step == step

    def __str__(self) -> str:
        return (f"rank {self.rank}: committed {self.step}, clean={self.clean}, "
                f"has_state={self.has_state}")


# Where a rank's state comes from, best first; ``holder_file`` (a verified state another
# rank wrote) and ``fresh`` (the script's own initial state) are only the start's and the
# roll-backs' (``planner.paths``).
SourceKind = Literal["self", "snapshot", "peer", "replica", "checkpoint", "holder_file",
                     "fresh"]


@dataclass(frozen=True)
class Source:
    """Where one rank's state comes from: ``rank`` is the donor (peer, replica, the holder
    of a file), ``step`` the copy's step (the last step committed in it), ``path`` its file
    or checkpoint."""

    kind: SourceKind
    rank: int | None = None
    step: int | None = None
    path: str = ""

    def __str__(self) -> str:
        if self.kind == "peer":
            return f"peer rank {self.rank}"
        if self.kind == "replica":
            return f"replica on rank {self.rank}"
        if self.kind == "snapshot":
            return f"its own snapshot of step {self.step}"
        if self.kind == "checkpoint":
            if self.step is None:
                return "the latest checkpoint"
            return f"checkpoint of step {self.step}"
        if self.kind == "holder_file":
            return f"rank {self.rank}'s file of the state after step {self.step}"
        if self.kind == "fresh":
            return "the script's own initial state"
        return "self"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "rank": self.rank, "step": self.step}
        if self.path:
            out["path"] = self.path
        return out


@dataclass(frozen=True)
class RestorePlan:
    """Every rank's source (``sources[r]``), the step all hold after it (None: read the
    checkpoint and plan again), the rollback when any state comes from the checkpoint, and
    the steps committed past it (re-run)."""

    layout: Layout
    failed: frozenset[int]
    sources: tuple[Source, ...]
    target: int | None = None
    rollback_step: int | None = None
    lost_steps: int | None = None
    checkpoint_path: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def source(self, rank: int) -> Source:
        return self.sources[rank]

    @property
    def needs_checkpoint(self) -> bool:
        return self.rollback_step is not None

    @property
    def read_checkpoint(self) -> bool:
        """No step has every shard in memory: read the latest checkpoint and plan again
        with it."""
        return self.target is None

    def transfers(self) -> list[tuple[int, int]]:
        """(donor, receiver) pairs of the in-memory transfers (peer and replica sources)."""
        return [
            (s.rank, r) for r, s in enumerate(self.sources)
            if s.kind in ("peer", "replica") and s.rank is not None
        ]

    def describe(self) -> str:
        """One line for a log: who gets what from where, and the rollback."""
        moved = [f"rank {r} <- {s}" for r, s in enumerate(self.sources)
                 if s.kind != "self"]
        text = "; ".join(moved) if moved else "every rank keeps its own state"
        if self.target is None:
            text += "; no step has every shard in memory: the latest checkpoint decides"
        elif self.rollback_step is not None:
            text += f"; the job rolls back to step {self.rollback_step}"
            if self.lost_steps is not None:
                text += f" ({self.lost_steps} steps lost)"
        elif self.lost_steps:
            text += (f"; the job goes back to step {self.target} in memory "
                     f"({self.lost_steps} steps re-run)")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "failed": sorted(self.failed),
            "sources": [s.to_dict() for s in self.sources],
            "target": self.target,
            "rollback_step": self.rollback_step,
            "lost_steps": self.lost_steps,
            "checkpoint": self.checkpoint_path,
            "notes": list(self.notes),
        }


_SELF = Source("self")
# A refusal names at most this many members (the rest are counted): an 8,192-rank job's
# error stays readable.
_NAMED_MEMBERS = 16


class MissingShardsError(NoStateSourceError):
    """No complete state exists: ``missing`` lists every shard no source holds (and
    ``plan`` is None)."""

    def __init__(self, missing: Sequence[Shard], message: str) -> None:
        super().__init__(message)
        self.missing: tuple[Shard, ...] = tuple(missing)


def ring_replica_of(world_size: int, offset: int) -> dict[int, int]:
    """A ring's replicas, holder -> owner: rank r's shard is kept by rank
    ``(r + offset) % world_size``."""
    if offset % max(world_size, 1) == 0:
        return {}
    return {(r + offset) % world_size: r for r in range(world_size)}


def _whole_job(members: Iterable[Member], layout: Layout) -> list[Member]:
    """The members by rank; LayoutError unless they are exactly the ranks of the layout,
    once each."""
    by_rank = sorted(members)  # by rank: ranks differ (checked next), so nothing else is compared
    ranks = [m.rank for m in by_rank]
    if ranks != list(range(layout.world_size)):
        more = " ..." if len(ranks) > _NAMED_MEMBERS else ""
        raise LayoutError(
            f"members from ranks {ranks[:_NAMED_MEMBERS]}{more} are not one whole job of "
            f"{layout.world_size} ranks (every rank 0..{layout.world_size - 1} once)"
        )
    return by_rank


def _replica_map(replica_of: Mapping[int, int] | None, layout: Layout) -> dict[int, int]:
    replicas = dict(replica_of or {})
    _ranks(replicas, layout, "replica holder")
    _ranks(replicas.values(), layout, "replicated")
    for holder, owner in replicas.items():
        if holder == owner:
            raise LayoutError(f"rank {holder} is listed as holding a replica of its own shard")
    return replicas


def _ranks(values: Iterable[int], layout: Layout, what: str) -> frozenset[int]:
    out = frozenset(values)
    world = layout.world_size
    for r in out:
        if type(r) is not int or not 0 <= r < world:  # a bool is not a rank
            raise LayoutError(f"{what} rank {r!r} is outside 0..{world - 1}")
    return out


def _common_snapshots(by_rank: Sequence[Member], ranks: Sequence[int]) -> set[int]:
    """Steps every one of ``ranks`` keeps a snapshot of (a snapshot serves only its own rank)."""
    own: set[int] | None = None
    for r in ranks:
        m = by_rank[r]
        if not (m.has_state and m.snapshots):
            return set()
        own = set(m.snapshots) if own is None else own.intersection(m.snapshots)
    return own or set()


def _deal(receivers: Sequence[int], donors: Sequence[int]) -> dict[int, int]:
    """Receivers (lowest first) dealt round-robin over donors (lowest first):
    deterministic and spread."""
    return {r: donors[i % len(donors)] for i, r in enumerate(receivers)}


def plan(
    layout: Layout,
    members: Iterable[Member],
    *,
    replica_of: Mapping[int, int] | None = None,
    checkpoint: PersistedState | Unread | None = None,
) -> RestorePlan:
    """Where every rank's state comes from, given what every member holds (the one
    restore planner).

    ``members``: one per rank of ``layout``, in any order. ``replica_of``:
    holder -> owner of in-memory replicas (``ring_replica_of``). ``checkpoint``:
    the latest valid persisted state, None when there is none, or ``UNREAD``
    when it was not read (then a plan that needs it has ``read_checkpoint``).

    The step is the newest at which every shard has a copy in memory; only
    when there is none does the checkpoint count (its step, for the shards it
    holds). Raises MissingShardsError naming every shard without a copy, and
    LayoutError for members that are not the layout's ranks, a bad replica
    map, or a checkpoint newer than every member's step.
    """
    by_rank = _whole_job(members, layout)
    replicas = _replica_map(replica_of, layout)
    newest = max((m.step for m in by_rank), default=0)
    ckpt = checkpoint if isinstance(checkpoint, PersistedState) else None
    if ckpt is not None and ckpt.step > newest:
        raise LayoutError(
            f"the checkpoint is of step {ckpt.step}, newer than the current step "
            f"{newest} (the newest any member committed); it belongs to another run: "
            "point the job at its own checkpoint directory"
        )
    shard_of, holders_of = layout._shard_table
    all_shards = layout._all_shards
    failed = frozenset(m.rank for m in by_rank if not m.has_state)

    # Copies by shard and step: live states (any rank of the shard can use them), ring
    # replicas.
    live: dict[Shard, dict[int, list[int]]] = {}
    ring: dict[Shard, dict[int, list[int]]] = {}
    snapshots = False
    for m in by_rank:
        if not m.has_state:
            continue
        if m.clean:
            live.setdefault(shard_of[m.rank], {}).setdefault(m.step, []).append(m.rank)
        owner = replicas.get(m.rank) if m.replicas else None
        if owner is not None:
            keeps = ring.setdefault(shard_of[owner], {})
            for step in set(m.replicas):
                keeps.setdefault(step, []).append(m.rank)
        snapshots = snapshots or bool(m.snapshots)
    memory: dict[Shard, set[int]] = {}
    common: set[int] | None = None
    for s in all_shards:
        steps = set(live.get(s, ()))
        steps.update(ring.get(s, ()))
        if snapshots:
            steps |= _common_snapshots(by_rank, holders_of[s])
        memory[s] = steps
        common = set(steps) if common is None else common & steps
    if not common and checkpoint is UNREAD:
        why = "no step has every shard in memory: read the latest checkpoint and plan again"
        return RestorePlan(layout, failed, tuple(Source("checkpoint") for _ in by_rank),
                           None, None, None, "", (why,))
    if not common:
        on_disk = {s: memory[s] | ({ckpt.step} if ckpt is not None and ckpt.holds(s)
                                   else set())
                   for s in all_shards}
        common = set.intersection(*on_disk.values()) if on_disk else set()
        if not common:
            raise _refusal(layout, by_rank, memory, on_disk, ckpt)
    target = max(common)

    sources: list[Source] = [_SELF] * layout.world_size
    needy: dict[Shard, list[int]] = {}
    for m in by_rank:
        if m.has_state:
            if m.clean and m.step == target:
                continue
            if target in m.snapshots:
                sources[m.rank] = Source("snapshot", m.rank, target)
                continue
        needy.setdefault(shard_of[m.rank], []).append(m.rank)
    from_disk = False
    for shard, receivers in needy.items():
        peers, holders = live.get(shard, {}).get(target), ring.get(shard, {}).get(target)
        if peers:
            for r, donor in _deal(receivers, sorted(peers)).items():
                sources[r] = Source("peer", donor)
        elif holders:
            for r, donor in _deal(receivers, sorted(holders)).items():
                sources[r] = Source("replica", donor, target)
        else:
            assert ckpt is not None and ckpt.step == target and ckpt.holds(shard)
            from_disk = True
            for r in receivers:
                sources[r] = Source("checkpoint", step=target)
    notes: list[str] = []
    if from_disk:
        assert ckpt is not None
        kept = sum(1 for s in sources if s.kind != "checkpoint")
        notes.append(
            f"the checkpoint is of the current step {target}: survivors keep their state"
            if kept else
            f"some shard exists only in the checkpoint of step {target}: every rank loads it"
        )
    return RestorePlan(
        layout, failed, tuple(sources), target, target if from_disk else None,
        max(0, newest - target),
        ckpt.path if from_disk and ckpt is not None else "", tuple(notes),
    )


def _refusal(
    layout: Layout, by_rank: Sequence[Member], memory: Mapping[Shard, set[int]],
    on_disk: Mapping[Shard, set[int]], ckpt: PersistedState | None,
) -> MissingShardsError:
    """No step has a copy of every shard: name the shards that stop it, and the members."""
    holders_of = layout._shard_table[1]
    all_shards = layout._all_shards
    lacking = [s for s in all_shards if not on_disk[s]]
    only_on_disk = [s for s in all_shards if not memory[s]]
    fix = ("the job cannot continue; periodic checkpoints (--save-every) or ring replicas "
           "(--replicate ring) would have kept them")
    if lacking:
        why = ("lost with every holder and replica, and there is no checkpoint"
               if ckpt is None else
               "lost with every holder and replica, and not in the checkpoint of step "
               f"{ckpt.step}")
        missing = lacking
    elif ckpt is not None:
        missing = [s for s in all_shards if ckpt.step not in on_disk[s]]
        only = ", ".join(map(str, only_on_disk)) or "none"
        why = (f"are needed at step {ckpt.step} to roll back (shards {only} exist only "
               "there) but are in memory only at other steps and not in that checkpoint")
        fix = "restart from a checkpoint that holds every shard"
    else:
        newest = max(set().union(*memory.values()))
        missing = [s for s in all_shards if newest not in memory[s]]
        why = (f"have no copy at step {newest}, and no step has a copy of every shard; "
               "there is no checkpoint")
    named = ", ".join(f"{s} (ranks {', '.join(map(str, holders_of[s]))})" for s in missing)
    shown = "; ".join(str(m) for m in by_rank[:_NAMED_MEMBERS])
    more = (f"; and {len(by_rank) - _NAMED_MEMBERS} more"
            if len(by_rank) > _NAMED_MEMBERS else "")
    return MissingShardsError(
        missing,
        f"no complete state: {len(missing)} shard(s) {why}: {named}; {fix} "
        f"(members: {shown}{more})",
    )
