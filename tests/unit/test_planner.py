"""The one restore planner (``checkpoint.planner.plan``), alone: tables of cases, references written
apart, properties over random holdings, and the workers' call to it checked for an ``except``.

The DDP cases are what every worker plans from the statuses it gathered (a
whole state, dp = world); the sharded ones what a sharded job's ranks plan
(dp = 1, tp = world, ring replicas); the manager's view is ``coarse_members``.
"""

from __future__ import annotations

import ast
import itertools
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from undying.checkpoint.layout import Layout, LayoutError, Shard
from undying.checkpoint.planner.coarse import coarse_members
from undying.checkpoint.planner.holdings import (
    UNREAD,
    Member,
    MissingShardsError,
    PersistedState,
    RestorePlan,
    plan,
    ring_replica_of,
)
from undying.errors import NoStateSourceError, RecoveryError

WORKER = Path(__file__).resolve().parents[2] / "src" / "undying" / "worker"


def ddp(members: list[Member]) -> RestorePlan:
    return plan(Layout(dp=len(members)), members)


def sharded(members: list[Member], offset: int, checkpoint: PersistedState | None | object = UNREAD) -> RestorePlan:
    world = len(members)
    return plan(Layout(dp=1, tp=world), members, replica_of=ring_replica_of(world, offset),
                checkpoint=checkpoint)  # type: ignore[arg-type]


# --- DDP: every rank holds the whole state ------------------------------------------------

# (committed, clean, has_state) for one rank. A status with clean=True but has_state=False does
# not arise (a process without state is not clean), but it is kept: it must not count as a holder.
PER_RANK = list(itertools.product((0, 1, 2), (False, True), (False, True)))


def _members(combo: tuple[tuple[int, bool, bool], ...]) -> list[Member]:
    return [Member(rank, c, clean=cl, has_state=hs) for rank, (c, cl, hs) in enumerate(combo)]


def _ddp_reference(members: list[Member]) -> dict[int, tuple[str, int | None]] | None:
    """The DDP plan as the module docstring states it, written independently: rank -> (kind, donor)."""
    holding = {m.rank: m.step for m in members if m.clean and m.has_state}
    if not holding:
        return None
    target = max(holding.values())
    at_target = sorted(r for r, c in holding.items() if c == target)
    receivers = sorted({m.rank for m in members} - set(at_target))
    out: dict[int, tuple[str, int | None]] = {r: ("self", None) for r in at_target}
    out.update({r: ("peer", at_target[i % len(at_target)]) for i, r in enumerate(receivers)})
    return out


def _check_ddp(members: list[Member], result: RestorePlan) -> None:
    by_rank = {m.rank: m for m in members}
    clean = [m for m in members if m.clean and m.has_state]
    assert result.target is not None and not result.needs_checkpoint
    assert all(result.target >= m.step for m in clean), "completed work was thrown away"
    for r, source in enumerate(result.sources):
        if source.kind == "self":
            assert by_rank[r].live_at(result.target)
        else:
            assert source.kind == "peer" and source.rank is not None and source.rank != r
            assert by_rank[source.rank].live_at(result.target), "a donor holds the target step cleanly"
    assert result.lost_steps == max(m.step for m in members) - result.target


@pytest.mark.parametrize("first", PER_RANK, ids=lambda c: f"r0={c[0]}{'c' if c[1] else 'd'}{'s' if c[2] else 'n'}")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ddp_plan_matches_reference_for_every_small_membership(world_size: int, first: tuple[int, bool, bool]) -> None:
    count = 0
    for rest in itertools.product(PER_RANK, repeat=world_size - 1):
        members = _members((first, *rest))
        expected = _ddp_reference(members)
        try:
            result = ddp(members)
        except NoStateSourceError:
            assert expected is None, members
        else:
            assert expected is not None, members
            assert {r: (s.kind, s.rank) for r, s in enumerate(result.sources)} == expected, members
            _check_ddp(members, result)
        count += 1
    assert count == len(PER_RANK) ** (world_size - 1)


def test_the_enumeration_covers_both_outcomes() -> None:
    outcomes = {_ddp_reference(_members(c)) is None for c in itertools.product(PER_RANK, repeat=2)}
    assert outcomes == {True, False}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_computes_the_same_plan_whatever_the_order(world_size: int) -> None:
    """all_gather gives the list in rank order, but the plan must not depend on it."""
    rng = random.Random(world_size)
    combos = list(itertools.product(PER_RANK, repeat=world_size))
    for combo in rng.sample(combos, min(400, len(combos))):
        members = _members(combo)
        if _ddp_reference(members) is None:
            continue
        result = ddp(members)
        for _ in range(3):
            shuffled = members[:]
            rng.shuffle(shuffled)
            assert ddp(shuffled) == result


DDP_CASES = [
    # (why, members as (step, clean, has_state), expected sources as (kind, donor), target)
    ("a survivor ahead of its peers shares its newer step; two donors at it serve two receivers",
     [(4, True, True), (5, True, True), (0, False, False), (5, True, True)],
     [("peer", 1), ("self", None), ("peer", 3), ("self", None)], 5),
    ("a half-updated rank is not a donor even when ahead",
     [(7, False, True), (6, True, True)], [("peer", 1), ("self", None)], 6),
    ("nothing to move when every rank is at the target",
     [(3, True, True)] * 3, [("self", None)] * 3, 3),
    ("one replacement, the lowest survivor at the target sends",
     [(6, True, True), (0, False, False), (6, True, True), (6, True, True)],
     [("self", None), ("peer", 0), ("self", None), ("self", None)], 6),
]


@pytest.mark.parametrize(("why", "combo", "sources", "target"), DDP_CASES, ids=[c[0][:40] for c in DDP_CASES])
def test_ddp_table(why: str, combo: list[tuple[int, bool, bool]], sources: list[tuple[str, int | None]],
                   target: int) -> None:
    result = ddp(_members(tuple(combo)))
    assert [(s.kind, s.rank) for s in result.sources] == sources, why
    assert result.target == target


def test_no_clean_holder_raises_naming_every_member() -> None:
    members = [Member(0, 3, clean=False), Member(1, 0, clean=False, has_state=False),
               Member(2, 2, clean=True, has_state=False)]
    with pytest.raises(NoStateSourceError) as info:
        ddp(members)
    assert isinstance(info.value, RecoveryError) and isinstance(info.value, MissingShardsError)
    message = str(info.value)
    assert "rank 0: committed 3, clean=False, has_state=True" in message
    assert "rank 1: committed 0, clean=False, has_state=False" in message
    assert "rank 2: committed 2, clean=True, has_state=False" in message
    assert "(tp=0, pp=0) (ranks 0, 1, 2)" in message and "no checkpoint" in message


# --- sharded: every rank its own shard, ring replicas --------------------------------------

def survivor(rank: int, committed: int, *, clean: bool = True, own: tuple[int, ...] = (),
             replicas: tuple[int, ...] = ()) -> Member:
    return Member(rank, committed, clean=clean, snapshots=own, replicas=replicas)


def replacement(rank: int) -> Member:
    return Member.lost(rank)


def shard_reference(members: list[Member], offset: int) -> int | None:
    """The target as the module docstring states it, written independently: try every step, newest first."""
    world = len(members)
    steps = {m.step for m in members} | {x for m in members for x in (*m.snapshots, *m.replicas)}
    for step in sorted(steps, reverse=True):
        ok = True
        for m in members:
            mine = m.has_state and ((m.clean and m.step == step) or step in m.snapshots)
            holder = members[(m.rank + offset) % world]
            held = offset % world != 0 and holder.has_state and step in holder.replicas
            ok = ok and (mine or held)
        if ok:
            return step
    return None


def check_sharded(members: list[Member], offset: int) -> RestorePlan:
    result = sharded(members, offset)
    expected = shard_reference(members, offset)
    world = len(members)
    if expected is None:
        assert result.read_checkpoint and result.target is None, members
        assert all(s.kind == "checkpoint" for s in result.sources)
        return result
    assert result.target == expected, members
    assert len(result.sources) == world
    for m in members:
        source = result.source(m.rank)
        if source.kind == "self":
            assert m.live_at(expected)
        elif source.kind == "snapshot":
            assert m.has_state and expected in m.snapshots and source.rank == m.rank
            assert not m.live_at(expected), "the live state is preferred to a copy"
        else:
            assert source.kind == "replica" and source.rank == (m.rank + offset) % world
            holder = members[source.rank]
            assert holder.has_state and expected in holder.replicas
            assert not (m.has_state and (m.live_at(expected) or expected in m.snapshots))
    newest = max(m.step for m in members)
    assert result.lost_steps == max(0, newest - expected)
    return result


def test_a_killed_rank_gets_its_shard_from_its_successor_and_survivors_keep_theirs() -> None:
    members = [survivor(0, 5, own=(5,), replicas=(5,)), survivor(1, 5, own=(5,), replicas=(5,)),
               replacement(2), survivor(3, 5, own=(5,), replicas=(5,))]
    result = check_sharded(members, 1)
    assert result.target == 5 and result.lost_steps == 0 and not result.needs_checkpoint
    assert result.source(2).kind == "replica" and result.source(2).rank == 3
    assert all(result.source(r).kind == "self" for r in (0, 1, 3))
    assert result.describe() == "rank 2 <- replica on rank 3"


def test_the_replica_lives_on_the_next_node() -> None:
    # 2 nodes of 2 ranks: rank 1's replica is on rank 3 (offset 2), not on rank 2.
    members = [survivor(0, 4, own=(4,), replicas=(4,)), replacement(1),
               survivor(2, 4, own=(4,), replicas=(4,)), survivor(3, 4, own=(4,), replicas=(4,))]
    assert check_sharded(members, 2).source(1).rank == 3


def test_a_lagging_replica_rolls_every_rank_back_in_memory_and_counts_the_steps() -> None:
    # Replicated every 3 steps: the last copies are of step 6, the survivors are at 8.
    members = [survivor(0, 8, own=(6,), replicas=(6,)), survivor(1, 8, own=(6,), replicas=(6,)),
               replacement(2), survivor(3, 8, own=(6,), replicas=(6,))]
    result = check_sharded(members, 1)
    assert result.target == 6 and result.lost_steps == 2 and not result.needs_checkpoint
    assert [s.kind for s in result.sources] == ["snapshot", "snapshot", "replica", "snapshot"]
    assert result.describe().endswith("; the job goes back to step 6 in memory (2 steps re-run)")


def test_torn_survivors_use_their_snapshot() -> None:
    # Died between the exchange of step 6 and its barrier: everyone's step 6 copy exists, nobody committed it.
    members = [survivor(0, 5, clean=False, own=(6, 5), replicas=(6, 5)),
               survivor(1, 5, clean=False, own=(6, 5), replicas=(6, 5)),
               replacement(2), survivor(3, 5, clean=False, own=(6, 5), replicas=(6, 5))]
    result = check_sharded(members, 1)
    assert result.target == 6 and result.lost_steps == 0


def test_neighbours_lost_together_need_the_checkpoint_and_without_one_are_named() -> None:
    members = [survivor(0, 5, own=(5,), replicas=(5,)), replacement(1), replacement(2),
               survivor(3, 5, own=(5,), replicas=(5,))]
    assert check_sharded(members, 1).read_checkpoint
    with pytest.raises(MissingShardsError) as info:
        sharded(members, 1, checkpoint=None)
    assert info.value.missing == (Shard(1, 0),)  # rank 1's shard: its replica holder, rank 2, went with it
    assert "(tp=1, pp=0) (ranks 1)" in str(info.value) and "no checkpoint" in str(info.value)
    # The checkpoint read: every rank rolls back to it (a state of two steps never existed).
    result = sharded(members, 1, checkpoint=PersistedState(4, path="/ck/step-4"))
    assert [s.kind for s in result.sources] == ["checkpoint"] * 4
    assert (result.target, result.rollback_step, result.lost_steps, result.checkpoint_path) == (4, 4, 1, "/ck/step-4")


def test_without_replication_only_a_fault_that_lost_no_rank_is_restored_in_memory() -> None:
    assert check_sharded([survivor(r, 7) for r in range(3)], 1).target == 7
    assert check_sharded([survivor(0, 7), survivor(1, 7), replacement(2)], 1).target is None
    # Ranks that ended at different steps with no copies cannot agree on one.
    assert check_sharded([survivor(0, 7), survivor(1, 8)], 1).target is None
    with pytest.raises(MissingShardsError, match="no copy at step 8") as info:
        sharded([survivor(0, 7), survivor(1, 8)], 1, checkpoint=None)
    assert info.value.missing == (Shard(0, 0),)


def test_members_that_are_not_one_whole_job_are_refused() -> None:
    with pytest.raises(LayoutError, match="not one whole job"):
        plan(Layout(dp=1, tp=2), [survivor(0, 1), survivor(2, 1)])
    with pytest.raises(LayoutError, match="not one whole job"):
        plan(Layout(dp=3), [survivor(0, 1), survivor(1, 1)])


RANK_CHOICES = [
    None,  # a replacement
    *[(committed, clean, own, replicas)
      for committed in (4, 5)
      for clean in (False, True)
      for own in ((), (4,), (5, 4))
      for replicas in ((), (4,), (5, 4))],
]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_plan_matches_reference_for_every_small_job(world: int) -> None:
    for combo in itertools.product(RANK_CHOICES, repeat=world):
        members = [replacement(r) if c is None else survivor(r, c[0], clean=c[1], own=c[2], replicas=c[3])
                   for r, c in enumerate(combo)]
        check_sharded(members, 1 if world > 1 else 0)


def test_sharded_plan_matches_reference_on_random_larger_jobs() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        world = rng.choice([4, 6, 8])
        offset = rng.choice([1, 2, world // 2])
        members = [replacement(r) if rng.random() < 0.2 else
                   survivor(r, rng.choice([4, 5]), clean=rng.random() < 0.7,
                            own=rng.choice([(), (4,), (5, 4), (5,)]), replicas=rng.choice([(), (4,), (5, 4), (5,)]))
                   for r in range(world)]
        check_sharded(members, offset)


# --- the manager's view: who failed, the step the survivors hold, the checkpoint -------------

def manager_plan(world: int, failed: set[int], step: int, *, sharded_ring: int | None = None,
                 sharded: bool = False, checkpoint: PersistedState | None = None) -> RestorePlan:
    """As the manager calls it (see the report of issue 15): its view of members, then ``plan``."""
    if sharded or sharded_ring is not None:
        replica_of = ring_replica_of(world, sharded_ring) if sharded_ring else {}
        layout = Layout(dp=1, tp=world)
    else:
        replica_of, layout = {}, Layout(dp=world)
    members = coarse_members(world, failed, step, replica_of=replica_of)
    return plan(layout, members, replica_of=replica_of, checkpoint=checkpoint)


MANAGER_CASES = [
    # (why, world, failed, step, ring offset or None (DDP) or 0 (sharded, no ring), checkpoint, describe)
    ("DDP: one rank lost, a peer sends", 4, {1}, 9, None, None, "rank 1 <- peer rank 0"),
    ("DDP: two lost, spread over two peers", 4, {0, 1}, 9, None, None, "rank 0 <- peer rank 2; rank 1 <- peer rank 3"),
    ("DDP: every rank lost, the checkpoint", 2, {0, 1}, 9, None, PersistedState(4, path="/c"),
     "rank 0 <- checkpoint of step 4; rank 1 <- checkpoint of step 4; the job rolls back to step 4 (5 steps lost)"),
    ("sharded ring: the successor's replica", 4, {2}, 9, 1, None, "rank 2 <- replica on rank 3"),
    ("sharded ring: neighbours lost, every rank rolls back", 3, {0, 1}, 9, 1, PersistedState(8),
     "rank 0 <- checkpoint of step 8; rank 1 <- checkpoint of step 8; rank 2 <- checkpoint of step 8; "
     "the job rolls back to step 8 (1 steps lost)"),
    ("sharded, no ring, the dying gasp is current: only the gap from disk", 2, {1}, 9, 0, PersistedState(9),
     "rank 1 <- checkpoint of step 9; the job rolls back to step 9 (0 steps lost)"),
]


@pytest.mark.parametrize(("why", "world", "failed", "step", "ring", "ckpt", "text"), MANAGER_CASES,
                         ids=[c[0][:40] for c in MANAGER_CASES])
def test_manager_table(why: str, world: int, failed: set[int], step: int, ring: int | None,
                       ckpt: PersistedState | None, text: str) -> None:
    result = manager_plan(world, failed, step, sharded_ring=ring or None, sharded=ring == 0, checkpoint=ckpt)
    assert result.describe() == text, why
    assert result.failed == frozenset(failed)


def test_manager_view_of_a_ring_replicated_every_k_steps_goes_back_to_the_copies() -> None:
    """Replicated every 3 steps, survivors at 8: the lost shard's copy is of step 6, so is everyone's snapshot."""
    ring = ring_replica_of(4, 1)
    members = coarse_members(4, {2}, 8, replica_of=ring, copies_at=6)
    result = plan(Layout(dp=1, tp=4), members, replica_of=ring, checkpoint=PersistedState(4))
    assert [s.kind for s in result.sources] == ["snapshot", "snapshot", "replica", "snapshot"]
    assert (result.target, result.lost_steps, result.needs_checkpoint) == (6, 2, False)
    # The same members as the ranks report them give the same plan (the workers' view, exchanged).
    workers = [Member(0, 8, snapshots=(6,), replicas=(6,)), Member(1, 8, snapshots=(6,), replicas=(6,)),
               Member.lost(2), Member(3, 8, snapshots=(6,), replicas=(6,))]
    assert plan(Layout(dp=1, tp=4), workers, replica_of=ring, checkpoint=UNREAD).sources == result.sources


def test_manager_refusals_name_what_is_missing() -> None:
    with pytest.raises(MissingShardsError, match="no complete state") as info:
        manager_plan(4, {0, 1, 2, 3}, 6)
    assert info.value.missing == (Shard(0, 0),)
    with pytest.raises(MissingShardsError, match=r"\(tp=2, pp=0\) \(ranks 2\)"):
        manager_plan(4, {2}, 6, sharded=True)
    with pytest.raises(LayoutError, match="newer than the current step 6"):
        manager_plan(4, {2}, 6, sharded=True, checkpoint=PersistedState(7))


# --- properties over random holdings ------------------------------------------------------

@st.composite
def situations(draw: st.DrawFn) -> tuple[Layout, list[Member], dict[int, int], PersistedState | None]:
    layout = Layout(draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    world = layout.world_size
    steps = st.integers(3, 6)
    members = []
    for r in range(world):
        if draw(st.booleans()) and draw(st.booleans()):
            members.append(Member.lost(r, draw(steps)))
        else:
            members.append(Member(r, draw(steps), clean=draw(st.booleans()),
                                  snapshots=tuple(draw(st.sets(steps, max_size=2))),
                                  replicas=tuple(draw(st.sets(steps, max_size=2)))))
    offset = draw(st.integers(0, world - 1))
    replica_of = ring_replica_of(world, offset)
    ckpt = draw(st.one_of(st.none(), st.builds(
        PersistedState, st.integers(0, 3),
        st.one_of(st.none(), st.sets(st.sampled_from(layout.shards()), max_size=layout.tp * layout.pp)
                  .map(frozenset)))))
    return layout, members, replica_of, ckpt


def _copies(layout: Layout, members: list[Member], replica_of: dict[int, int], rank: int,
            ckpt: PersistedState | None) -> set[int]:
    """Steps at which ``rank`` can get its shard, brute force: from itself, a peer, a replica, the disk."""
    shard = layout.shard_of(rank)
    me = members[rank]
    steps = set(me.snapshots) if me.has_state else set()
    for m in members:
        if m.has_state and m.clean and layout.shard_of(m.rank) == shard:
            steps.add(m.step)
        owner = replica_of.get(m.rank)
        if m.has_state and owner is not None and layout.shard_of(owner) == shard:
            steps.update(m.replicas)
    if ckpt is not None and ckpt.holds(shard):
        steps.add(ckpt.step)
    return steps


@settings(max_examples=400, deadline=None)
@given(situations())
def test_properties(situation: tuple[Layout, list[Member], dict[int, int], PersistedState | None]) -> None:
    layout, members, replica_of, ckpt = situation
    world = layout.world_size
    memory = set.intersection(*(_copies(layout, members, replica_of, r, None) for r in range(world)))
    anywhere = set.intersection(*(_copies(layout, members, replica_of, r, ckpt) for r in range(world)))
    try:
        result = plan(layout, members, replica_of=replica_of, checkpoint=ckpt)
    except MissingShardsError as e:
        assert not memory and not anywhere, "refused although every shard has a copy at one step"
        assert e.missing and all(str(s) in str(e) for s in e.missing)
        return
    target = result.target
    assert target is not None
    # The newest step with every shard in memory; the disk only when memory has none.
    assert target == (max(memory) if memory else max(anywhere))
    assert result.needs_checkpoint == (not memory and any(s.kind == "checkpoint" for s in result.sources))
    # Every rank exactly one source, each one holding this rank's shard at the target.
    assert len(result.sources) == world
    for r, source in enumerate(result.sources):
        shard = layout.shard_of(r)
        if source.kind == "self":
            assert members[r].live_at(target)
        elif source.kind == "snapshot":
            assert members[r].has_state and target in members[r].snapshots
        elif source.kind == "peer":
            assert source.rank is not None and source.rank != r
            assert members[source.rank].live_at(target) and layout.shard_of(source.rank) == shard
        elif source.kind == "replica":
            assert source.rank is not None and members[source.rank].has_state
            assert target in members[source.rank].replicas and layout.shard_of(replica_of[source.rank]) == shard
        else:
            assert ckpt is not None and ckpt.step == target and ckpt.holds(shard) and not memory
        if not members[r].has_state:
            assert source.kind not in ("self", "snapshot"), "a lost rank holds nothing"
    # Deterministic: the same question in another order gets the same answer.
    shuffled = members[::-1]
    assert plan(layout, shuffled, replica_of=dict(reversed(list(replica_of.items()))), checkpoint=ckpt) == result


# --- the workers carry the plan out: no except around the call --------------------------------

def _planner_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls of the planner: ``planner.plan(...)`` or ``plan(...)`` imported from it."""
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "undying.checkpoint.planner" for alias in node.names}
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in ("plan", "plan_restore", "plan_for_ddp")
                and isinstance(func.value, ast.Name) and func.value.id == "planner") or \
                (isinstance(func, ast.Name) and func.id in imported and func.id.startswith("plan")):
            calls.append(node)
    return calls


def _inside_try(tree: ast.AST, call: ast.Call) -> bool:
    parents: dict[ast.AST, ast.AST] = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    node: ast.AST = call
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try | ast.TryStar) and parent.handlers and node in parent.body:
            return True
        if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return False
        node = parent
    return False


def test_the_workers_call_the_one_planner_with_no_except_around_it() -> None:
    calls = 0
    for path in sorted(WORKER.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for call in _planner_calls(tree):
            calls += 1
            assert not _inside_try(tree, call), f"{path.name}:{call.lineno}: the planner's call is inside a try"
        # No planning of their own beside it.
        own = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("plan")]
        assert not own, f"{path.name} plans a restore itself: {own}"
    assert calls >= 3, "the DDP restore and the sharded restore (twice: before and after reading the checkpoint)"


def test_the_check_sees_a_call_inside_a_try() -> None:
    """The check above can fail: the same walk over code that swallows the planner's error."""
    tree = ast.parse("from undying.checkpoint import planner\n"
                     "def f():\n    try:\n        return planner.plan(1, [])\n    except Exception:\n"
                     "        return None\n")
    (call,) = _planner_calls(tree)
    assert _inside_try(tree, call)
