"""Restore planning: after a fault, where every rank's state comes from (DESIGN.md §4).

A pure function of the parallel layout, the failed ranks, the in-memory
replicas and the persisted checkpoint, so that the manager (or every rank on
its own) computes the same plan without asking anyone; nothing here touches
torch, a process group or a file.

Model
-----
The world is a ``dp x tp x pp`` grid. A rank's *shard* is its ``(tp, pp)``
coordinate: every rank of a data-parallel group (same ``tp`` and ``pp``,
any ``dp``) holds an identical copy of it. The rank numbering is given by
``order``, fastest-varying dimension first; the default ``("tp", "dp", "pp")``
is Megatron-LM's (tensor-parallel ranks adjacent, pipeline stages slowest).

Sources, best first:

- ``self``: the rank is alive and keeps what it holds.
- ``peer``: a surviving rank with the same ``(tp, pp)`` (a data-parallel
  replica) sends it. Donors are chosen deterministically: the surviving holders
  in rank order, dealt round-robin to the failed ranks (lowest first), so one
  survivor does not serve every replacement alone.
- ``replica``: a surviving rank that keeps an in-memory copy of another rank's
  shard (a Gemini-style ring, ``replica_of[holder] = owner``) sends it.
- ``checkpoint``: the persisted files. They hold the state of one step; a
  job whose in-memory state is newer must roll back entirely to that step
  (mixing steps would give a state that never existed), so then every rank,
  alive or not, loads the checkpoint, and every shard must be in it. Only when
  the checkpoint is of the current step (a dying gasp of the leaving ranks)
  can survivors keep their memory and only the missing shards come from disk.

When some shard has no source at all, ``plan_restore`` raises
``MissingShardsError`` naming every such ``(tp, pp)``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from undying.errors import NoStateSourceError, UsageError

__all__ = [
    "DIMS",
    "MEGATRON_ORDER",
    "Shard",
    "Coords",
    "Layout",
    "LayoutError",
    "PersistedState",
    "Source",
    "SourceKind",
    "RestorePlan",
    "MissingShardsError",
    "plan_restore",
    "plan_for_ddp",
]

DIMS = ("tp", "dp", "pp")
# Megatron-LM numbers ranks tensor-parallel fastest, then data-parallel, then pipeline.
MEGATRON_ORDER: tuple[str, str, str] = ("tp", "dp", "pp")

SourceKind = Literal["self", "peer", "replica", "checkpoint"]


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


@dataclass(frozen=True)
class Source:
    """Where one rank's state comes from: ``rank`` is the donor (peer, replica), ``step`` the checkpoint's."""

    kind: SourceKind
    rank: int | None = None
    step: int | None = None

    def __str__(self) -> str:
        if self.kind == "peer":
            return f"peer rank {self.rank}"
        if self.kind == "replica":
            return f"replica on rank {self.rank}"
        if self.kind == "checkpoint":
            return f"checkpoint of step {self.step}"
        return "self"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "step": self.step}


@dataclass(frozen=True)
class RestorePlan:
    """Every rank's source (``sources[r]`` for rank r) and the rollback it implies.

    ``rollback_step`` is set when any state comes from the checkpoint: the job
    resumes at that step. ``lost_steps`` is ``current_step - rollback_step``
    when the current step was given (0 without a rollback).
    """

    layout: Layout
    failed: frozenset[int]
    sources: tuple[Source, ...]
    rollback_step: int | None = None
    lost_steps: int | None = None
    checkpoint_path: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def source(self, rank: int) -> Source:
        return self.sources[rank]

    def ranks_by_kind(self, kind: SourceKind) -> list[int]:
        return [r for r, s in enumerate(self.sources) if s.kind == kind]

    @property
    def needs_checkpoint(self) -> bool:
        return self.rollback_step is not None

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
        if self.rollback_step is not None:
            text += f"; the job rolls back to step {self.rollback_step}"
            if self.lost_steps is not None:
                text += f" ({self.lost_steps} steps lost)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "failed": sorted(self.failed),
            "sources": [s.to_dict() for s in self.sources],
            "rollback_step": self.rollback_step,
            "lost_steps": self.lost_steps,
            "checkpoint": self.checkpoint_path,
            "notes": list(self.notes),
        }


_SELF = Source("self")


class MissingShardsError(NoStateSourceError):
    """No complete state exists: ``missing`` lists every shard no source holds (and ``plan`` is None)."""

    def __init__(self, missing: Sequence[Shard], message: str) -> None:
        super().__init__(message)
        self.missing: tuple[Shard, ...] = tuple(missing)


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


def plan_restore(
    layout: Layout,
    failed: Iterable[int],
    *,
    replica_of: Mapping[int, int] | None = None,
    checkpoint: PersistedState | None = None,
    current_step: int | None = None,
) -> RestorePlan:
    """Where every rank's state comes from after ``failed`` ranks lost theirs.

    ``replica_of`` maps a rank holding an in-memory replica to the rank whose
    shard it holds (a failed holder's replica is lost with it). ``checkpoint``
    describes the persisted state, if any; ``current_step`` is the step the
    survivors hold (it says whether the checkpoint is current and how many
    steps a rollback loses).

    Raises MissingShardsError naming every shard without a source, and
    LayoutError for ranks outside the grid.
    """
    failed_set = _ranks(failed, layout, "failed")
    replicas = dict(replica_of or {})
    _ranks(replicas, layout, "replica holder")
    _ranks(replicas.values(), layout, "replicated")
    for holder, owner in replicas.items():
        if holder == owner:
            raise LayoutError(f"rank {holder} is listed as holding a replica of its own shard")
    if checkpoint is not None and current_step is not None and current_step < checkpoint.step:
        raise LayoutError(
            f"the checkpoint is of step {checkpoint.step}, newer than the current step {current_step}"
        )
    alive = [r for r in range(layout.world_size) if r not in failed_set]
    shard_of, holders_of = layout._shard_table
    all_shards = layout._all_shards

    # In-memory sources per shard: surviving data-parallel holders, then surviving replica holders.
    peers: dict[Shard, list[int]] = {s: [] for s in all_shards}
    for r in alive:
        peers[shard_of[r]].append(r)
    ring: dict[Shard, list[int]] = {s: [] for s in all_shards}
    for holder in sorted(replicas):
        if holder not in failed_set:
            ring[shard_of[replicas[holder]]].append(holder)
    in_memory = {s for s in all_shards if peers[s] or ring[s]}
    lacking = [s for s in all_shards if s not in in_memory]

    needy: dict[Shard, list[int]] = {}
    for r in sorted(failed_set):
        needy.setdefault(shard_of[r], []).append(r)

    def from_memory(disk_step: int | None) -> None:
        """Survivors keep their state; each failed rank gets a peer, else a replica, else the disk."""
        for r in alive:
            sources[r] = _SELF
        for shard, receivers in needy.items():
            if peers[shard]:
                for r, donor in _deal(receivers, peers[shard]).items():
                    sources[r] = Source("peer", donor)
            elif ring[shard]:
                for r, donor in _deal(receivers, ring[shard]).items():
                    sources[r] = Source("replica", donor)
            else:
                assert disk_step is not None
                for r in receivers:
                    sources[r] = Source("checkpoint", step=disk_step)

    sources: list[Source | None] = [None] * layout.world_size
    if not lacking:
        from_memory(None)
        done = tuple(s for s in sources if s is not None)
        assert len(done) == layout.world_size
        return RestorePlan(layout, failed_set, done, None, 0 if current_step is not None else None)

    # Some shard is only on disk, if anywhere.
    def refuse(missing: list[Shard], why: str, fix: str) -> MissingShardsError:
        named = ", ".join(
            f"{s} (ranks {', '.join(map(str, holders_of[s]))})" for s in missing
        )
        return MissingShardsError(missing, f"no complete state: {len(missing)} shard(s) {why}: {named}; {fix}")

    if checkpoint is None:
        raise refuse(
            lacking, "lost with every holder and replica, and there is no checkpoint",
            "the job cannot continue; periodic checkpoints (--save-every) or replicas would have kept them",
        )
    not_on_disk = [s for s in lacking if not checkpoint.holds(s)]
    if not_on_disk:
        raise refuse(
            not_on_disk,
            f"lost with every holder and replica, and not in the checkpoint of step {checkpoint.step}",
            "restart from a checkpoint that holds every shard",
        )
    current = current_step is not None and current_step == checkpoint.step
    notes: list[str] = []
    if current:
        # The checkpoint is of the step the survivors hold: they keep it, disk fills the gaps.
        from_memory(checkpoint.step)
        notes.append(f"the checkpoint is of the current step {checkpoint.step}: survivors keep their state")
    else:
        partial = [s for s in all_shards if not checkpoint.holds(s)]
        if partial:
            raise refuse(
                partial,
                f"are needed at step {checkpoint.step} to roll back (shards {', '.join(map(str, lacking))} "
                f"exist only there) but are in memory only at a newer step and not in that checkpoint",
                "restart from a checkpoint that holds every shard",
            )
        for r in range(layout.world_size):
            sources[r] = Source("checkpoint", step=checkpoint.step)
        notes.append(
            f"shard(s) {', '.join(map(str, lacking))} exist only in the checkpoint: every rank loads it"
        )
    lost = current_step - checkpoint.step if current_step is not None else None
    done = tuple(s for s in sources if s is not None)
    assert len(done) == layout.world_size
    return RestorePlan(
        layout, failed_set, done, checkpoint.step, lost, checkpoint.path, tuple(notes)
    )


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
    """The DDP case (tp = pp = 1): any survivor is a peer of every rank; all failed -> the checkpoint.

    Raises MissingShardsError when every rank failed and there is no checkpoint.
    """
    layout = _ddp_layout(world_size)
    ckpt = PersistedState(checkpoint_step, path=checkpoint_path) if checkpoint_step is not None else None
    return plan_restore(layout, failed, checkpoint=ckpt, current_step=current_step)

