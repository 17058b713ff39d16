"""plan_restore: every small membership against a reference written from the docstring."""

from __future__ import annotations

import itertools
import random

import pytest

from undying.errors import NoStateSourceError, RecoveryError
from undying.worker.restore import RankStatus, RestorePlan, plan_restore

# (committed, clean, has_state) for one rank. A status with clean=True but
# has_state=False is documented as not arising (a process without state is not
# clean), but it is kept: the plan must not treat it as a holder either.
PER_RANK = list(itertools.product((0, 1, 2), (False, True), (False, True)))


def _statuses(combo: tuple[tuple[int, bool, bool], ...]) -> list[RankStatus]:
    return [RankStatus(rank, c, clean=cl, has_state=hs) for rank, (c, cl, hs) in enumerate(combo)]


def _reference(statuses: list[RankStatus]) -> RestorePlan | None:
    """The plan as the docstring states it, written independently."""
    holding = {s.rank: s.committed for s in statuses if s.clean and s.has_state}
    if not holding:
        return None
    target = max(holding.values())
    at_target = sorted(r for r, c in holding.items() if c == target)
    everyone = {s.rank for s in statuses}
    return RestorePlan(target=target, donor=at_target[0], receivers=tuple(sorted(everyone - set(at_target))))


def _check_invariants(statuses: list[RankStatus], plan: RestorePlan) -> None:
    by_rank = {s.rank: s for s in statuses}
    clean_holders = [s for s in statuses if s.clean and s.has_state]
    # The donor holds the target step cleanly.
    donor = by_rank[plan.donor]
    assert donor.clean and donor.has_state and donor.committed == plan.target
    # The donor is the lowest-ranked clean holder at the target.
    assert plan.donor == min(s.rank for s in clean_holders if s.committed == plan.target)
    # No completed work is thrown away.
    assert all(plan.target >= s.committed for s in clean_holders)
    # Receivers and the ranks already at the target partition the members.
    at_target = {s.rank for s in clean_holders if s.committed == plan.target}
    receivers = set(plan.receivers)
    assert receivers.isdisjoint(at_target)
    assert receivers | at_target == set(by_rank)
    assert plan.donor not in receivers
    assert list(plan.receivers) == sorted(plan.receivers)
    assert len(plan.receivers) == len(receivers)


@pytest.mark.parametrize("first", PER_RANK, ids=lambda c: f"r0={c[0]}{'c' if c[1] else 'd'}{'s' if c[2] else 'n'}")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_plan_matches_reference_for_every_small_membership(world_size: int, first: tuple[int, bool, bool]) -> None:
    """Every membership of up to 4 ranks, sharded by rank 0's status to keep each test short."""
    count = 0
    for rest in itertools.product(PER_RANK, repeat=world_size - 1):
        statuses = _statuses((first, *rest))
        expected = _reference(statuses)
        try:
            plan = plan_restore(statuses)
        except NoStateSourceError:
            assert expected is None, statuses
        else:
            assert expected is not None, statuses
            assert plan == expected, statuses
            _check_invariants(statuses, plan)
        count += 1
    assert count == len(PER_RANK) ** (world_size - 1)


def test_the_enumeration_covers_both_outcomes() -> None:
    outcomes = {_reference(_statuses(c)) is None for c in itertools.product(PER_RANK, repeat=2)}
    assert outcomes == {True, False}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_computes_the_same_plan_whatever_the_order(world_size: int) -> None:
    """all_gather gives the list in rank order, but the plan must not depend on it."""
    rng = random.Random(world_size)
    combos = list(itertools.product(PER_RANK, repeat=world_size))
    for combo in rng.sample(combos, min(400, len(combos))):
        statuses = _statuses(combo)
        if _reference(statuses) is None:
            continue
        plan = plan_restore(statuses)
        for _ in range(3):
            shuffled = statuses[:]
            rng.shuffle(shuffled)
            assert plan_restore(shuffled) == plan


def test_a_survivor_ahead_of_its_peers_shares_its_newer_step() -> None:
    statuses = [
        RankStatus(0, 4, clean=True, has_state=True),
        RankStatus(1, 5, clean=True, has_state=True),  # finished step 5 before rank 2 died
        RankStatus(2, 0, clean=False, has_state=False),  # the replacement
        RankStatus(3, 5, clean=True, has_state=True),
    ]
    assert plan_restore(statuses) == RestorePlan(target=5, donor=1, receivers=(0, 2))


def test_a_half_updated_rank_is_not_a_donor_even_when_ahead() -> None:
    statuses = [
        RankStatus(0, 7, clean=False, has_state=True),  # its optimizer stepped in the failed step
        RankStatus(1, 6, clean=True, has_state=True),
    ]
    assert plan_restore(statuses) == RestorePlan(target=6, donor=1, receivers=(0,))


def test_nothing_to_move_when_every_rank_is_at_the_target() -> None:
    statuses = [RankStatus(r, 3, clean=True, has_state=True) for r in range(3)]
    assert plan_restore(statuses) == RestorePlan(target=3, donor=0, receivers=())


def test_no_clean_holder_raises_naming_every_member() -> None:
    statuses = [
        RankStatus(0, 3, clean=False, has_state=True),
        RankStatus(1, 0, clean=False, has_state=False),
        RankStatus(2, 2, clean=True, has_state=False),
    ]
    with pytest.raises(NoStateSourceError) as info:
        plan_restore(statuses)
    assert isinstance(info.value, RecoveryError)
    message = str(info.value)
    assert "rank 0: committed 3, clean=False, has_state=True" in message
    assert "rank 1: committed 0, clean=False, has_state=False" in message
    assert "rank 2: committed 2, clean=True, has_state=False" in message


def test_a_regroup_generation_renumbers_its_members_and_leaves_out_the_rest() -> None:
    from undying.protocol.generations import GenerationRecord

    plain = GenerationRecord(3, 4, "h", 1)
    assert [plain.member_rank(r) for r in range(4)] == [0, 1, 2, 3]
    regroup = GenerationRecord(4, 2, "h", 1, members={"2": 0, "3": 1}, purpose="regroup")
    assert [regroup.member_rank(r) for r in range(4)] == [None, None, 0, 1]
    assert GenerationRecord.from_json(regroup.to_json()) == regroup
