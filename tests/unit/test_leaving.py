"""A rank that exits 0 before its last step: held, then a left-early incident or its part of the job done.

Real Managers fed the exits and messages their agents report (manager.leaving,
policy.decide); the processes are tests/integration/test_left_early.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.live_manager import on_nodes, running
from undying.jobfiles.events import LogReader
from undying.jobfiles.records import Incident
from undying.manager.manager import Manager
from undying.manager.recovery import Action, PolicyContext, decide
from undying.protocol.node_wire import RankProgress
from undying.protocol.worker_wire import Done, StepCommitted


def _verdicts(manager: Manager) -> list[str]:
    manager.events.flush()
    with LogReader(manager.events.path) as log:
        return [e.data["verdict"] for e in log.events("left_early")]


def test_every_rank_ending_its_loop_at_the_same_step_succeeds_as_under_torchrun(tmp_path: Path) -> None:
    manager, _ = running(tmp_path)
    manager.on_exit(1, manager.ranks[1].pid, 0, 10.0)
    assert manager.state.value == "running" and _verdicts(manager) == ["pending"]  # held, not finished
    manager.on_exit(0, manager.ranks[0].pid, 0, 10.1)
    assert manager.state.value == "succeeded" and not manager.incidents
    assert _verdicts(manager)[2:] == ["every rank ended its loop: it at step 4, none went on past it"] * 2
    manager.close()


def test_a_done_that_comes_after_the_exit_finishes_the_rank(tmp_path: Path) -> None:
    manager, _ = running(tmp_path)
    for rank in (0, 1):
        manager.on_exit(rank, manager.ranks[rank].pid, 0, 10.0)  # (the agent's exit watch was first)
        manager.on_message(Done(rank, 4, "d", 10.0))
    assert manager.state.value == "succeeded" and not manager.incidents
    manager.close()


def test_a_node_lost_after_its_ranks_said_done_and_before_they_exited_ends_the_job(tmp_path: Path) -> None:
    """Its agent left (a SIGTERM) as the job ended: the exits it would have reported never come."""
    manager, agents = on_nodes(tmp_path)
    for rank in (0, 1):
        manager.on_message(Done(rank, 4, "d", 9.0))
    manager.on_node_lost(1, "node 1 (h1) is leaving: SIGTERM to the agent of node 1", 10.0)
    assert manager.state.value == "running"  # (rank 0's exit is still to come)
    manager.on_exit(0, manager.ranks[0].pid, 0, 10.1)
    assert manager.state.value == "succeeded" and not manager.incidents
    assert agents[0].spawned == [(0, False)] and agents[1].spawned == [(1, False)], "nothing replaced"
    manager.close()


def test_a_node_lost_before_its_rank_said_done_after_a_peer_did_ends_the_job(tmp_path: Path) -> None:
    """A peer's done means the job's final barrier completed: the lost rank passed it too."""
    manager, agents = on_nodes(tmp_path)
    manager.on_message(Done(0, 4, "d", 9.0))
    manager.on_exit(0, manager.ranks[0].pid, 0, 9.1)
    manager.on_node_lost(1, "node 1 (h1) is leaving: SIGTERM to the agent of node 1", 10.0)
    assert manager.state.value == "succeeded" and not manager.incidents
    assert agents[1].spawned == [(1, False)], "nothing replaced"
    manager.close()


@pytest.mark.parametrize("evidence", ["commit", "stall"])
def test_a_rank_whose_peer_goes_on_left_early_and_is_replaced(tmp_path: Path, evidence: str) -> None:
    manager, agent = running(tmp_path)
    manager.on_exit(1, manager.ranks[1].pid, 0, 10.0)
    if evidence == "commit":  # rank 0 committed steps after rank 1's last one
        manager.on_message(StepCommitted(0, 0, 5, 11.0, {"loss": 1.0}))  # (rank 1's own may still be on its way)
        assert not manager.incidents
        manager.on_message(StepCommitted(0, 0, 6, 12.0, {"loss": 1.0}))
    else:  # rank 0 is stuck in step 5 (in a collective rank 1 never joins)
        manager.on_stall([RankProgress(0, manager.ranks[0].pid, 0, "step", 5, 3, 11.0)], 5.0, 17.0)
    [incident] = [i for i in manager.incidents if i.kind == "left-early"]
    assert (incident.rank, incident.step, incident.action) == (1, 5, "replace"), incident
    assert "exited 0 at step 5 before finishing its steps" in incident.error
    assert agent.spawned[-1] == (1, True) and manager.state.value == "recovering"
    manager.close()


def _left(rank: int = 1, step: int = 5, action: str = "", injected: bool = False) -> Incident:
    incident = Incident(id=rank * 100 + step, kind="left-early", rank=rank, step=step, fault_t=1.0, recovery=1,
                        action=action)
    if injected:
        incident.detail["injected"] = True
    return incident


@pytest.mark.parametrize(("history", "now", "action"), [
    ([], _left(), Action.REPLACE),  # the first time: replaced like a crash
    ([_left(action="replace")], _left(step=6), Action.FAIL),  # the same rank again, at any step: the script
    ([_left(rank=0, action="replace")], _left(), Action.REPLACE),  # another rank's
    ([_left(action="replace", injected=True)], _left(), Action.REPLACE),  # an injected one never counts
    ([_left(action="replace")], _left(injected=True), Action.REPLACE),  # nor is one
])
def test_a_rank_is_replaced_once_for_leaving_early_then_the_job_fails(history: list[Incident], now: Incident,
                                                                      action: Action) -> None:
    decision = decide(now, [*history, now], PolicyContext(max_restarts=3, holders_alive=1))
    assert decision.action is action, decision
    if action is Action.FAIL:
        assert decision.reason.startswith("rank 1 left the job early again at step 6") and "\n" not in decision.reason
