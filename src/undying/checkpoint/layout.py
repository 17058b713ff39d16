"""The parallel layout a restore is planned over: a ``dp x tp x pp`` grid of ranks and their shards.

A rank's *shard* is its ``(tp, pp)`` coordinate: every rank of a
data-parallel group (same ``tp`` and ``pp``, any ``dp``) holds an identical
copy of it. The rank numbering is given by ``order``, fastest-varying
dimension first; the default ``("tp", "dp", "pp")`` is Megatron-LM's
(tensor-parallel ranks adjacent, pipeline stages slowest). DDP is
``dp = world``; a fully sharded state (FSDP) is ``tp = world``. Pure: no
torch, no I/O (``checkpoint.planner`` plans over it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from undying.errors import UsageError

__all__ = ["DIMS", "MEGATRON_ORDER", "LayoutError", "Shard", "Coords", "Layout"]

DIMS = ("tp", "dp", "pp")
# Megatron-LM numbers ranks tensor-parallel fastest, then data-parallel, then pipeline.
MEGATRON_ORDER: tuple[str, str, str] = ("tp", "dp", "pp")

class LayoutError(UsageError):
    """A parallel layout that does not describe the world: bad sizes, order, or ranks out of
    range."""


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
    """A ``dp x tp x pp`` grid and how ranks are numbered in it (``order``: fastest dimension
    first)."""

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
            raise LayoutError(f"rank order must name each of tp, dp, pp once (fastest first), "
                              f"got {names!r}")
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
                f"parallel layout dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} "
                f"ranks, but the world has {world_size}; make dp*tp*pp equal the number of ranks"
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
        """Every rank's shard and every shard's holders, computed once (by strides: no grid at 8,192
        ranks)."""
        stride, strides = 1, {}
        for dim in self.order:
            strides[dim] = stride
            stride *= self._size(dim)
        table = {(t, p): Shard(t, p) for t in range(self.tp) for p in range(self.pp)}
        st, sp, tp, pp = strides["tp"], strides["pp"], self.tp, self.pp
        by_rank = tuple(table[(r // st) % tp, (r // sp) % pp] for r in range(self.world_size))
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
