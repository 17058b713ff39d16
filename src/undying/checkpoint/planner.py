"""Restore planning: after a fault, where every rank's state comes from (DESIGN.md §4).

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

import dataclasses
import enum
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

from undying.errors import NoStateSourceError, UsageError

__all__ = [
    "Layout",
    "LayoutError",
    "Shard",
    "Member",
    "PersistedState",
    "UNREAD",
    "Source",
    "RestorePlan",
    "MissingShardsError",
    "ring_replica_of",
    "plan",
    "plan_restore",
    "plan_for_ddp",
]

DIMS = ("tp", "dp", "pp")
# Megatron-LM numbers ranks tensor-parallel fastest, then data-parallel, then pipeline.
MEGATRON_ORDER: tuple[str, str, str] = ("tp", "dp", "pp")

class LayoutError(UsageError):
    """A parallel layout that does not describe the world: bad sizes, order, or ranks out of range."""


class Shard(NamedTuple):
    """The part of the state a rank holds: its tensor- and pipeline-parallel coordinates."""

    tp: int
    pp: int

    def __str__(self) -> str:
        return f"(tp={self.tp}, pp={self.pp})"


class Coords(NamedTuple):
    """A rank's position in the grid."""

    dp: int
    tp: int
    pp: int

    @property
    def shard(self) -> Shard:
        return Shard(self.tp, self.pp)


@dataclass(frozen=True)
class Layout:
    """A ``dp x tp x pp`` grid and how ranks are numbered in it (``order``: fastest dimension first)."""

    dp: int
    tp: int = 1
    pp: int = 1
    order: tuple[str, str, str] = MEGATRON_ORDER

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel size {name} must be an integer >= 1, got {value!r}")
        if sorted(self.order) != sorted(DIMS):
            raise LayoutError(
                f"rank order must name each of tp, dp, pp once (fastest first), got {self.order!r}"
            )
        object.__setattr__(self, "order", tuple(self.order))

    @classmethod
    def for_world(
        cls, world_size: int, *, dp: int | None = None, tp: int = 1, pp: int = 1,
        order: Sequence[str] = MEGATRON_ORDER,
    ) -> Layout:
        """The layout of ``world_size`` ranks; ``dp`` defaults to what is left after tp and pp.

        Raises LayoutError when ``dp * tp * pp != world_size`` (the message says by how much).
        """
        if tp < 1 or pp < 1:
            raise LayoutError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
        if dp is None:
            if world_size % (tp * pp):
                raise LayoutError(
                    f"world size {world_size} is not a multiple of tp*pp = {tp}*{pp} = {tp * pp}"
                )
            dp = world_size // (tp * pp)
        names = tuple(order)
        if len(names) != 3:
            raise LayoutError(f"rank order must name each of tp, dp, pp once (fastest first), got {names!r}")
        layout = cls(dp, tp, pp, (names[0], names[1], names[2]))
        layout.check_world(world_size)
        return layout

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def check_world(self, world_size: int) -> None:
        """Raise LayoutError unless this grid has exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            raise LayoutError(
                f"parallel layout dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} ranks, "
                f"but the world has {world_size}; make dp*tp*pp equal the number of ranks"
            )

    def _size(self, dim: str) -> int:
        return int(getattr(self, dim))

    @functools.cached_property
    def _grid(self) -> tuple[Coords, ...]:
        """Every rank's coordinates, computed once (plans ask for them many times)."""
        out = []
        for rank in range(self.world_size):
            at: dict[str, int] = {}
            rest = rank
            for dim in self.order:
                size = self._size(dim)
                at[dim] = rest % size
                rest //= size
            out.append(Coords(at["dp"], at["tp"], at["pp"]))
        return tuple(out)

    def coords(self, rank: int) -> Coords:
        """Where ``rank`` sits in the grid."""
        self._check_rank(rank)
        return self._grid[rank]

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        """The rank at grid position (dp, tp, pp)."""
        given = {"dp": dp, "tp": tp, "pp": pp}
        rank, stride = 0, 1
        for dim in self.order:
            size = self._size(dim)
            if not 0 <= given[dim] < size:
                raise LayoutError(f"{dim}={given[dim]} is outside 0..{size - 1}")
            rank += given[dim] * stride
            stride *= size
        return rank

    @functools.cached_property
    def _shard_table(self) -> tuple[tuple[Shard, ...], dict[Shard, tuple[int, ...]]]:
        """Every rank's shard and every shard's holders, computed once."""
        by_rank = tuple(c.shard for c in self._grid)
        holders: dict[Shard, list[int]] = {}
        for rank, shard in enumerate(by_rank):
            holders.setdefault(shard, []).append(rank)
        return by_rank, {s: tuple(rs) for s, rs in holders.items()}

    def shard_of(self, rank: int) -> Shard:
        self._check_rank(rank)
        return self._shard_table[0][rank]

    @functools.cached_property
    def _all_shards(self) -> tuple[Shard, ...]:
        return tuple(Shard(tp, pp) for pp in range(self.pp) for tp in range(self.tp))

    def shards(self) -> list[Shard]:
        """Every shard of the state, in (pp, tp) order."""
        return list(self._all_shards)

    def holders(self, shard: Shard) -> list[int]:
        """The ranks that hold ``shard`` (its data-parallel group), lowest first."""
        found = self._shard_table[1].get(Shard(*shard))
        if found is None:
            raise LayoutError(f"shard {shard} is outside tp 0..{self.tp - 1}, pp 0..{self.pp - 1}")
        return list(found)

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank!r} is outside 0..{self.world_size - 1}")

    def to_dict(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "order": list(self.order)}


@dataclass(frozen=True)
class PersistedState:
    """What a persisted checkpoint offers: the step it holds and which shards (None: all of them).

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
            object.__setattr__(self, "shards", frozenset(Shard(*s) for s in self.shards))

    def holds(self, shard: Shard) -> bool:
        return self.shards is None or shard in self.shards


class Unread(enum.Enum):
    """A checkpoint not read (reading checks every file: I/O a restore from memory must not pay)."""

    UNREAD = "unread"


UNREAD: Final = Unread.UNREAD


@dataclass(frozen=True)
class Member:
    """What one member holds after the fault: a worker reports its own; the manager knows less.

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
        """A rank whose state is gone (``step``: the last it committed, for the count of lost steps)."""
        return cls(rank, step, clean=False, has_state=False)

    def live_at(self, step: int) -> bool:
        return self.has_state and self.clean and self.step == step

    def __str__(self) -> str:
        return f"rank {self.rank}: committed {self.step}, clean={self.clean}, has_state={self.has_state}"


SourceKind = Literal["self", "snapshot", "peer", "replica", "checkpoint"]


@dataclass(frozen=True)
class Source:
    """Where one rank's state comes from: ``rank`` is the donor (peer, replica), ``step`` the copy's step."""

    kind: SourceKind
    rank: int | None = None
    step: int | None = None

    def __str__(self) -> str:
        if self.kind == "peer":
            return f"peer rank {self.rank}"
        if self.kind == "replica":
            return f"replica on rank {self.rank}"
        if self.kind == "snapshot":
            return f"its own snapshot of step {self.step}"
        if self.kind == "checkpoint":
            return "the latest checkpoint" if self.step is None else f"checkpoint of step {self.step}"
        return "self"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "step": self.step}


@dataclass(frozen=True)
class RestorePlan:
    """Every rank's source (``sources[r]``), the step all hold after it (None: read the checkpoint and plan
    again), the rollback when any state comes from the checkpoint, and the steps committed past it (re-run)."""

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
        """No step has every shard in memory: read the latest checkpoint and plan again with it."""
        return self.target is None

    def transfers(self) -> list[tuple[int, int]]:
        """(donor, receiver) pairs of the in-memory transfers (peer and replica sources)."""
        return [
            (s.rank, r) for r, s in enumerate(self.sources)
            if s.kind in ("peer", "replica") and s.rank is not None
        ]

    def describe(self) -> str:
        """One line for a log: who gets what from where, and the rollback."""
        moved = [f"rank {r} <- {s}" for r, s in enumerate(self.sources) if s.kind != "self"]
        text = "; ".join(moved) if moved else "every rank keeps its own state"
        if self.target is None:
            text += "; no step has every shard in memory: the latest checkpoint decides"
        elif self.rollback_step is not None:
            text += f"; the job rolls back to step {self.rollback_step}"
            if self.lost_steps is not None:
                text += f" ({self.lost_steps} steps lost)"
        elif self.lost_steps:
            text += f"; the job goes back to step {self.target} in memory ({self.lost_steps} steps re-run)"
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
# A refusal names at most this many members (the rest are counted): an 8,192-rank job's error stays readable.
_NAMED_MEMBERS = 16


class MissingShardsError(NoStateSourceError):
    """No complete state exists: ``missing`` lists every shard no source holds (and ``plan`` is None)."""

    def __init__(self, missing: Sequence[Shard], message: str) -> None:
        super().__init__(message)
        self.missing: tuple[Shard, ...] = tuple(missing)


def ring_replica_of(world_size: int, offset: int) -> dict[int, int]:
    """A ring's replicas, holder -> owner: rank r's shard is kept by rank ``(r + offset) % world_size``."""
    if offset % max(world_size, 1) == 0:
        return {}
    return {(r + offset) % world_size: r for r in range(world_size)}


def _whole_job(members: Iterable[Member], layout: Layout) -> list[Member]:
    """The members by rank; LayoutError unless they are exactly the ranks of the layout, once each."""
    by_rank = sorted(members, key=lambda m: m.rank)
    ranks = [m.rank for m in by_rank]
    if ranks != list(range(layout.world_size)):
        raise LayoutError(
            f"members from ranks {ranks[:_NAMED_MEMBERS]}{' ...' if len(ranks) > _NAMED_MEMBERS else ''} "
            f"are not one whole job of {layout.world_size} ranks (every rank 0..{layout.world_size - 1} once)"
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


def _deal(receivers: Sequence[int], donors: Sequence[int]) -> dict[int, int]:
    """Receivers (lowest first) dealt round-robin over donors (lowest first): deterministic and spread."""
    return {r: donors[i % len(donors)] for i, r in enumerate(receivers)}


def plan(
    layout: Layout,
    members: Iterable[Member],
    *,
    replica_of: Mapping[int, int] | None = None,
    checkpoint: PersistedState | Unread | None = None,
) -> RestorePlan:
    """Where every rank's state comes from, given what every member holds (the one restore planner).

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
            f"the checkpoint is of step {ckpt.step}, newer than the current step {newest} (the newest any member "
            "committed); it belongs to another run: point the job at its own checkpoint directory"
        )
    shard_of, holders_of = layout._shard_table
    all_shards = layout._all_shards
    failed = frozenset(m.rank for m in by_rank if not m.has_state)

    # Copies by shard and step: live states (any rank of the shard can use them), ring replicas.
    live: dict[Shard, dict[int, list[int]]] = {s: {} for s in all_shards}
    ring: dict[Shard, dict[int, list[int]]] = {s: {} for s in all_shards}
    for m in by_rank:
        if not m.has_state:
            continue
        if m.clean:
            live[shard_of[m.rank]].setdefault(m.step, []).append(m.rank)
        owner = replicas.get(m.rank)
        if owner is not None:
            for step in set(m.replicas):
                ring[shard_of[owner]].setdefault(step, []).append(m.rank)
    # A snapshot serves only its own rank: a shard is whole at a step its shared copies cover, or every
    # one of its ranks has a snapshot of.
    memory: dict[Shard, set[int]] = {}
    for s in all_shards:
        own: set[int] | None = None
        for r in holders_of[s]:
            m = by_rank[r]
            mine = set(m.snapshots) if m.has_state else set()
            own = mine if own is None else own & mine
        memory[s] = set(live[s]) | set(ring[s]) | (own or set())

    common = set.intersection(*memory.values()) if memory else set()
    if not common and checkpoint is UNREAD:
        return RestorePlan(layout, failed, tuple(Source("checkpoint") for _ in by_rank), None, None, None, "",
                           ("no step has every shard in memory: read the latest checkpoint and plan again",))
    on_disk = {s: memory[s] | ({ckpt.step} if ckpt is not None and ckpt.holds(s) else set()) for s in all_shards}
    if not common:
        common = set.intersection(*on_disk.values()) if on_disk else set()
    if not common:
        raise _refusal(layout, by_rank, memory, on_disk, ckpt)
    target = max(common)

    sources: list[Source] = [_SELF] * layout.world_size
    needy: dict[Shard, list[int]] = {}
    for m in by_rank:
        if m.live_at(target):
            continue
        if m.has_state and target in m.snapshots:
            sources[m.rank] = Source("snapshot", m.rank, target)
        else:
            needy.setdefault(shard_of[m.rank], []).append(m.rank)
    from_disk = False
    for shard, receivers in needy.items():
        peers, holders = live[shard].get(target), ring[shard].get(target)
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
        notes.append(f"the checkpoint is of the current step {target}: survivors keep their state" if kept else
                     f"some shard exists only in the checkpoint of step {target}: every rank loads it")
    return RestorePlan(
        layout, failed, tuple(sources), target, target if from_disk else None, max(0, newest - target),
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
    fix = "the job cannot continue; periodic checkpoints (--save-every) or ring replicas (--replicate ring) " \
          "would have kept them"
    if lacking:
        why = ("lost with every holder and replica, and there is no checkpoint" if ckpt is None else
               f"lost with every holder and replica, and not in the checkpoint of step {ckpt.step}")
        missing = lacking
    elif ckpt is not None:
        missing = [s for s in all_shards if ckpt.step not in on_disk[s]]
        why = (f"are needed at step {ckpt.step} to roll back (shards {', '.join(map(str, only_on_disk)) or 'none'} "
               "exist only there) but are in memory only at other steps and not in that checkpoint")
        fix = "restart from a checkpoint that holds every shard"
    else:
        newest = max(set().union(*memory.values()))
        missing = [s for s in all_shards if newest not in memory[s]]
        why = f"have no copy at step {newest}, and no step has a copy of every shard; there is no checkpoint"
    named = ", ".join(f"{s} (ranks {', '.join(map(str, holders_of[s]))})" for s in missing)
    shown = "; ".join(str(m) for m in by_rank[:_NAMED_MEMBERS])
    more = f"; and {len(by_rank) - _NAMED_MEMBERS} more" if len(by_rank) > _NAMED_MEMBERS else ""
    return MissingShardsError(
        missing, f"no complete state: {len(missing)} shard(s) {why}: {named}; {fix} (members: {shown}{more})"
    )


# --- the manager's view today: who failed, and the step the survivors hold ------------------------


def coarse_members(
    world_size: int, failed: Iterable[int], step: int, *, replica_of: Mapping[int, int] | None = None,
) -> list[Member]:
    """Members as a manager sees them: the failed ranks lost, the others clean at ``step``,
    each replica holder keeping a copy of ``step`` (``replica_of``)."""
    lost = frozenset(failed)
    holders = frozenset(replica_of or ())
    return [Member.lost(r, step) if r in lost else
            Member(r, step, replicas=(step,) if r in holders else ()) for r in range(world_size)]


def plan_restore(
    layout: Layout,
    failed: Iterable[int],
    *,
    replica_of: Mapping[int, int] | None = None,
    checkpoint: PersistedState | None = None,
    current_step: int | None = None,
) -> RestorePlan:
    """``plan`` over ``coarse_members``; ``current_step`` None: the survivors' step is not known (then
    a checkpoint is never current and ``lost_steps`` is None)."""
    failed_set = _ranks(failed, layout, "failed")
    if checkpoint is not None and current_step is not None and current_step < checkpoint.step:
        raise LayoutError(
            f"the checkpoint is of step {checkpoint.step}, newer than the current step {current_step}"
        )
    step = current_step if current_step is not None else checkpoint.step + 1 if checkpoint is not None else 0
    result = plan(layout, coarse_members(layout.world_size, failed_set, step, replica_of=replica_of),
                  replica_of=replica_of, checkpoint=checkpoint)
    return result if current_step is not None else dataclasses.replace(result, lost_steps=None)


@functools.lru_cache(maxsize=8)
def _ddp_layout(world_size: int) -> Layout:
    """Built once per world size: at 8,192 ranks building it is most of a plan's time (19 of 22 ms)."""
    return Layout.for_world(world_size)


def plan_for_ddp(
    world_size: int,
    failed: Iterable[int],
    checkpoint_step: int | None = None,
    *,
    current_step: int | None = None,
    checkpoint_path: str = "",
) -> RestorePlan:
    """The DDP case (tp = pp = 1): any survivor is a peer of every rank; all failed -> the checkpoint."""
    ckpt = PersistedState(checkpoint_step, path=checkpoint_path) if checkpoint_step is not None else None
    return plan_restore(_ddp_layout(world_size), failed, checkpoint=ckpt, current_step=current_step)
