"""The regroup's record and its decisions when a second fault overlaps it (undying.manager.regroup.record), alone."""

from __future__ import annotations

import json
import time

import pytest

from undying.config import EXIT_REGROUPED
from undying.manager.regroup.record import Regroup, max_attempts


def _regroup(*members: int) -> Regroup:
    return Regroup(why="node 2 lost", members={r: i for i, r in enumerate(members)}, step=12, generation=5,
                   first_members=len(members))


def test_members_that_leave_as_asked_are_no_fault() -> None:
    regroup = _regroup(0, 1)
    assert not regroup.member_left(1, EXIT_REGROUPED, "rank 1 exited")
    assert regroup.remaining() == [0] and not regroup.faults and not regroup.replan_due(time.time())


def test_a_member_lost_before_the_save_makes_a_replan_due_at_once() -> None:
    regroup = _regroup(0, 1)
    assert regroup.member_left(0, -9, "rank 0 killed by SIGKILL")
    assert regroup.replan_due(time.time()) and regroup.faults == ["rank 0 killed by SIGKILL"]
    again = regroup.successor([1], 12)
    assert again.members == {1: 0} and again.attempt == 2 and again.left == {0: -9}
    assert not again.replan_due(time.time()) and again.remaining() == [1]
    assert again.cause() == "node 2 lost; during the regroup: rank 0 killed by SIGKILL"


def test_a_member_lost_after_the_save_lets_the_others_go_instead() -> None:
    regroup = _regroup(0, 1, 2)
    regroup.on_saved("/ckpt/step-000000012")
    assert regroup.to_release() == []  # undisturbed: they leave by themselves
    assert regroup.member_left(2, -9, "node 2 lost")
    assert not regroup.replan_due(time.time() + 60)
    assert regroup.to_release() == [0, 1]
    regroup.released.extend([0, 1])
    assert not regroup.member_left(0, -9, "released")  # a member let go is no fault
    assert regroup.to_release() == []


def test_a_broken_group_replans_after_the_grace_unless_an_exit_explains_it_first() -> None:
    regroup = _regroup(0, 1)
    regroup.group_broke(4, "stale", grace_s=0.5)  # an older generation's failure: nothing
    assert not regroup.replan_at
    regroup.group_broke(5, "rank 0's group broke", grace_s=0.5)
    assert not regroup.replan_due(time.time()) and regroup.replan_due(time.time() + 1)
    explained = _regroup(0, 1)
    explained.group_broke(5, "rank 0's group broke", grace_s=30)
    explained.member_left(1, -9, "rank 1 killed by SIGKILL")
    assert explained.replan_due(time.time())
    assert explained.successor([0], 12).faults == ["rank 1 killed by SIGKILL"]  # the symptom is not named
    alone = _regroup(0, 1)
    alone.group_broke(5, "rank 0's group broke", grace_s=0)
    assert alone.successor([0, 1], 12).faults == ["rank 0's group broke"]


def test_a_broken_group_after_the_save_lets_the_members_go() -> None:
    regroup = _regroup(0, 1)
    regroup.on_saved("/ckpt/x")
    regroup.group_broke(5, "rank 1's group broke", grace_s=0)
    assert not regroup.replan_due(time.time() + 1) and regroup.to_release() == [0, 1]


def test_the_record_survives_the_log_as_json() -> None:
    regroup = _regroup(0, 1, 2)
    regroup.member_left(2, -9, "node 2 lost")
    regroup.on_saved("/ckpt/x")
    regroup.waiting_since = 123.0
    back = Regroup.from_log(json.loads(json.dumps(regroup.to_log())), now=1000.0)
    assert (back.members, back.left, back.faults, back.saved, back.waiting_since, back.generation) == (
        regroup.members, regroup.left, regroup.faults, regroup.saved, 123.0, 5)
    assert back.restored_at == 1000.0 and back.started == regroup.started and back.first_members == 3


@pytest.mark.parametrize(("members", "retries", "expected"), [(2, 3, 6), (3, 0, 5), (1, 1, 3)])
def test_replans_are_bounded_by_the_members_and_the_retries(members: int, retries: int, expected: int) -> None:
    assert max_attempts(members, retries) == expected
