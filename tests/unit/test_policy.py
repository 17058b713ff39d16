"""The recovery policy: replace crashes, retry comm errors, stop on a fault that repeats."""

from __future__ import annotations

import pytest

from undying.jobfiles.records import Incident
from undying.manager.recovery import Action, PolicyContext, decide, policy
from undying.protocol.node_wire import RankProgress

_ids = iter(range(1, 10**6))


def incident(kind: str = "crash", rank: int = 1, step: int = 5, action: str = "") -> Incident:
    return Incident(id=next(_ids), kind=kind, rank=rank, step=step, fault_t=100.0, recovery=1, action=action)


def ctx(max_restarts: int = 3, holders_alive: int = 3) -> PolicyContext:
    return PolicyContext(max_restarts=max_restarts, holders_alive=holders_alive)


def test_a_crash_is_replaced() -> None:
    d = decide(incident("crash", rank=2), [], ctx())
    assert d.action is Action.REPLACE
    assert "rank 2" in d.reason


def test_a_comm_error_is_retried() -> None:
    assert decide(incident("comm-error"), [], ctx()).action is Action.RETRY


def test_a_user_error_is_replaced_the_first_time() -> None:
    # A bug that happens once may be a bad input; it stops the job once it repeats.
    assert decide(incident("error"), [], ctx()).action is Action.REPLACE


@pytest.mark.parametrize("max_restarts", [1, 2, 3, 5])
@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_a_repeating_comm_error_climbs_the_ladder(max_restarts: int, max_retries: int) -> None:
    """Retry max_retries times, then replace the rank max_restarts times, then fail."""
    history: list[Incident] = []
    actions = []
    for _ in range(max_retries + max_restarts + 1):
        current = incident("comm-error")
        history.append(current)
        d = decide(current, history, PolicyContext(max_restarts, 3, max_retries))
        current.action = d.action.value
        actions.append(d.action)
    assert actions == [Action.RETRY] * max_retries + [Action.REPLACE] * max_restarts + [Action.FAIL]
    assert f"--max-step-recoveries {max_restarts}" in d.reason


def test_retries_of_other_steps_do_not_use_up_this_steps_retries() -> None:
    history = [incident("comm-error", step=s, action="retry") for s in (1, 2, 3, 4)]
    d = decide(incident("comm-error", step=5), history, PolicyContext(3, 3, max_retries=1))
    assert d.action is Action.RETRY


@pytest.mark.parametrize("max_restarts", [1, 2, 3, 5])
@pytest.mark.parametrize("kind", ["crash", "hang", "error"])
def test_fails_once_the_same_fault_repeated_max_restarts_times(max_restarts: int, kind: str) -> None:
    history: list[Incident] = []
    for n in range(max_restarts):
        current = incident(kind)
        history.append(current)
        d = decide(current, history, ctx(max_restarts))
        assert d.action is not Action.FAIL, f"failed after {n} recoveries"
        current.action = d.action.value
    current = incident(kind)
    history.append(current)
    d = decide(current, history, ctx(max_restarts))
    assert d.action is Action.FAIL
    assert "step 5" in d.reason and f"--max-step-recoveries {max_restarts}" in d.reason
    assert f"already recovered {max_restarts} time(s)" in d.reason
    assert ("raised" if kind == "error" else "failed") in d.reason


def test_with_max_restarts_zero_the_first_fault_fails() -> None:
    d = decide(incident(step=9), [], ctx(max_restarts=0))
    assert d.action is Action.FAIL
    assert "step 9" in d.reason and "--max-step-recoveries 0" in d.reason


@pytest.mark.parametrize(
    "other",
    [
        {"rank": 2, "step": 5},  # another rank at that step
        {"rank": 1, "step": 6},  # the same rank at another step
        {"rank": 1, "step": 4},
    ],
)
def test_faults_elsewhere_do_not_count_as_repeats(other: dict[str, int]) -> None:
    history = [incident(action="replace", **other) for _ in range(5)]
    assert decide(incident(rank=1, step=5), history, ctx(max_restarts=1)).action is Action.REPLACE


@pytest.mark.parametrize("action", ["", "fail"])
def test_only_recovered_incidents_count(action: str) -> None:
    history = [incident(action=action) for _ in range(5)]
    assert decide(incident(), history, ctx(max_restarts=1)).action is Action.REPLACE


def test_only_replacements_count_toward_max_restarts() -> None:
    """Retries have their own bound (--max-retries); a restart is a replaced process."""
    history = [incident(action="retry"), incident(action="replace")]
    assert decide(incident(), history, ctx(max_restarts=2)).action is Action.REPLACE
    assert decide(incident(), history, ctx(max_restarts=1)).action is Action.FAIL


def test_the_incident_itself_in_the_history_is_not_a_repeat() -> None:
    current = incident(action="replace")  # as if decided before and re-decided
    assert decide(current, [current], ctx(max_restarts=1)).action is Action.REPLACE


@pytest.mark.parametrize("kind", ["crash", "comm-error", "error"])
def test_fails_when_no_holder_of_the_state_is_alive(kind: str) -> None:
    d = decide(incident(kind), [], ctx(holders_alive=0))
    assert d.action is Action.FAIL
    assert "restart the job" in d.reason


def test_action_values_are_the_strings_stored_on_incidents() -> None:
    assert {a.value for a in Action} == {"retry", "replace", "restart", "fail"}


@pytest.mark.parametrize("kind", ["crash", "comm-error", "error", "hang"])
def test_restarts_from_the_checkpoint_when_no_holder_is_alive(kind: str) -> None:
    c = PolicyContext(max_restarts=2, holders_alive=0, checkpoint_step=40, restarts=0)
    d = decide(incident(kind), [], c)
    assert d.action is Action.RESTART
    assert "checkpoint of step 40" in d.reason and "every rank that held the training state is gone" in d.reason


def test_restarts_are_bounded_by_max_restarts() -> None:
    assert decide(incident(), [], PolicyContext(2, 0, checkpoint_step=5, restarts=1)).action is Action.RESTART
    d = decide(incident(), [], PolicyContext(2, 0, checkpoint_step=5, restarts=2))
    assert d.action is Action.FAIL and "--max-restarts 2" in d.reason


def test_a_checkpoint_does_not_change_the_rungs_below_restart() -> None:
    c = PolicyContext(max_restarts=3, holders_alive=2, checkpoint_step=10)
    assert decide(incident("crash"), [], c).action is Action.REPLACE
    assert decide(incident("comm-error"), [], c).action is Action.RETRY


def _progress(rank: int, collectives: int, *, phase: str = "step", generation: int = 2,
              progress_t: float = 100.0) -> RankProgress:
    return RankProgress(rank=rank, pid=1000 + rank, generation=generation, phase=phase, step=7,
                        collectives=collectives, progress_t=progress_t)


def stall_culprits(progress: list[RankProgress], now: float = 110.0) -> list[int] | None:
    """The rule with a 5 s limit, judged at ``now`` (the ranks' progress stopped at 100 unless said)."""
    return policy.stall_culprits(progress, 5.0, now)


def test_the_rank_that_never_entered_the_collective_is_the_culprit() -> None:
    assert stall_culprits([_progress(0, 18), _progress(1, 17), _progress(2, 18), _progress(3, 18)]) == [1]


def test_every_rank_that_lags_is_a_culprit() -> None:
    assert stall_culprits([_progress(0, 17), _progress(1, 18), _progress(2, 17)]) == [0, 2]


def test_a_rank_behind_that_still_moves_is_slow_not_stuck() -> None:
    """Rank 2 has not reached the collective either, but it moved 1 s ago (a loaded host): only rank 1,
    stuck since 100, is blamed; with no stuck rank behind, nobody is yet (None: judged on the next report)."""
    behind = _progress(2, 17, progress_t=109.0)
    assert stall_culprits([_progress(0, 18), _progress(1, 17), behind, _progress(3, 18)]) == [1]
    assert stall_culprits([_progress(0, 18), behind, _progress(3, 18)]) is None
    assert stall_culprits([_progress(0, 18), behind, _progress(3, 18)], now=120.0) == [2]  # and then it stopped


def test_every_rank_inside_the_same_collective_blames_no_rank() -> None:
    assert stall_culprits([_progress(r, 18) for r in range(4)]) == []


def test_ranks_not_running_steps_or_of_an_older_generation_do_not_count() -> None:
    progress = [_progress(0, 18), _progress(1, 18), _progress(2, 3, phase="recovery"),
                _progress(3, 1, generation=1)]
    assert stall_culprits(progress) == []


def test_a_job_of_one_rank_blames_that_rank() -> None:
    assert stall_culprits([_progress(0, 5)]) == [0]
    assert stall_culprits([_progress(0, 5, phase="init")]) == []


def recovery_stall(progress: list[RankProgress], now: float = 110.0, started: float = 98.0) -> list[int] | None:
    """A recovery into generation 2 begun at ``started``, judged at ``now`` with a 5 s limit."""
    return policy.recovery_stall(progress, 2, started, 5.0, now)


def test_a_recoverys_first_step_waiting_for_a_rank_still_starting_its_steps_blames_that_rank() -> None:
    """Rank 1, the replacement, restored its state and replays its loader (init): the others have waited
    in the step past the limit, so it is in a collective of its own (accelerate's rng synchronisation)."""
    progress = [_progress(0, 1), _progress(1, 1, phase="init"), _progress(2, 1)]
    assert recovery_stall(progress) == [1]
    assert recovery_stall(progress, now=104.0) is None, "within the limit: nothing yet"
    assert recovery_stall(progress, started=106.0) is None, "counted from the recovery's start at the earliest"
    replaying = [_progress(0, 1), _progress(1, 1, phase="init", progress_t=108.0), _progress(2, 1)]
    assert recovery_stall(replaying) is None, "a replacement still reading batches is slow, not stuck"
    assert recovery_stall(replaying, now=114.0) == [1], "and then it stopped"


def test_a_recovery_with_a_rank_still_restoring_is_left_to_the_recoverys_own_deadline() -> None:
    assert recovery_stall([_progress(0, 1), _progress(1, 0, phase="recovery")]) is None


def test_a_recoverys_first_step_is_judged_as_any_step_once_every_rank_is_in_it() -> None:
    assert recovery_stall([_progress(0, 2), _progress(1, 1)]) == [1]
    assert recovery_stall([_progress(0, 2), _progress(1, 2)]) == [], "one collective: the link"
    assert recovery_stall([_progress(0, 2), _progress(1, 1, generation=1)]) == [], "an old generation's rank is not the new one's"
    assert recovery_stall([_progress(0, 1, phase="init"), _progress(1, 1, phase="init")]) is None, "nobody waits in the step"


# --- a script that does not use the step API: torchrun's recovery, the whole group restarts ---------------


@pytest.mark.parametrize("kind", ["crash", "hang", "error", "comm-error", "node-loss"])
def test_without_the_step_api_every_fault_restarts_the_whole_group(kind: str) -> None:
    d = decide(incident(kind, rank=1), [], PolicyContext(max_restarts=2, holders_alive=3, step_api=False))
    assert d.action is Action.RESTART
    assert "whole-group restart 1 of at most 2" in d.reason and "does not use undying's step API" in d.reason


def test_without_the_step_api_restarts_are_bounded_by_max_restarts() -> None:
    assert decide(incident(), [], PolicyContext(2, 3, restarts=1, step_api=False)).action is Action.RESTART
    d = decide(incident(), [], PolicyContext(2, 3, restarts=2, step_api=False))
    assert d.action is Action.FAIL
    assert "restarted 2 time(s) (--max-restarts 2)" in d.reason


def test_without_the_step_api_a_script_error_still_fails_at_once() -> None:
    i = incident("script-error")
    i.error = "the training script could not run"
    assert decide(i, [], PolicyContext(3, 3, step_api=False)).action is Action.FAIL


def test_the_per_step_limit_has_its_own_name_and_bound() -> None:
    """--max-step-recoveries bounds recoveries at one step; --max-restarts the whole-group restarts."""
    history = [incident(action="replace")]
    c = PolicyContext(max_restarts=0, holders_alive=3, max_step_recoveries=2)
    assert decide(incident(), history, c).action is Action.REPLACE
    d = decide(incident(), history, PolicyContext(max_restarts=5, holders_alive=3, max_step_recoveries=1))
    assert d.action is Action.FAIL and "--max-step-recoveries 1" in d.reason
