"""The restore planner over every small layout, from the manager's view (who failed, the survivors'
step): invariants, a reference written apart, the DDP case."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping

import pytest

from undying.checkpoint.layout import DIMS, Layout, LayoutError, Shard
from undying.checkpoint.planner.coarse import coarse_members
from undying.checkpoint.planner.holdings import (
    MissingShardsError,
    PersistedState,
    RestorePlan,
    plan,
)
from undying.errors import NoStateSourceError, UsageError


def plan_restore(
    layout: Layout, failed: Iterable[int], *, replica_of: Mapping[int, int] | None = None,
    checkpoint: PersistedState | None = None, current_step: int | None = None,
) -> RestorePlan:
    """``plan`` over the manager's view; ``current_step`` None: the survivors' step is not known, so
    a checkpoint is never the current step (they are one past it) and ``lost_steps`` is None."""
    step = current_step if current_step is not None else checkpoint.step + 1 if checkpoint is not None else 0
    members = coarse_members(layout.world_size, failed, step, replica_of=replica_of)
    result = plan(layout, members, replica_of=replica_of, checkpoint=checkpoint)
    return result if current_step is not None else dataclasses.replace(result, lost_steps=None)


@functools.lru_cache(maxsize=8)
def _ddp_layout(world_size: int) -> Layout:
    return Layout.for_world(world_size)


def plan_for_ddp(world_size: int, failed: Iterable[int], checkpoint_step: int | None = None, *,
                 current_step: int | None = None, checkpoint_path: str = "") -> RestorePlan:
    """The DDP case (tp = pp = 1): any survivor is a peer of every rank; all failed -> the checkpoint."""
    ckpt = PersistedState(checkpoint_step, path=checkpoint_path) if checkpoint_step is not None else None
    return plan_restore(_ddp_layout(world_size), failed, checkpoint=ckpt, current_step=current_step)


SIZES = (1, 2, 3)
LAYOUTS = [Layout(dp, tp, pp) for dp, tp, pp in itertools.product(SIZES, repeat=3)]


def _coords(layout: Layout, rank: int) -> dict[str, int]:
    """Grid position from the order, written apart from the planner (mixed-radix digits)."""
    out, rest = {}, rank
    for dim in layout.order:
        size = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}[dim]
        out[dim] = rest % size
        rest //= size
    return out


_TABLES: dict[Layout, list[Shard]] = {}


def _shard(layout: Layout, rank: int) -> Shard:
    table = _TABLES.get(layout)
    if table is None:
        table = _TABLES[layout] = [
            Shard(c["tp"], c["pp"]) for c in (_coords(layout, r) for r in range(layout.world_size))
        ]
    return table[rank]


def _failure_sets(world: int, limit: int = 3) -> Iterator[frozenset[int]]:
    """All subsets for a world of at most 8 ranks, else every subset of up to ``limit`` ranks."""
    top = world if world <= 8 else limit
    for k in range(top + 1):
        for combo in itertools.combinations(range(world), k):
            yield frozenset(combo)


def _ring(world: int) -> dict[int, int]:
    """Gemini-style: rank r's shard is replicated on rank r+1 (mod world); holder -> owner."""
    return {(r + 1) % world: r for r in range(world)} if world > 1 else {}


def _check(
    layout: Layout,
    failed: frozenset[int],
    replica_of: dict[int, int],
    ckpt: PersistedState | None,
    current: int | None,
) -> None:
    """Run the planner and hold its answer against the rules, derived here independently."""
    world = layout.world_size
    table = _TABLES.get(layout) or [_shard(layout, r) for r in range(world)]
    alive = [r for r in range(world) if r not in failed]
    shards = {Shard(t, p) for t in range(layout.tp) for p in range(layout.pp)}
    peer_of: dict[Shard, list[int]] = {s: [] for s in shards}
    for r in alive:
        peer_of[table[r]].append(r)
    ring_of: dict[Shard, list[int]] = {s: [] for s in shards}
    for h in sorted(replica_of):
        if h not in failed:
            ring_of[table[replica_of[h]]].append(h)
    lacking = {s for s in shards if not peer_of[s] and not ring_of[s]}
    expect_missing: set[Shard] = set()
    rollback_all = False
    if lacking:
        if ckpt is None:
            expect_missing = lacking
        else:
            expect_missing = {s for s in lacking if not ckpt.holds(s)}
            if not expect_missing and current != ckpt.step:
                expect_missing = {s for s in shards if not ckpt.holds(s)}
                rollback_all = True
    try:
        plan = plan_restore(layout, failed, replica_of=replica_of, checkpoint=ckpt, current_step=current)
    except MissingShardsError as e:
        assert expect_missing, f"refused but a complete state exists: {e}"
        assert set(e.missing) == expect_missing
        assert list(e.missing) == sorted(e.missing, key=lambda s: (s.pp, s.tp))  # no duplicates, stable
        for s in expect_missing:
            assert str(s) in str(e)
        assert isinstance(e, NoStateSourceError)
        return
    assert not expect_missing, f"planned although {expect_missing} have no source: {plan.describe()}"
    assert len(plan.sources) == world and plan.failed == failed
    needs_disk = bool(lacking)
    assert plan.needs_checkpoint == needs_disk
    if needs_disk:
        assert ckpt is not None and plan.rollback_step == ckpt.step
        assert plan.lost_steps == (current - ckpt.step if current is not None else None)
    else:
        assert plan.rollback_step is None and plan.lost_steps == (0 if current is not None else None)
    donors_per_shard: dict[Shard, set[int]] = {}
    for r, src in enumerate(plan.sources):
        s = table[r]
        if src.kind == "self":
            assert r not in failed and not rollback_all
        elif src.kind == "peer":
            assert r in failed and src.rank is not None and src.rank not in failed and src.rank != r
            assert table[src.rank] == s  # same (tp, pp): a data-parallel replica
            donors_per_shard.setdefault(s, set()).add(src.rank)
        elif src.kind == "replica":
            assert r in failed and not peer_of[s], "a replica is used only when no peer survives"
            assert src.rank is not None and src.rank not in failed
            assert table[replica_of[src.rank]] == s
            donors_per_shard.setdefault(s, set()).add(src.rank)
        else:
            assert src.kind == "checkpoint" and ckpt is not None and src.step == ckpt.step
            assert ckpt.holds(s)
            if not rollback_all:
                assert r in failed and not peer_of[s] and not ring_of[s]
        if rollback_all:
            assert src.kind == "checkpoint"
    # Donors are spread: as many distinct donors as the shard's needs and its survivors allow.
    for s, used in donors_per_shard.items():
        needy = sum(1 for r in failed if table[r] == s)
        pool = peer_of[s] or ring_of[s]
        assert len(used) == min(needy, len(pool))
    # Deterministic: the same question in another order gets the same answer (checked on a third
    # of the cases: the planner has no state, this is a spot check that keeps the test fast).
    if hash(failed) % 3:
        return
    again = plan_restore(
        layout, sorted(failed, reverse=True), replica_of=dict(reversed(list(replica_of.items()))),
        checkpoint=ckpt, current_step=current,
    )
    assert again == plan


def test_layout_numbering_is_a_bijection_in_every_order() -> None:
    for dp, tp, pp in itertools.product(SIZES, repeat=3):
        for order in itertools.permutations(DIMS):
            layout = Layout(dp, tp, pp, order)  # type: ignore[arg-type]
            seen = set()
            for r in range(layout.world_size):
                c = layout.coords(r)
                assert c._asdict() == _coords(layout, r)
                assert layout.rank_of(c.dp, c.tp, c.pp) == r
                seen.add(c)
            assert len(seen) == layout.world_size == dp * tp * pp
            for shard in layout.shards():
                assert len(layout.holders(shard)) == dp
                assert all(layout.shard_of(h) == shard for h in layout.holders(shard))


def test_megatron_order_is_the_default() -> None:
    layout = Layout(dp=2, tp=2, pp=2)
    # tp fastest, then dp, then pp: ranks 0,1 are one tensor-parallel group; 4..7 the second stage.
    assert [tuple(layout.coords(r)) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert layout.coords(4) == (0, 0, 1)


def test_every_small_layout_and_failure_set() -> None:
    """dp, tp, pp in {1,2,3} (Megatron order), all failure sets (up to 3 ranks when world > 8)."""
    checked = 0
    for layout in LAYOUTS:
        world = layout.world_size
        ring = _ring(world)
        for failed in _failure_sets(world):
            failed_shards = frozenset(_shard(layout, r) for r in failed)
            for replica_of, ckpt, current in (
                ({}, None, None),
                (ring, None, None),
                ({}, PersistedState(5), 9),
                (ring, PersistedState(5), None),
                ({}, PersistedState(9, failed_shards), 9),  # the leaving ranks' dying gasps, current
                ({}, PersistedState(5, failed_shards), 9),  # the same files, older: a rollback needs all
            ):
                _check(layout, failed, replica_of, ckpt, current)
                checked += 1
    expected_sets = sum(
        2**w if w <= 8 else sum(math.comb(w, k) for k in range(4))
        for w in (lay.world_size for lay in LAYOUTS)
    )
    assert checked == 6 * expected_sets


def test_other_rank_orders_with_up_to_two_failures() -> None:
    """The five other orders: every layout, failure sets of up to two ranks (one above 12 ranks)."""
    for dp, tp, pp in itertools.product(SIZES, repeat=3):
        for order in itertools.permutations(DIMS):
            if order == ("tp", "dp", "pp"):
                continue
            layout = Layout(dp, tp, pp, order)  # type: ignore[arg-type]
            limit = 2 if layout.world_size <= 12 else 1
            for failed in _failure_sets(layout.world_size, limit=limit):
                if len(failed) > limit:
                    continue
                _check(layout, failed, _ring(layout.world_size), None, None)
                _check(layout, failed, {}, PersistedState(3), 4)


def test_peers_are_lowest_surviving_and_spread() -> None:
    layout = Layout(dp=3, tp=2, pp=1)  # shard (tp=0): ranks 0, 2, 4; (tp=1): 1, 3, 5
    plan = plan_restore(layout, {0})
    assert plan.source(0).kind == "peer" and plan.source(0).rank == 2
    assert all(plan.source(r).kind == "self" for r in range(1, 6))
    plan = plan_restore(layout, {0, 2})
    assert plan.source(0).rank == 4 and plan.source(2).rank == 4  # one survivor serves both
    layout = Layout(dp=3, tp=1, pp=1)
    plan = plan_restore(layout, {1, 2})
    assert [plan.source(r).rank for r in (1, 2)] == [0, 0]
    layout = Layout(dp=4, tp=1, pp=1)
    plan = plan_restore(layout, {0, 1})
    assert [plan.source(r).rank for r in (0, 1)] == [2, 3]  # spread over both survivors
    assert plan.transfers() == [(2, 0), (3, 1)]
    assert "rank 0 <- peer rank 2" in plan.describe()


def test_replica_then_checkpoint() -> None:
    layout = Layout(dp=1, tp=2, pp=2)  # every rank a distinct shard
    ring = {1: 0, 2: 1, 3: 2, 0: 3}
    plan = plan_restore(layout, {0}, replica_of=ring, checkpoint=PersistedState(10), current_step=12)
    assert plan.source(0).kind == "replica" and plan.source(0).rank == 1
    assert plan.rollback_step is None and plan.lost_steps == 0
    # Rank 0 and the holder of its replica both fail: the whole job rolls back.
    plan = plan_restore(layout, {0, 1}, replica_of=ring, checkpoint=PersistedState(10, path="/c"), current_step=12)
    assert [s.kind for s in plan.sources] == ["checkpoint"] * 4
    assert plan.rollback_step == 10 and plan.lost_steps == 2 and plan.checkpoint_path == "/c"
    assert "rolls back to step 10 (2 steps lost)" in plan.describe()
    assert plan.to_dict()["sources"][0] == {"kind": "checkpoint", "rank": None, "step": 10}


def test_dying_gasp_files_of_the_current_step_fill_only_the_gaps() -> None:
    layout = Layout(dp=1, tp=2, pp=1)
    gasp = PersistedState(7, frozenset({Shard(1, 0)}))
    plan = plan_restore(layout, {1}, checkpoint=gasp, current_step=7)
    assert plan.source(0).kind == "self" and plan.source(1).kind == "checkpoint"
    assert plan.rollback_step == 7 and plan.lost_steps == 0
    # Without knowing the survivors are at step 7, a rollback needs every shard on disk.
    with pytest.raises(MissingShardsError) as info:
        plan_restore(layout, {1}, checkpoint=gasp)
    assert info.value.missing == (Shard(0, 0),)


def test_refusal_names_every_missing_shard() -> None:
    layout = Layout(dp=2, tp=2, pp=1)  # (tp=0): ranks 0, 2; (tp=1): ranks 1, 3
    with pytest.raises(MissingShardsError) as info:
        plan_restore(layout, {0, 1, 2, 3})
    assert info.value.missing == (Shard(0, 0), Shard(1, 0))
    assert "(tp=0, pp=0) (ranks 0, 2)" in str(info.value) and "(tp=1, pp=0) (ranks 1, 3)" in str(info.value)
    assert "no checkpoint" in str(info.value)
    with pytest.raises(MissingShardsError) as info:
        plan_restore(layout, {0, 2}, checkpoint=PersistedState(3, frozenset({Shard(1, 0)})))
    assert info.value.missing == (Shard(0, 0),) and "step 3" in str(info.value)


def test_ddp_any_proper_subset_uses_peers() -> None:
    for world in range(1, 9):
        for failed in _failure_sets(world):
            if len(failed) == world:
                continue
            plan = plan_for_ddp(world, failed, checkpoint_step=4)
            survivors = sorted(set(range(world)) - failed)
            assert plan.rollback_step is None
            for r, src in enumerate(plan.sources):
                if r in failed:
                    assert src.kind == "peer" and src.rank in survivors
                else:
                    assert src.kind == "self"


def test_ddp_all_failed_needs_the_checkpoint() -> None:
    for world in range(1, 9):
        everyone = range(world)
        plan = plan_for_ddp(world, everyone, checkpoint_step=4, current_step=6, checkpoint_path="/ck")
        assert isinstance(plan, RestorePlan)
        assert all(s.kind == "checkpoint" and s.step == 4 for s in plan.sources)
        assert plan.rollback_step == 4 and plan.lost_steps == 2 and plan.checkpoint_path == "/ck"
        with pytest.raises(MissingShardsError, match=r"\(tp=0, pp=0\)") as info:
            plan_for_ddp(world, everyone)
        assert info.value.missing == (Shard(0, 0),)


def test_bad_layouts_are_usage_errors() -> None:
    with pytest.raises(LayoutError, match="dp=2 x tp=2 x pp=1 = 4 ranks, but the world has 6"):
        Layout.for_world(6, dp=2, tp=2)
    with pytest.raises(LayoutError, match="not a multiple of tp\\*pp"):
        Layout.for_world(6, tp=4)
    assert Layout.for_world(12, tp=2, pp=3).dp == 2
    with pytest.raises(LayoutError, match="tp, dp, pp"):
        Layout(2, 1, 1, ("tp", "tp", "pp"))
    with pytest.raises(LayoutError, match="must be an integer >= 1"):
        Layout(0)
    with pytest.raises(LayoutError, match="outside 0..3"):
        plan_restore(Layout(4), {4})
    with pytest.raises(LayoutError, match="its own shard"):
        plan_restore(Layout(2), {0}, replica_of={1: 1})
    with pytest.raises(LayoutError, match="newer than the current step"):
        plan_restore(Layout(2), {0}, checkpoint=PersistedState(9), current_step=3)
    assert issubclass(LayoutError, UsageError)
