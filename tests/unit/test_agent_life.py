"""The agent's life (undying.agent.life): one state, every move in one table, the rest refused."""

from __future__ import annotations

import pytest

from undying.agent.life import AgentLife, Event, IllegalMove, LifeMachine

S, E = AgentLife, Event


def _at(*events: Event) -> LifeMachine:
    life = LifeMachine()
    for event in events:
        life.move(event)
    return life


def test_an_agent_starts_serves_and_closes() -> None:
    life = LifeMachine()
    assert life.state is S.STARTING and not life.serving and not life.stopping
    assert life.move(E.SERVE) is S.SERVING and life.serving
    assert life.move(E.CLOSE) is S.CLOSED and not life.serving and life.stopping  # (it starts nothing)


@pytest.mark.parametrize(("events", "state", "serving", "stopping", "holds_zygote"), [
    ((E.SERVE,), S.SERVING, True, False, False),
    ((E.SERVE, E.REGROUP_EXIT), S.REGROUPING, True, False, True),
    ((E.SERVE, E.REGROUP_EXIT, E.REGROUP_EXIT), S.REGROUPING, True, False, True),
    ((E.SERVE, E.REGROUP_EXIT, E.START_PROCESS), S.SERVING, True, False, False),  # the job came back
    ((E.SERVE, E.STOP), S.STOPPING, True, True, False),
    ((E.SERVE, E.STOP, E.RESUME), S.SERVING, True, False, False),
    ((E.SERVE, E.STOP, E.STOP, E.RESUME, E.RESUME), S.SERVING, True, False, False),  # two StopNodes at once
    ((E.SERVE, E.REGROUP_EXIT, E.STOP), S.STOPPING_IN_REGROUP, True, True, True),  # the stop keeps the hold
    ((E.SERVE, E.REGROUP_EXIT, E.STOP, E.RESUME), S.REGROUPING, True, False, True),  # and gives it back
    ((E.SERVE, E.STOP, E.REGROUP_EXIT), S.STOPPING_IN_REGROUP, True, True, True),
    ((E.SERVE, E.STOP, E.START_PROCESS), S.STOPPING, True, True, False),
    ((E.SERVE, E.REGROUP_EXIT, E.STOP, E.START_PROCESS, E.RESUME), S.SERVING, True, False, False),
    ((E.START_PROCESS,), S.STARTING, False, False, False),  # before serving: a fresh interpreter
    ((E.SERVE, E.STOP, E.CLOSE), S.CLOSED, False, True, False),
    ((E.SERVE, E.CLOSE, E.STOP, E.START_PROCESS, E.REGROUP_EXIT, E.RESUME), S.CLOSED, False, True, False),
])
def test_each_life_says_what_the_agent_does(events: tuple[Event, ...], state: AgentLife, serving: bool,
                                            stopping: bool, holds_zygote: bool) -> None:
    life = _at(*events)
    assert (life.state, life.serving, life.stopping, life.holds_zygote) == (state, serving, stopping, holds_zygote)


def test_a_process_starting_or_ending_moves_from_every_state() -> None:
    """Processes start and end whatever the agent is doing: those events never raise."""
    for state in AgentLife:
        for event in (E.START_PROCESS, E.REGROUP_EXIT, E.CLOSE):
            life = LifeMachine()
            life.state = state
            life.move(event)


@pytest.mark.parametrize("events", [
    (E.SERVE, E.SERVE),  # started twice
    (E.STOP,),  # stopped before it serves
    (E.RESUME,),
    (E.SERVE, E.CLOSE, E.SERVE),  # nothing revives a closed agent
])
def test_a_callers_mistake_is_refused(events: tuple[Event, ...]) -> None:
    with pytest.raises(IllegalMove, match="cannot take"):
        _at(*events)
