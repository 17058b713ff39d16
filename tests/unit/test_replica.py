"""Ring replication's pure parts: the restore plan for sharded state, the ring, the switch, the copies."""

from __future__ import annotations

import itertools
import random

import pytest

from undying.errors import RecoveryError, UsageError
from undying.worker.replica import (
    Copies,
    ReplicationConfig,
    ShardPlan,
    ShardSource,
    plan_shards,
    ring_offset,
)
from undying.worker.restore import MODE_SHARDED, MODE_UNKNOWN, RankStatus


def survivor(rank: int, committed: int, *, clean: bool = True, own: tuple[int, ...] = (),
             replicas: tuple[int, ...] = ()) -> RankStatus:
    return RankStatus(rank, committed, clean=clean, has_state=True, mode=MODE_SHARDED, own=own, replicas=replicas)


def replacement(rank: int) -> RankStatus:
    return RankStatus(rank, 0, clean=False, has_state=False, mode=MODE_UNKNOWN)


def reference(statuses: list[RankStatus], offset: int) -> int | None:
    """The target as the docstring states it, written independently: try every step, newest first."""
    world = len(statuses)
    steps = {s.committed for s in statuses} | {x for s in statuses for x in (*s.own, *s.replicas)}
    for step in sorted(steps, reverse=True):
        ok = True
        for s in statuses:
            mine = s.has_state and ((s.clean and s.committed == step) or step in s.own)
            holder = statuses[(s.rank + offset) % world]
            held = holder.rank != s.rank and holder.has_state and step in holder.replicas
            ok = ok and (mine or held)
        if ok:
            return step
    return None


def check(statuses: list[RankStatus], offset: int) -> ShardPlan:
    plan = plan_shards(statuses, offset)
    assert plan.target == reference(statuses, offset), statuses
    world = len(statuses)
    if plan.target is None:
        assert plan.sources == {}
        return plan
    assert sorted(plan.sources) == list(range(world))
    for s in statuses:
        source = plan.sources[s.rank]
        if source.kind == "live":
            assert s.has_state and s.clean and s.committed == plan.target and source.holder == s.rank
        elif source.kind == "own":
            assert s.has_state and plan.target in s.own and source.holder == s.rank
            assert not (s.clean and s.committed == plan.target), "the live state is preferred to a copy"
        else:
            assert source.kind == "replica" and source.holder == (s.rank + offset) % world
            holder = statuses[source.holder]
            assert holder.has_state and plan.target in holder.replicas
            assert not (s.has_state and ((s.clean and s.committed == plan.target) or plan.target in s.own))
    newest = max((s.committed for s in statuses if s.has_state), default=0)
    assert plan.lost_steps == max(0, newest - plan.target)
    return plan


def test_a_killed_rank_gets_its_shard_from_its_successor_and_survivors_keep_theirs() -> None:
    statuses = [survivor(0, 5, own=(5,), replicas=(5,)), survivor(1, 5, own=(5,), replicas=(5,)),
                replacement(2), survivor(3, 5, own=(5,), replicas=(5,))]
    plan = check(statuses, 1)
    assert plan.target == 5 and plan.lost_steps == 0
    assert plan.sources[2] == ShardSource("replica", 3)
    assert all(plan.sources[r] == ShardSource("live", r) for r in (0, 1, 3))
    assert plan.describe() == ("step 5: rank 0 <- its own state, rank 1 <- its own state, "
                               "rank 2 <- replica on rank 3, rank 3 <- its own state")


def test_the_replica_lives_on_the_next_node() -> None:
    # 2 nodes of 2 ranks: rank 1's replica is on rank 3 (offset 2), not on rank 2.
    statuses = [survivor(0, 4, own=(4,), replicas=(4,)), replacement(1),
                survivor(2, 4, own=(4,), replicas=(4,)), survivor(3, 4, own=(4,), replicas=(4,))]
    assert check(statuses, 2).sources[1] == ShardSource("replica", 3)


def test_a_lagging_replica_rolls_every_rank_back_and_counts_the_steps() -> None:
    # Replicated every 3 steps: the last copies are of step 6, the survivors are at 8.
    statuses = [survivor(0, 8, own=(6,), replicas=(6,)), survivor(1, 8, own=(6,), replicas=(6,)),
                replacement(2), survivor(3, 8, own=(6,), replicas=(6,))]
    plan = check(statuses, 1)
    assert plan.target == 6 and plan.lost_steps == 2
    assert [plan.sources[r].kind for r in range(4)] == ["own", "own", "replica", "own"]
    assert plan.describe().endswith("; 2 step(s) re-run")


def test_torn_survivors_use_their_snapshot() -> None:
    # Died between the exchange of step 6 and its barrier: everyone's step 6 copy exists, nobody committed it.
    statuses = [survivor(0, 5, clean=False, own=(6, 5), replicas=(6, 5)),
                survivor(1, 5, clean=False, own=(6, 5), replicas=(6, 5)),
                replacement(2), survivor(3, 5, clean=False, own=(6, 5), replicas=(6, 5))]
    plan = check(statuses, 1)
    assert plan.target == 6 and plan.lost_steps == 0 and plan.newest == 5


def test_neighbours_lost_together_have_no_copy_in_memory() -> None:
    statuses = [survivor(0, 5, own=(5,), replicas=(5,)), replacement(1), replacement(2),
                survivor(3, 5, own=(5,), replicas=(5,))]
    plan = check(statuses, 1)
    assert plan.target is None and plan.missing == (1,)
    assert "rank(s) 1" in plan.describe() and "checkpoint" in plan.describe()


def test_without_replication_only_a_fault_that_lost_no_rank_is_restored_in_memory() -> None:
    assert check([survivor(r, 7) for r in range(3)], 1).target == 7
    assert check([survivor(0, 7), survivor(1, 7), replacement(2)], 1).target is None
    # Ranks that ended at different steps with no copies cannot agree on one.
    assert check([survivor(0, 7), survivor(1, 8)], 1).target is None


def test_incomplete_statuses_are_refused() -> None:
    with pytest.raises(RecoveryError, match="not one whole job"):
        plan_shards([survivor(0, 1), survivor(2, 1)], 1)


RANK_CHOICES = [
    None,  # a replacement
    *[(committed, clean, own, replicas)
      for committed in (4, 5)
      for clean in (False, True)
      for own in ((), (4,), (5, 4))
      for replicas in ((), (4,), (5, 4))],
]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_matches_reference_for_every_small_job(world: int) -> None:
    for combo in itertools.product(RANK_CHOICES, repeat=world):
        statuses = [replacement(r) if c is None else survivor(r, c[0], clean=c[1], own=c[2], replicas=c[3])
                    for r, c in enumerate(combo)]
        check(statuses, 1 if world > 1 else 0)


def test_plan_matches_reference_on_random_larger_jobs() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        world = rng.choice([4, 6, 8])
        offset = rng.choice([1, 2, world // 2])
        statuses = [replacement(r) if rng.random() < 0.2 else
                    survivor(r, *rng.choice(RANK_CHOICES[1:])[:1], clean=rng.random() < 0.7,
                             own=rng.choice([(), (4,), (5, 4), (5,)]), replicas=rng.choice([(), (4,), (5, 4), (5,)]))
                    for r in range(world)]
        check(statuses, offset)


@pytest.mark.parametrize(("world", "local", "offset"), [(1, 1, 0), (4, 4, 1), (2, 2, 1), (8, 4, 4), (6, 2, 2),
                                                        (4, 1, 1)])
def test_ring_offset_reaches_another_node_when_there_is_one(world: int, local: int, offset: int) -> None:
    assert ring_offset(world, local) == offset


def test_the_switch_reads_the_environment_and_refuses_bad_values() -> None:
    assert ReplicationConfig.from_environ({}) == ReplicationConfig("off", 1)
    config = ReplicationConfig.from_environ({"UNDYING_REPLICATE": "Ring", "UNDYING_REPLICATE_EVERY": "4"})
    assert config.ring and config.every == 4
    with pytest.raises(UsageError, match="UNDYING_REPLICATE='mirror'"):
        ReplicationConfig.from_environ({"UNDYING_REPLICATE": "mirror"})
    for bad in ("0", "x", "-2"):
        with pytest.raises(UsageError, match="UNDYING_REPLICATE_EVERY"):
            ReplicationConfig.from_environ({"UNDYING_REPLICATE": "ring", "UNDYING_REPLICATE_EVERY": bad})


def test_copies_keep_the_newest_committed_step_and_what_came_after() -> None:
    copies = Copies(own={3: b"a", 4: b"b"}, replicas={3: b"c", 4: b"d"})
    copies.own[5] = b"e"  # exchanged, not committed: kept beside 4
    copies.committed(4)
    assert sorted(copies.own) == [4, 5] and sorted(copies.replicas) == [4]
    copies.keep_only(5)
    assert list(copies.own) == [5] and copies.replicas == {}
    assert copies.nbytes() == 1
