"""How a regroup's members leave their generation (manager/regroup/executor.py), on a real Manager.

A grow is planned: the members are told to leave at their next step's start. A member that has
neither failed nor joined the regroup's generation in time is stuck in gloo (a send it was writing
when its connection closed waits out the whole collective timeout): it is killed, with a
``left_behind`` event and no incident of its own, and the regroup goes on with the members left.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.unit.live_manager import logged, running
from undying.jobfiles.records import JobState, RankState
from undying.protocol.worker_wire import CommFailure


def test_a_grow_tells_its_members_to_leave_at_their_next_step_start(tmp_path: Path) -> None:
    manager, agent = running(tmp_path, ranks=2)
    try:
        manager.regrouping.begin("node 1 joined: the job grows to 2 nodes", planned=True)
        assert sorted(agent.aborted_at_step_start) == [(0, 0), (1, 0)]
    finally:
        manager.close()


def test_a_regroup_after_a_fault_tells_them_to_leave_at_once(tmp_path: Path) -> None:
    manager, agent = running(tmp_path, ranks=2)
    try:
        manager.regrouping.begin("node 1 lost")
        assert sorted(agent.aborted) == [(0, 0), (1, 0)] and agent.aborted_at_step_start == []
    finally:
        manager.close()


def test_a_member_that_never_leaves_is_killed_and_the_regroup_goes_on_without_an_incident(
        tmp_path: Path) -> None:
    manager, agent = running(tmp_path, ranks=3)
    try:
        manager.regrouping.begin("node 1 lost")
        regroup = manager.regrouping.regroup
        assert regroup is not None
        told = time.time()
        manager.on_message(CommFailure(0, 0, 5, "peer closed", told))  # ranks 0 and 2 leave
        manager.on_message(CommFailure(2, 0, 5, "peer closed", told))
        assert manager.ranks[1].state is RankState.RUNNING
        manager.regrouping.judge_left_behind(regroup, told + 4.0, 0.0)
        assert agent.killed == [], "within the limit (5 s, or 3 of the longest steps) it may still leave"
        manager.regrouping.judge_left_behind(regroup, told + 6.0, told + 3.0)
        assert agent.killed == [], "a stall of the manager's own restarts the count"
        manager.regrouping.judge_left_behind(regroup, told + 6.0, 0.0)
        assert agent.killed == [1]
        manager.regrouping.judge_left_behind(regroup, told + 7.0, 0.0)
        assert agent.killed == [1], "killed once"
        incidents, stuck = len(manager.incidents), manager.ranks[1].pid
        manager.on_exit(1, stuck, -9, told + 7.1)
        assert len(manager.incidents) == incidents, "no incident of its own"
        assert regroup.faults == ["rank 1 left behind in generation 0"] and regroup.replan_due(time.time())
        [event] = logged(manager, tmp_path, "left_behind")
        assert event["pid"] == stuck and 5.9 < event["waited_s"] <= 6.0, event
    finally:
        manager.close()


def test_a_planned_leave_is_judged_only_after_the_members_grace(tmp_path: Path) -> None:
    manager, agent = running(tmp_path, ranks=2)
    try:
        manager.regrouping.begin("node 1 joined: the job grows to 2 nodes", planned=True)
        regroup = manager.regrouping.regroup
        assert regroup is not None
        told = time.time()
        heartbeat = manager.core.config.timeouts.heartbeat_timeout
        manager.regrouping.judge_left_behind(regroup, told + 5.5, 0.0)
        assert agent.killed == [], "a member may take its grace to reach a step's start"
        manager.regrouping.judge_left_behind(regroup, told + heartbeat + 5.5, 0.0)
        assert sorted(agent.killed) == [0, 1]
    finally:
        manager.close()


def test_a_stuck_member_that_alone_holds_the_unsaved_state_is_waited_for_not_killed(tmp_path: Path) -> None:
    """Rank 1's process is gone: rank 0, stuck, is the only member left with the state, and nothing is
    saved yet. Killing it would leave the regroup nothing to save (recovery/left_behind.py's rule). The
    regroup's recovery timeout waits for it as a recovery's does: until its collective's own timeout (and a
    heartbeat) has passed since it was kept."""
    manager, agent = running(tmp_path, ranks=2)
    try:
        manager.regrouping.begin("node 1 lost")
        regroup = manager.regrouping.regroup
        assert regroup is not None
        told = time.time()
        manager.on_exit(1, manager.ranks[1].pid, -9, told)
        assert regroup.remaining() == [0] and not regroup.saved
        manager.regrouping.judge_left_behind(regroup, told + 6.0, 0.0)
        manager.regrouping.judge_left_behind(regroup, told + 9.0, 0.0)
        assert 0 not in agent.killed, "the last holder of the unsaved state is not killed"
        [kept] = logged(manager, tmp_path, "left_behind_kept")
        assert kept["pid"] == manager.ranks[0].pid and logged(manager, tmp_path, "left_behind") == []
        timeouts = manager.core.config.timeouts
        manager.regrouping.watch()  # (re-plans with the members left: rank 0)
        regroup = manager.regrouping.regroup
        assert regroup is not None and list(regroup.members) == [0], regroup
        regroup.started -= timeouts.recovery_timeout + 1.0  # the regroup is past its recovery timeout
        manager.regrouping.watch()
        assert manager.core.state is JobState.RECOVERING, "not while its collective's own timeout may end it"

        async def later() -> None:
            # kept a collective timeout and a heartbeat ago
            bound = timeouts.collective_timeout + timeouts.heartbeat_timeout
            manager.recoveries.kept[kept["pid"]] = time.time() - bound - 1.0
            manager.regrouping.watch()

        asyncio.run(later())
        assert manager.core.exit_reason and "did not save and leave" in manager.core.exit_reason, (
            "past that, judged as any regroup")
    finally:
        manager.close()
