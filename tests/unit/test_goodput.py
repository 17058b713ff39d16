"""Goodput (jobfiles/goodput.py): the wall time cut into steps that count and named losses, adding up."""

from __future__ import annotations

from typing import Any

import pytest

from undying.jobfiles.goodput import LOSSES, Stall, StepLedger, account


def ledger(*done: tuple[int, float]) -> StepLedger:
    steps = StepLedger()
    for step, t in done:
        steps.done(step, t)
    return steps


def crash(ident: int, fault: float, **phases: float) -> dict[str, Any]:
    """An incident as ``Incident.to_dict`` shows it: phases in seconds after the fault."""
    return {"id": ident, "kind": "crash", "rank": 1, "step": 0, "action": "replace", "status": "recovered",
            "fault_t": fault, "phases": {k: v - fault for k, v in phases.items()}}


def adds_up(g: Any) -> None:
    assert g.goodput_s + sum(g.losses.values()) == pytest.approx(g.wall_s, abs=1e-9)
    assert set(g.losses) == set(LOSSES) and all(v >= 0 for v in g.losses.values())


def test_a_job_without_incidents_is_start_up_steps_and_shutdown() -> None:
    steps = ledger(*((s, 10.0 + s) for s in range(1, 11)))  # step 1 done at 11 s, one a second
    g = account(steps, [], [], start=0.0, end=22.0, ended=True)
    adds_up(g)
    assert g.losses["startup"] == pytest.approx(11.0)  # to the first completed step, which warms up
    assert g.goodput_s == pytest.approx(9.0) and g.losses["shutdown"] == pytest.approx(2.0)
    assert g.ratio == pytest.approx(9.0 / 22.0)
    running = account(steps, [], [], start=0.0, end=20.5, ended=False)
    assert running.losses["in_flight"] == pytest.approx(0.5) and running.losses["shutdown"] == 0


def test_a_checkpoint_stall_is_taken_from_the_step_after_the_save() -> None:
    steps = ledger(*((s, float(s)) for s in range(1, 11)))
    g = account(steps, [], [Stall(step=5, t=7.0, seconds=0.25)], start=0.0, end=10.0, ended=True)
    adds_up(g)
    assert g.losses["checkpoint"] == pytest.approx(0.25) and g.goodput_s == pytest.approx(9.0 - 0.25)


def test_a_crash_is_cut_into_lost_work_detection_recovery_and_the_wait_for_a_replacement() -> None:
    # Step 5 done at 5.0; the fault at 5.4 in step 6; detected 5.5, decided 5.6, replacement ready 7.0,
    # state restored 7.2, step 6 (re-run) done 7.6 = first_step_done; then a step a second.
    done = [(s, float(s)) for s in range(1, 6)] + [(6, 7.6)] + [(s, 7.6 + s - 6) for s in range(7, 10)]
    incident = crash(1, 5.4, detected=5.5, decided=5.6, replacement_ready=7.0, group_rebuilt=7.1,
                     state_restored=7.2, first_step_done=7.6)
    g = account(ledger(*done), [incident], [], start=0.0, end=11.0, ended=True)
    adds_up(g)
    assert g.losses["rerun"] == pytest.approx(0.4)  # step 6's first attempt, 5.0 to the fault
    assert g.losses["detection"] == pytest.approx(0.1)
    assert g.losses["spare_wait"] == pytest.approx(1.4)
    assert g.losses["recovery"] == pytest.approx(0.1 + 0.2)
    assert g.goodput_s == pytest.approx(4.0 + 0.4 + 3.0)  # steps 2-5, step 6's counted run, steps 7-9
    (cost,) = g.incidents
    assert cost == {"id": 1, "kind": "crash", "rerun_s": 0.4, "detection_s": 0.1, "recovery_s": 0.3,
                    "spare_wait_s": 1.4}


def test_steps_rolled_back_to_a_checkpoint_are_re_run_work_of_the_incident() -> None:
    # Steps 1-6 done; a crash at 6.5 rolls back to step 4: steps 5 and 6 run again (done 9, 10).
    done = [(s, float(s)) for s in range(1, 7)] + [(5, 9.0), (6, 10.0)]
    incident = crash(1, 6.5, detected=6.6, decided=6.7, state_restored=8.0, first_step_done=9.0)
    steps = ledger(*done)
    assert [(s, a, b) for s, a, b, _ in steps.superseded] == [(5, 4.0, 5.0), (6, 5.0, 6.0)]
    g = account(steps, [incident], [], start=0.0, end=10.0, ended=True)
    adds_up(g)
    assert g.losses["rerun"] == pytest.approx(2.0 + 0.5)  # two steps thrown away, and the half step in flight
    assert g.goodput_s == pytest.approx(3.0 + 1.0 + 1.0)  # steps 2-4, then 5 and 6 once more
    assert g.incidents[0]["rerun_s"] == pytest.approx(2.5)


def test_an_open_incident_of_a_running_job_runs_to_now() -> None:
    steps = ledger((1, 1.0), (2, 2.0))
    incident = dict(crash(1, 2.5, detected=2.6, decided=2.7), status="open")
    g = account(steps, [incident], [], start=0.0, end=4.0, ended=False)
    adds_up(g)
    assert g.losses["spare_wait"] == pytest.approx(1.3)  # waiting for the replacement it was decided to spawn
    assert g.losses["in_flight"] == 0.0


def test_two_incidents_of_one_recovery_count_each_moment_once() -> None:
    done = [(1, 1.0), (2, 2.0), (3, 6.0)]
    first = crash(1, 2.2, detected=2.3, decided=2.4, replacement_ready=4.0, state_restored=5.0, first_step_done=6.0)
    second = crash(2, 3.0, detected=3.1, decided=3.2, replacement_ready=4.5, state_restored=5.0, first_step_done=6.0)
    g = account(ledger(*done), [first, second], [], start=0.0, end=6.0, ended=True)
    adds_up(g)
    assert g.losses["spare_wait"] == pytest.approx(1.6)  # the first's wait; the second's lies inside it
    assert g.losses["recovery"] == pytest.approx(0.1 + 1.0 + 0.0)


def test_observed_incidents_cost_nothing_and_a_preemption_runs_to_the_exit() -> None:
    slow = {"id": 1, "kind": "slow_rank", "status": "observed", "fault_t": 2.0, "phases": {"detected": 0.5}}
    preempt = {"id": 2, "kind": "preempt", "status": "open", "fault_t": 4.2, "phases": {"exited": 1.0}}
    g = account(ledger(*((s, float(s)) for s in range(1, 5))), [slow, preempt], [], start=0.0, end=5.5,
                ended=True)
    adds_up(g)
    assert g.losses["preemption"] == pytest.approx(1.0) and g.losses["shutdown"] == pytest.approx(0.5)
    assert g.goodput_s == pytest.approx(3.0)


def test_a_job_with_no_completed_step_is_all_start_up() -> None:
    g = account(StepLedger(), [], [], start=10.0, end=12.0, ended=False)
    adds_up(g)
    assert g.losses["startup"] == pytest.approx(2.0) and g.goodput_s == 0 and g.ratio == 0
    assert account(StepLedger(), [], [], start=5.0, end=5.0, ended=True).ratio is None


def test_a_clock_that_steps_back_is_taken_as_equal() -> None:
    steps = ledger((1, 1.0), (2, 3.0), (3, 2.5), (4, 4.0))  # another host's clock a little behind
    g = account(steps, [], [], start=0.0, end=4.0, ended=True)
    adds_up(g)
    assert g.goodput_s == pytest.approx(3.0)


def test_a_resumed_job_starts_its_ledger_at_the_resumed_step_and_a_step_before_it_fits() -> None:
    steps = ledger((501, 1.0), (502, 2.0), (503, 3.0), (502, 5.0))  # resumed at 500; 502 re-run
    assert [(s, a, b) for s, a, b, _ in steps.superseded] == [(502, 1.0, 2.0)]
    steps.done(499, 6.0)  # (never expected, but a step before the first one seen has a place too)
    steps.done(499, 7.0)
    assert steps.superseded[-1][:3] == (499, 5.0, 6.0)
    assert steps.execution_before(502, 4.0) == 2.0 and steps.execution_before(502, 9.0) == 5.0


def test_older_stalls_given_as_their_sum_are_taken_from_the_steps_that_count() -> None:
    steps = ledger(*((s, float(s)) for s in range(1, 11)))
    g = account(steps, [], [Stall(8, 8.5, 0.1)], start=0.0, end=10.0, ended=True, folded_stall_s=0.3)
    adds_up(g)
    assert g.losses["checkpoint"] == pytest.approx(0.4) and g.goodput_s == pytest.approx(9.0 - 0.4)


def test_a_regroup_recovers_until_its_last_milestone_and_one_without_any_until_its_first_step() -> None:
    done = [(1, 1.0), (2, 2.0), (3, 9.0), (4, 10.0)]
    regroup = dict(crash(1, 2.5, detected=2.6, decided=3.0, checkpoint_written=4.0, first_step_done=9.0),
                   kind="node-loss", action="regroup")
    g = account(ledger(*done), [regroup], [], start=0.0, end=10.0, ended=True)
    adds_up(g)
    assert g.losses["recovery"] == pytest.approx(0.4 + 1.0)  # decided, then to the checkpoint written
    assert g.goodput_s == pytest.approx(1.0 + 5.0 + 1.0)  # (the new world's start to its first step counts)
    bare = crash(1, 2.5, detected=2.6, decided=3.0, first_step_done=9.0)
    g = account(ledger(*done), [bare], [], start=0.0, end=10.0, ended=True)
    adds_up(g)
    assert g.losses["recovery"] == pytest.approx(0.4 + 6.0) and g.goodput_s == pytest.approx(2.0)


def test_a_regroups_save_is_recovery_and_its_wait_for_the_new_worlds_processes_is_the_wait() -> None:
    done = [(1, 1.0), (2, 2.0), (3, 9.0)]
    regroup = dict(crash(1, 2.5, detected=2.6, decided=3.0, checkpoint_written=4.0, replacement_ready=7.0,
                         group_rebuilt=7.5, state_restored=8.0, first_step_done=9.0), kind="node-loss")
    g = account(ledger(*done), [regroup], [], start=0.0, end=9.0, ended=True)
    adds_up(g)
    assert g.losses["recovery"] == pytest.approx(0.4 + 1.0 + 1.0)
    assert g.losses["spare_wait"] == pytest.approx(3.0) and g.goodput_s == pytest.approx(1.0 + 1.0)
