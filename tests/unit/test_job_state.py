"""The job's state machine and an incident's timeline."""

from __future__ import annotations

import itertools

import pytest

from undying.jobfiles.records import (
    IllegalTransition,
    Incident,
    JobState,
    JobStateMachine,
    RankInfo,
    RankState,
)

S = JobState
# Written from the design, independently of the module's table.
EXPECTED = {
    (S.STARTING, S.RUNNING), (S.STARTING, S.RECOVERING), (S.STARTING, S.STOPPING),
    (S.RUNNING, S.RECOVERING), (S.RUNNING, S.STOPPING),
    (S.RECOVERING, S.RUNNING), (S.RECOVERING, S.RECOVERING), (S.RECOVERING, S.STOPPING),
    (S.STOPPING, S.SUCCEEDED), (S.STOPPING, S.FAILED), (S.STOPPING, S.STOPPED),
    (S.STOPPING, S.PREEMPTED),
}
PATHS = {
    S.STARTING: [],
    S.RUNNING: [S.RUNNING],
    S.RECOVERING: [S.RECOVERING],
    S.STOPPING: [S.STOPPING],
    S.SUCCEEDED: [S.STOPPING, S.SUCCEEDED],
    S.FAILED: [S.STOPPING, S.FAILED],
    S.STOPPED: [S.STOPPING, S.STOPPED],
    S.PREEMPTED: [S.STOPPING, S.PREEMPTED],
}


def machine_in(state: JobState) -> JobStateMachine:
    m = JobStateMachine()
    for step in PATHS[state]:
        m.move(step)
    assert m.state is state
    return m


def test_starts_in_starting() -> None:
    assert JobStateMachine().state is JobState.STARTING


@pytest.mark.parametrize(("old", "new"), list(itertools.product(JobState, JobState)))
def test_every_move(old: JobState, new: JobState) -> None:
    m = machine_in(old)
    if (old, new) in EXPECTED:
        m.move(new)
        assert m.state is new
    else:
        with pytest.raises(IllegalTransition) as info:
            m.move(new)
        assert m.state is old  # an illegal move changes nothing
        assert f"{old.value} cannot move to {new.value}" in str(info.value)


@pytest.mark.parametrize("state", list(JobState))
def test_terminal_states_have_no_exits(state: JobState) -> None:
    assert state.terminal == (state in (S.SUCCEEDED, S.FAILED, S.STOPPED, S.PREEMPTED))
    if state.terminal:
        m = machine_in(state)
        for new in JobState:
            with pytest.raises(IllegalTransition):
                m.move(new)


def test_a_move_updates_since() -> None:
    m = JobStateMachine()
    m.since = 0.0
    m.move(JobState.RUNNING)
    assert m.since > 0.0


def test_a_typical_life_with_two_recoveries() -> None:
    m = JobStateMachine()
    for new in (S.RUNNING, S.RECOVERING, S.RECOVERING, S.RUNNING, S.RECOVERING, S.RUNNING, S.STOPPING, S.SUCCEEDED):
        m.move(new)
    assert m.state.terminal


def test_incident_phases_are_relative_to_the_fault() -> None:
    inc = Incident(id=3, kind="crash", rank=2, step=12, fault_t=1000.0, recovery=1, action="replace")
    inc.phases.update({"detected": 1000.25, "decided": 1000.5, "state_restored": 1001.125})
    assert inc.mttr_s is None
    d = inc.to_dict()
    assert d["mttr_s"] is None
    assert d["phases"] == {"detected": 0.25, "decided": 0.5, "state_restored": 1.125}
    inc.phases["first_step_done"] = 1002.75
    d = inc.to_dict()
    assert d["mttr_s"] == pytest.approx(2.75)
    assert d["phases"]["first_step_done"] == pytest.approx(d["mttr_s"])
    assert inc.phases["detected"] == 1000.25  # the absolute times are kept
    assert {k: d[k] for k in ("id", "kind", "rank", "step", "action", "status", "fault_t")} == {
        "id": 3, "kind": "crash", "rank": 2, "step": 12, "action": "replace", "status": "open", "fault_t": 1000.0,
    }


def test_mttr_with_a_realistic_clock() -> None:
    fault = 1_700_000_000.123456
    inc = Incident(id=1, kind="crash", rank=0, step=1, fault_t=fault, recovery=1)
    inc.phases["first_step_done"] = fault + 1.5
    assert inc.mttr_s == pytest.approx(1.5, abs=1e-4)
    assert inc.to_dict()["phases"]["first_step_done"] == pytest.approx(1.5, abs=1e-4)


def test_rank_info_to_dict() -> None:
    info = RankInfo(rank=1, node=0, pid=42, state=RankState.RUNNING, step=7, generation=2, restarts=1)
    assert info.to_dict() == {
        "rank": 1, "node": 0, "pid": 42, "state": "running", "step": 7, "generation": 2,
        "restarts": 1, "last_seen": 0.0, "incarnation": 0,
    }
