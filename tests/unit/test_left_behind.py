"""A survivor told to leave the old generation that neither fails nor rejoins is judged stuck (recovery/rounds.py)."""

from __future__ import annotations

import time
from pathlib import Path

from tests.unit.live_manager import logged, running
from undying.jobfiles.records import IncidentKind, RankState
from undying.manager.manager import Manager
from undying.manager.recovery import Recovery
from undying.protocol.node_wire import RankProgress
from undying.protocol.worker_wire import CommFailure, StepCommitted


def test_the_survivors_are_told_to_leave_and_one_that_never_does_is_stuck_after_the_limit(tmp_path: Path) -> None:
    manager, agent = running(tmp_path, ranks=3)
    try:
        manager.on_message(StepCommitted(2, 0, 5, 6.0, {"loss": 1.0}))  # rank 2 is a step ahead (at 4, the others)
        manager.on_exit(2, manager.ranks[2].pid, -9, time.time())  # rank 2 dies: replaced in generation 1
        told = manager.recoveries.current
        assert told is not None and manager.core.generations.current == 1
        assert agent.aborted == [], (
            "a crash's survivors are watched, not aborted: one whose step needs no more of rank 2 finishes it")
        assert sorted(agent.leaving_from) == [(0, 0, 6), (1, 0, 6)], (
            "told at once to leave step 6, which no rank completed; step 5, which rank 2 completed, may finish")
        assert told.leave is not None and told.leave.told == {0: manager.ranks[0].pid, 1: manager.ranks[1].pid}, "watched"
        manager.on_message(CommFailure(1, 0, 5, "peer closed", time.time()))  # rank 1 found the fault itself
        assert manager.ranks[1].state is RankState.RECOVERING
        assert told.leave is not None
        now = told.leave.t
        manager.watch.left_behind.judge(now + 0.5)
        assert agent.aborted == [], "within a step's time the survivor may still finish the step in flight"
        manager.watch.left_behind.judge(now + 1.5)
        assert agent.aborted == [(0, 0)], "then the one still in it is told to leave (rank 1 left by itself)"
        manager.watch.left_behind.judge(now + 2.0)
        assert agent.aborted == [(0, 0)], "told once"
        assert manager.recoveries.stuck(now + 4.0) == [], "within the limit nobody is judged"
        assert [i.rank for i in manager.recoveries.stuck(now + 6.0)] == [0], "rank 0 never left"
        assert manager.recoveries.stuck(now + 6.0, resumed=now + 3.0) == [], "a stall of the manager's own restarts the count"
        manager.ranks[0].pid += 1  # another process holds rank 0 now (say, a hang's replacement)
        assert manager.recoveries.stuck(now + 6.0) == [], "only the process that was told is judged"
    finally:
        manager.close()


def test_a_links_retry_tells_every_rank_to_leave_at_once(tmp_path: Path) -> None:
    """Every process lives in a retry: nothing ends the others' wait by itself, so their links are broken."""
    manager, agent = running(tmp_path, ranks=3)
    try:
        incident = manager.recoveries.new_incident(kind=IncidentKind.COMM_ERROR, rank=1, step=5, fault_t=time.time(),
                                                   detected_t=time.time(), error="link reset")
        manager.recoveries.handle(incident)
        assert incident.action == "retry" and manager.core.generations.current == 1
        assert sorted(agent.aborted) == [(0, 0), (1, 0), (2, 0)]
    finally:
        manager.close()


def test_a_newer_generation_since_the_telling_voids_it(tmp_path: Path) -> None:
    """A regroup renumbers the ranks and opens its own generation: the round's telling is old news."""
    manager, _ = running(tmp_path, ranks=3)
    try:
        manager.on_exit(2, manager.ranks[2].pid, -9, time.time())
        told = manager.recoveries.current
        assert told is not None
        manager.core.open_generation("a regroup")
        assert told.leave is not None and manager.recoveries.stuck(told.leave.t + 60.0) == []
    finally:
        manager.close()


def test_a_recovery_whose_first_step_waits_for_the_replacement_kills_it_within_the_step_timeout(tmp_path: Path) -> None:
    """The replacement replays its loader to the step, and the loader's __iter__ runs a collective (accelerate's
    rng synchronisation): the survivor waits in the step, the replacement in its own collective. Past the limit
    the recovery failed: the replacement is killed for it, with the reason, and replaced (a repeat at the same
    step ends the job by --max-step-recoveries)."""
    manager, agent = running(tmp_path)
    try:
        manager.on_exit(1, manager.ranks[1].pid, -9, time.time())
        recovery = manager.recoveries.current
        assert recovery is not None and manager.core.generations.current == 1
        replacement, started = manager.ranks[1].pid, recovery.started
        progress = [RankProgress(0, manager.ranks[0].pid, 1, "step", 5, 1, started + 1.0),
                    RankProgress(1, replacement, 1, "init", 4, 1, started + 1.0)]
        manager.on_stall(progress, 5.0, started + 4.0)
        assert agent.killed == [], "within the limit the step may still come"
        restoring = [progress[0], RankProgress(1, replacement, 1, "recovery", 4, 0, started + 1.0)]
        manager.on_stall(restoring, 5.0, started + 7.0)
        assert agent.killed == [], "a rank still restoring is the recovery deadline's"
        manager.on_stall(progress, 5.0, started + 7.0)
        assert agent.killed == [1]
        manager.on_exit(1, replacement, -9, started + 7.1)
        [hang] = [i for i in manager.incidents if i.kind == IncidentKind.HANG.value]
        assert (hang.rank, hang.step, hang.action) == (1, 5, "replace"), hang
        assert "did not come to step 5 after a recovery" in hang.error and "loader's __iter__" in hang.error
        assert manager.ranks[1].pid != replacement, "a new process takes its place"
    finally:
        manager.close()


def _kept_survivor(manager: Manager) -> tuple[Recovery, float]:
    """A 2-rank job loses rank 1 and its survivor stays stuck past the limit: kept as the last holder.
    The round, and when the survivor was kept."""
    manager.on_exit(1, manager.ranks[1].pid, -9, time.time())
    recovery = manager.recoveries.current
    assert recovery is not None and recovery.leave is not None
    kept_at = recovery.leave.t + 6.0
    manager.watch.left_behind.judge(kept_at)
    return recovery, kept_at


def test_a_stuck_survivor_that_is_the_last_holder_of_the_state_is_waited_for_not_killed(tmp_path: Path) -> None:
    """A 2-rank job loses rank 1: rank 0 alone holds the newest step. Killed for being stuck, it would take
    the state with it (the job failed so under load: 'every rank that held the training state is gone');
    kept, its collective ends by itself and the round goes on. With a third rank holding it too, it is killed."""
    manager, agent = running(tmp_path, ranks=2)
    try:
        told, kept_at = _kept_survivor(manager)
        assert [i.rank for i in manager.recoveries.stuck(kept_at)] == [0], "stuck past the limit"
        assert 0 not in agent.killed, "the last holder of the state is not killed"
        [kept] = logged(manager, tmp_path, "left_behind_kept")
        assert (kept["pid"], kept["step"]) == (manager.ranks[0].pid, 5), kept
        assert logged(manager, tmp_path, "left_behind") == []
        manager.watch.left_behind.judge(told.leave.t + 9.0)
        assert len(logged(manager, tmp_path, "left_behind_kept")) == 1, "said once"
        stuck = manager.ranks[0].pid
        assert manager.watch.left_behind.on_exit(manager.ranks[0], stuck) is False, "its exit is any exit"
        manager.ranks[0].pid += 1  # another process holds rank 0 now: the kept one's exit is old news
        manager.on_exit(0, stuck, -9, time.time())
        assert stuck not in manager.recoveries.kept, "forgotten at its exit, however judged: its pid may recur"
    finally:
        manager.close()


def test_a_kept_survivor_is_waited_for_until_its_collective_timeout_not_the_step_timeout(tmp_path: Path) -> None:
    """A collective stuck on a send gloo never wakes ends at gloo's own timeout, and the rank then leaves with
    its state: the step timeout's judgement (and the recovery timeout) wait for that; after it, it is judged
    as any rank (the CI run that found this killed the last holder at the step timeout: the job failed)."""
    manager, agent = running(tmp_path, ranks=2)
    try:
        recovery, kept_at = _kept_survivor(manager)
        survivor = manager.ranks[0].pid
        assert manager.recoveries.kept == {survivor: kept_at}
        timeouts = manager.core.config.timeouts
        stuck = [RankProgress(0, survivor, 0, "step", 5, 40, recovery.started - 0.1)]
        manager.on_stall(stuck, 30.0, recovery.started + 40.0)
        assert agent.killed == [], "past the step timeout, but its collective's own timeout has not come"
        assert manager.recoveries.overdue(recovery.started + timeouts.recovery_timeout + 1.0) == "", (
            "the round is not overdue while it waits for the last holder")
        after = kept_at + timeouts.collective_timeout + timeouts.heartbeat_timeout + 1.0
        assert manager.recoveries.overdue(after) != ""
        manager.on_stall(stuck, 30.0, after)
        assert agent.killed == [0], "still there after its collective's timeout: judged as any rank"
    finally:
        manager.close()


def test_a_kept_survivor_that_leaves_at_last_has_the_round_form_a_new_generation(tmp_path: Path) -> None:
    """The ranks that went on may have given up forming the generation it was late for (gloo's connect
    waits as long as its collective): a new one is opened in the same round, and every rank meets there."""
    manager, agent = running(tmp_path, ranks=2)
    try:
        recovery, _ = _kept_survivor(manager)
        assert manager.core.generations.current == 1 and manager.recoveries.kept
        manager.on_message(CommFailure(0, 0, 5, "Timed out waiting 20000ms for send operation to complete",
                                       time.time()))
        assert manager.core.generations.current == 2, "the round forms a new generation"
        assert manager.recoveries.current is recovery and recovery.generation == 2, "in the same round"
        assert manager.recoveries.kept == {}
        assert [i.kind for i in manager.incidents] == [IncidentKind.CRASH.value], "no incident of its own"
        assert (1, 1) in agent.aborted, "the rank that went on is told to leave generation 1"
        manager.on_message(CommFailure(0, 1, 5, "peer closed", time.time()))
        assert manager.core.generations.current == 2, "a rank not kept opens nothing"
    finally:
        manager.close()


def test_a_stuck_survivor_whose_state_another_rank_holds_is_killed(tmp_path: Path) -> None:
    manager, agent = running(tmp_path, ranks=3)
    try:
        manager.on_exit(2, manager.ranks[2].pid, -9, time.time())
        told = manager.recoveries.current
        assert told is not None and told.leave is not None
        manager.on_message(CommFailure(1, 0, 5, "peer closed", time.time()))  # rank 1 left by itself: it holds step 4
        manager.watch.left_behind.judge(told.leave.t + 6.0)
        assert agent.killed == [0], "rank 1 holds the same replicated state: the stuck rank 0 is killed"
        assert [e["pid"] for e in logged(manager, tmp_path, "left_behind")] == [manager.ranks[0].pid]
        assert logged(manager, tmp_path, "left_behind_kept") == []
    finally:
        manager.close()
