"""``--verify-every``'s decisions alone (worker.verify_plan): when, whose step, what a verdict does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from undying.errors import UsageError
from undying.worker.numerics import Numerics
from undying.worker.verify_plan import (
    MAX_EVERY,
    Decision,
    Ledger,
    check_every,
    due,
    holder_of,
    suspect_of,
)


@pytest.mark.parametrize(("raw", "every"), [(1, 1), ("100", 100), (" 7 ", 7), (MAX_EVERY, MAX_EVERY)])
def test_a_good_k_is_taken(raw: object, every: int) -> None:
    assert check_every(raw) == every


@pytest.mark.parametrize(("raw", "said"), [
    (0, "must be from 1"), (-3, "must be from 1"), (MAX_EVERY + 1, "must be from 1"), ("ten", "'ten'"),
    ("1.5", "'1.5'"), (True, "True"), (None, "None"), (2.0, "2.0"),
])
def test_a_bad_k_is_answered_by_name(raw: object, said: str) -> None:
    with pytest.raises(UsageError, match="--verify-every") as caught:
        check_every(raw)
    assert said in str(caught.value)


def test_numerics_takes_verify_every_and_refuses_a_bad_one() -> None:
    assert Numerics(verify_every=10).verify_every == 10
    with pytest.raises(UsageError, match=r"Numerics\(verify_every=...\) must be from 1"):
        Numerics(verify_every=0)


@pytest.mark.parametrize(("every", "verified"), [(1, [1, 2, 3, 4, 5, 6]), (3, [3, 6]), (10, [])])
def test_due_steps_are_k_2k_3k(every: int, verified: list[int]) -> None:
    assert [s for s in range(0, 7) if due(s, every)] == verified


def test_every_rank_is_the_suspect_in_turn_and_never_its_own_holder() -> None:
    assert [suspect_of(s, 1, 4) for s in range(1, 9)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [suspect_of(s, 10, 3) for s in (10, 20, 30, 40)] == [0, 1, 2, 0]
    for world in (2, 3, 4, 8):
        assert all(holder_of(r, world) != r for r in range(world))
    assert holder_of(0, 1) == 0  # alone: the rank's own state (said in the docs)


def test_decision_travels_as_integers() -> None:
    decision = Decision(False, rollback_to=10, bad_step=11, bad_rank=2, round_no=1, source_round=0)
    assert Decision.decode(decision.encode()) == decision


def test_passing_verifications_move_the_last_verified_state() -> None:
    ledger = Ledger()
    assert ledger.decide(1, 0, []).issue
    assert ledger.decide(2, 1, [(1, True)]).issue
    assert (ledger.passed, ledger.pending) == (1, {2: 1})
    assert ledger.summary() == {"verified": 1, "passed": 1, "mismatched": 0, "skipped": 0, "not_done": 1,
                                "errors": 0}


def test_a_mismatch_rolls_back_to_the_newest_passed_step_and_starts_a_round() -> None:
    ledger = Ledger()
    for step in range(1, 6):
        ledger.decide(step, step % 4, [])
    decision = ledger.decide(6, 2, [(1, True), (2, True), (3, False), (4, True), (5, True)])
    # Step 3 differed: back to step 2's pre-step state (the last verified); 4 and 5 passed too late to count.
    assert decision == Decision(False, rollback_to=2, bad_step=3, bad_rank=3, round_no=1, source_round=0)
    assert ledger.pending == {} and ledger.passed == 2 and ledger.mismatched == 1


def test_a_mismatch_with_nothing_passed_rolls_back_to_the_failed_steps_own_pre_state() -> None:
    ledger = Ledger()
    ledger.decide(5, 0, [])
    decision = ledger.decide(10, 1, [(5, False)])
    assert (decision.rollback_to, decision.bad_step, decision.source_round) == (5, 5, 0)


def test_after_a_roll_back_the_old_rounds_verified_state_still_counts() -> None:
    ledger = Ledger()
    ledger.decide(2, 1, [])
    ledger.decide(3, 2, [])
    first = ledger.decide(4, 3, [(2, True), (3, False)])
    assert (first.rollback_to, first.round_no) == (2, 1)
    ledger.decide(2, 1, [])  # the re-run of step 2, in round 1
    again = ledger.decide(3, 2, [(2, False)])
    assert (again.rollback_to, again.source_round, again.round_no) == (2, 0, 2)  # round 0's file of step 2


def test_answers_to_steps_not_waiting_are_ignored_and_a_replay_error_is_no_verdict() -> None:
    ledger = Ledger()
    ledger.decide(1, 0, [])
    assert ledger.decide(2, 1, [(7, False), (1, None)]).issue  # 7 was never asked (an old round's answer)
    assert (ledger.errors, ledger.mismatched, ledger.passed) == (1, 0, 0)


def test_a_full_queue_skips_steps_and_says_overdue_never_blocks() -> None:
    ledger = Ledger(max_pending=2)
    assert ledger.decide(1, 0, []).issue and ledger.decide(2, 1, []).issue
    skipped = ledger.decide(3, 2, [])
    assert not skipped.issue and not skipped.rollback_to and ledger.overdue
    assert ledger.decide(4, 3, [(1, True)]).issue and not ledger.overdue  # caught up: verified again
    assert ledger.summary()["skipped"] == 1


def test_a_step_run_again_after_a_peers_fault_is_verified_once_more() -> None:
    ledger = Ledger()
    ledger.decide(4, 3, [])
    assert ledger.decide(4, 3, []).issue and ledger.pending == {4: 3}


def test_the_decisions_import_no_torch() -> None:
    probe = "import sys, undying.worker.verify_plan; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip() == "False"


@pytest.mark.parametrize(("value", "said"), [("0", "must be from 1 to"), ("ten", "got 'ten'")])
def test_undying_run_answers_a_bad_k_before_starting_anything(value: str, said: str, tmp_path: object) -> None:
    done = subprocess.run([sys.executable, "-m", "undying", "run", "-n", "1", "--verify-every", value, "train.py"],
                          capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert done.returncode == 2 and "--verify-every" in done.stderr and said in done.stderr, done.stderr
