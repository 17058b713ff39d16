"""The one planner's other paths (``checkpoint.planner.paths``): the start, the two roll-backs, the regroup.

Tables of cases, and properties over random situations: a roll-back never goes
to a step newer than every source holds, never past the failed step, and never
restores from the suspect's own copy of an unverified state.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from undying.checkpoint.layout import LayoutError
from undying.checkpoint.planner import (
    UNREAD,
    PersistedState,
    Source,
    StatePlan,
    plan_numerics_rollback,
    plan_regroup,
    plan_start,
    plan_verify_rollback,
)
from undying.checkpoint.planner.paths import Occasion
from undying.errors import NoStateSourceError

# --- the start -------------------------------------------------------------------------------------


def test_a_launch_without_a_checkpoint_starts_fresh() -> None:
    start = plan_start(joining=False, checkpoint=None)
    assert (start.occasion, start.source, start.step, start.lost_steps) == (Occasion.START, Source("fresh", step=0), 0, 0)
    assert "no checkpoint" in start.reason


def test_a_launch_with_a_checkpoint_resumes_from_it() -> None:
    start = plan_start(joining=False, checkpoint=PersistedState(12, path="/ckpt/step-12"))
    assert start.source == Source("checkpoint", step=12, path="/ckpt/step-12") and start.step == 12
    assert "/ckpt/step-12" in start.describe()
    assert start.to_dict()["source"] == {"kind": "checkpoint", "rank": None, "step": 12, "path": "/ckpt/step-12"}


@pytest.mark.parametrize("checkpoint", [None, PersistedState(3, path="/c")])
def test_a_replacement_gets_its_state_from_the_members_whatever_the_checkpoint(
        checkpoint: PersistedState | None) -> None:
    start = plan_start(joining=True, checkpoint=checkpoint)
    assert start.source.kind == "peer" and start.step is None and "restore plan" in start.reason


# --- the numerics roll-back ------------------------------------------------------------------------


@pytest.mark.parametrize(("why", "step", "n", "oldest", "kind", "to", "lost"), [
    ("every ring full: N steps back", 10, 3, [5, 5], "snapshot", 7, 2),
    ("a ring that holds fewer decides for all", 10, 3, [5, 9], "snapshot", 8, 1),
    ("a rank without a ring: nothing earlier", 10, 3, [5, None], "self", 9, 0),
    ("N = 1: only the failed step's own pre-state, the batch skipped", 10, 1, [1, 1], "self", 9, 0),
    ("the job's first steps", 2, 5, [1, 1], "snapshot", 0, 1),
])
def test_numerics_rollback_table(why: str, step: int, n: int, oldest: list[int | None], kind: str, to: int,
                                 lost: int) -> None:
    rollback = plan_numerics_rollback(step=step, rollback_steps=n, oldest=oldest)
    assert (rollback.source.kind, rollback.step, rollback.lost_steps) == (kind, to, lost), why
    assert rollback.source.rank is None, "each rank's own snapshot: no donor"


@pytest.mark.parametrize(("step", "n", "oldest"), [(0, 2, [1]), (3, 0, [1]), (3, 2, []), (3, 2, [4]), (True, 2, [1])])
def test_numerics_rollback_refuses_what_is_no_job(step: int, n: int, oldest: list[int | None]) -> None:
    with pytest.raises(LayoutError):
        plan_numerics_rollback(step=step, rollback_steps=n, oldest=oldest)


@settings(max_examples=300, deadline=None)
@given(step=st.integers(1, 200), n=st.integers(1, 64), data=st.data())
def test_numerics_rollback_properties(step: int, n: int, data: st.DataObject) -> None:
    oldest = data.draw(st.lists(st.one_of(st.none(), st.integers(1, step)), min_size=1, max_size=8))
    rollback = plan_numerics_rollback(step=step, rollback_steps=n, oldest=oldest)
    assert rollback.step is not None
    back_to = rollback.step + 1
    # Never newer than every source holds, never older than N steps back, never past the failed step.
    assert all(back_to >= (step if held is None else held) for held in oldest)
    assert step - n + 1 <= back_to <= step
    assert rollback.lost_steps == step - back_to
    assert (rollback.source.kind == "snapshot") == (back_to < step)
    assert rollback.source.step == rollback.step


# --- the verification roll-back --------------------------------------------------------------------


def test_a_mismatch_goes_back_to_the_last_verified_state_from_its_holders_file() -> None:
    rollback = plan_verify_rollback(world_size=4, bad_step=12, bad_rank=2, rollback_to=8, holder=3, committed=13,
                                    file="pre-1r0000-8.pt")
    assert rollback.source == Source("holder_file", 3, 7, "pre-1r0000-8.pt")
    assert (rollback.step, rollback.lost_steps) == (7, 6)
    assert "last verified" in rollback.reason and "not from its own memory" in rollback.reason


def test_without_a_verified_state_the_failed_steps_own_pre_state_from_another_rank() -> None:
    rollback = plan_verify_rollback(world_size=2, bad_step=4, bad_rank=1, rollback_to=4, holder=0, committed=4)
    assert (rollback.source.kind, rollback.source.rank, rollback.step, rollback.lost_steps) == ("holder_file", 0, 3, 1)


def test_never_the_suspects_own_copy_of_an_unverified_state() -> None:
    with pytest.raises(NoStateSourceError, match="rank 1 is the suspect"):
        plan_verify_rollback(world_size=2, bad_step=4, bad_rank=1, rollback_to=4, holder=1, committed=4)
    # Alone, the suspect is the only holder there is (the replay still compared it with itself).
    alone = plan_verify_rollback(world_size=1, bad_step=4, bad_rank=0, rollback_to=4, holder=0, committed=4)
    assert alone.source.rank == 0


@pytest.mark.parametrize("kwargs", [
    {"rollback_to": 5},  # after the failed step
    {"committed": 2},  # past what the job committed
    {"holder": 4},  # no such rank
    {"bad_rank": -1},
])
def test_verify_rollback_refuses_a_roll_back_that_is_not_back(kwargs: dict[str, int]) -> None:
    args = {"world_size": 4, "bad_step": 4, "bad_rank": 1, "rollback_to": 4, "holder": 2, "committed": 4, **kwargs}
    with pytest.raises(LayoutError):
        plan_verify_rollback(**args)


@settings(max_examples=300, deadline=None)
@given(world=st.integers(1, 16), data=st.data())
def test_verify_rollback_properties(world: int, data: st.DataObject) -> None:
    bad_step = data.draw(st.integers(1, 500))
    committed = data.draw(st.integers(bad_step, bad_step + 64))
    rollback_to = data.draw(st.integers(1, bad_step))
    bad_rank, holder = data.draw(st.integers(0, world - 1)), data.draw(st.integers(0, world - 1))
    try:
        rollback = plan_verify_rollback(world_size=world, bad_step=bad_step, bad_rank=bad_rank,
                                        rollback_to=rollback_to, holder=holder, committed=committed)
    except NoStateSourceError:
        assert rollback_to == bad_step and holder == bad_rank and world > 1
        return
    # A file, never a rank's memory; never the suspect's own copy of the unverified step.
    assert rollback.source.kind == "holder_file" and rollback.source.rank == holder
    assert not (rollback_to == bad_step and holder == bad_rank and world > 1)
    # Never newer than the source holds nor than the failed step; the re-run steps counted.
    assert rollback.step == rollback.source.step == rollback_to - 1 < bad_step
    assert rollback.lost_steps == committed - rollback.step >= 1


# --- the regroup -----------------------------------------------------------------------------------


def test_a_regroup_of_a_whole_state_saves_the_members_newest_step() -> None:
    saving = plan_regroup(members=[3, 0, 1], newest=40, sharded=False)
    assert (saving.occasion, saving.source, saving.step) == (Occasion.REGROUP, Source("self", step=40), 40)
    assert "ranks [0, 1, 3] hold step 40" in saving.reason


@pytest.mark.parametrize(("members", "sharded", "why"), [
    ([0, 1], True, "sharded state is not whole"),
    ([], False, "no rank is left"),
])
def test_a_regroup_that_cannot_save_the_members_state_starts_from_the_latest_checkpoint(
        members: list[int], sharded: bool, why: str) -> None:
    saving = plan_regroup(members=members, newest=40, sharded=sharded)
    assert saving.source == Source("checkpoint") and saving.step is None and why in saving.reason


@settings(max_examples=200, deadline=None)
@given(newest=st.integers(0, 1000), saved=st.integers(0, 1000), sharded=st.booleans())
def test_the_new_world_starts_from_the_saved_checkpoint_and_counts_the_steps_re_run(
        newest: int, saved: int, sharded: bool) -> None:
    start = plan_regroup(members=[0], newest=newest, sharded=sharded, checkpoint=PersistedState(saved, path="/s"))
    assert start.source == Source("checkpoint", step=saved, path="/s") and start.step == saved
    assert start.lost_steps == max(0, newest - saved)
    assert ("re-run" in start.reason) == bool(start.lost_steps)


def test_the_regroup_default_reads_no_checkpoint() -> None:
    assert plan_regroup(members=[0], newest=1, sharded=False, checkpoint=UNREAD).source.kind == "self"


def test_every_plan_says_where_and_why() -> None:
    plans: list[StatePlan] = [
        plan_start(joining=False, checkpoint=None),
        plan_numerics_rollback(step=5, rollback_steps=2, oldest=[1]),
        plan_verify_rollback(world_size=2, bad_step=4, bad_rank=1, rollback_to=4, holder=0, committed=4),
        plan_regroup(members=[0], newest=3, sharded=False),
    ]
    for plan in plans:
        assert plan.reason and plan.describe().startswith(plan.occasion.value + ": ")
        assert set(plan.to_dict()) == {"occasion", "source", "step", "reason", "lost_steps"}
