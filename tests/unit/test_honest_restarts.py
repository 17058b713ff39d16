"""Honest restarts: a start-up error every rank raises the same way twice in a row ends the job at once,
quoting the exception, whatever --max-restarts says; a flaky start gets its restarts; a failed job's reason
quotes its first failure.

The rule (policy.certain_start) alone on tables of cases, then a real Manager fed the exits its agent reports
and the error files the ranks' processes leave (tests/integration/test_honest_restarts.py runs the processes).
"""

from __future__ import annotations

import asyncio
import json
import time
from itertools import count
from pathlib import Path

import pytest

from tests.unit.live_manager import starting
from undying.config import ERROR_FILE, worker_dir
from undying.jobfiles.records import Incident, IncidentStatus, JobState, quote_first_failure
from undying.manager.manager import Manager
from undying.manager.recovery import Action, PolicyContext, decide

_ids = count(1)
NO_DATA = "FileNotFoundError: [Errno 2] No such file or directory: '/data/shard-3'"


def failure(rank: int, raised: str = NO_DATA, *, startup: bool = True, kind: str = "crash", step: int = 1,
            action: str = "") -> Incident:
    incident = Incident(id=next(_ids), kind=kind, rank=rank, step=step, fault_t=1.0, recovery=1, action=action,
                        error=f"exited with code 1: {raised}" if raised else "exited with code 1")
    if raised:
        incident.detail.update({"raised": raised, "startup": startup})
    return incident


def whole_group(last: dict[int, str], this: dict[int, str], *, restarts: int = 1,
                max_restarts: int = 10) -> PolicyContext:
    return PolicyContext(max_restarts, 0, step_api=False, world_size=2, restarts=restarts, last_start=last,
                         this_start=this)


# --- the rule, without the step API (whole-group restarts) ---------------------------------------------------

def test_every_rank_raising_the_same_error_twice_ends_the_job_whatever_max_restarts_says() -> None:
    d = decide(failure(0), [], whole_group({0: NO_DATA, 1: NO_DATA}, {}, max_restarts=10))
    assert d.action is Action.FAIL
    assert d.reason.startswith(f"every rank raised the same error, twice in a row: {NO_DATA}; "), d.reason
    assert "whatever --max-restarts says" in d.reason


def test_the_first_start_that_fails_is_restarted() -> None:
    assert decide(failure(0), [], whole_group({}, {1: NO_DATA}, restarts=0)).action is Action.RESTART


@pytest.mark.parametrize(("last", "this", "why"), [
    ({0: NO_DATA, 1: ""}, {1: ""}, "one rank only: rank 1 never raised (killed at rank 0's exit)"),
    ({0: NO_DATA, 1: "RuntimeError: port 29500 in use"}, {}, "rank 1 raised another error"),
    ({0: "RuntimeError: NCCL timeout", 1: "RuntimeError: NCCL timeout"}, {1: NO_DATA}, "rank 0 raised another error before"),
    ({1: NO_DATA}, {1: NO_DATA}, "rank 0's own previous process raised nothing"),
])
def test_a_flaky_start_gets_its_restarts(last: dict[int, str], this: dict[int, str], why: str) -> None:
    assert decide(failure(0), [], whole_group(last, this)).action is Action.RESTART, why


def test_a_rank_whose_process_died_before_it_raised_counts_by_what_it_raised_this_time() -> None:
    """Rank 1 of the attempt before was killed at rank 0's exit before it raised; this time it raised it too."""
    d = decide(failure(0), [], whole_group({0: NO_DATA, 1: ""}, {1: NO_DATA}))
    assert d.action is Action.FAIL and NO_DATA in d.reason


def test_numbers_in_the_words_do_not_make_another_error() -> None:
    """Each rank says its own rank, pid or port: the same error all the same."""
    d = decide(failure(0, "ValueError: rank 0 found no data in shard 0"), [],
               whole_group({0: "ValueError: rank 0 found no data in shard 0",
                            1: "ValueError: rank 1 found no data in shard 1"}, {}))
    assert d.action is Action.FAIL and "ValueError: rank 0 found no data in shard 0" in d.reason


def test_an_exit_with_no_exception_is_never_certain() -> None:
    """A SIGKILL (out of memory) or an exit code alone: bad luck as far as anyone can tell."""
    assert decide(failure(0, ""), [], whole_group({0: "", 1: ""}, {})).action is Action.RESTART


def test_the_limit_still_ends_a_flaky_start_quoting_its_exception() -> None:
    d = decide(failure(0), [], whole_group({0: NO_DATA, 1: ""}, {}, restarts=3, max_restarts=3))
    assert d.action is Action.FAIL and NO_DATA in d.reason and "(--max-restarts 3)" in d.reason


# --- the rule, with the step API (each rank's fault is an incident) --------------------------------------------

def step_api(holders: int, *, trained: bool = False, restarts: int = 0) -> PolicyContext:
    return PolicyContext(10, holders, world_size=2, trained=trained, restarts=restarts)


def test_with_the_step_api_every_rank_raising_twice_before_its_first_step_ends_the_job() -> None:
    history = [failure(0, action="replace"), failure(1, action="restart")]
    now = failure(0)
    d = decide(now, [*history, now], step_api(1))
    assert d.action is Action.FAIL
    assert f"every rank raised the same error before it committed a step, twice in a row: {NO_DATA}" in d.reason


@pytest.mark.parametrize(("history", "why"), [
    ([failure(0, action="replace")], "one rank only: rank 1 never failed"),
    ([failure(0, action="replace"), failure(1, "RuntimeError: port in use", action="restart")], "rank 1 raised another error"),
    ([failure(0, startup=False, step=40, action="replace"), failure(1, action="restart")],
     "rank 0's process before this one had committed steps"),
    ([failure(0, action="replace"), failure(1, action="restart"), failure(0, "", kind="hang", action="replace")],
     "rank 0's latest fault before this one was another (in a row, not once upon a time)"),
])
def test_with_the_step_api_a_flaky_start_gets_its_restarts(history: list[Incident], why: str) -> None:
    now = failure(0)
    assert decide(now, [*history, now], step_api(1)).action is Action.REPLACE, why


def test_a_failure_after_the_first_commit_is_no_start_up_one() -> None:
    history = [failure(0, startup=False, step=40, action="replace"), failure(1, startup=False, step=40, action="replace")]
    now = failure(0, startup=False, step=40)
    d = decide(now, [*history, now], PolicyContext(10, 1, world_size=2, max_step_recoveries=3))
    assert d.action is Action.REPLACE  # the same fault at the same step has --max-step-recoveries


def test_every_rank_lost_before_the_first_step_starts_again_from_the_beginning() -> None:
    """Nothing trained and no checkpoint: a start of every rank loses nothing (it used to fail the job)."""
    now = failure(1, "RuntimeError: port in use")
    d = decide(now, [failure(0, action="replace"), now], step_api(0))
    assert d.action is Action.RESTART and "restart 1 of at most 10" in d.reason
    d = decide(now, [failure(0, action="replace"), now], step_api(0, restarts=10))
    assert d.action is Action.FAIL and "RuntimeError: port in use" in d.reason and "(--max-restarts 10)" in d.reason
    d = decide(now, [failure(0, action="replace"), now], step_api(0, trained=True))
    assert d.action is Action.FAIL and "no valid checkpoint to restart from" in d.reason


# --- the failed job's reason ----------------------------------------------------------------------------------

def test_a_failed_jobs_reason_quotes_its_first_failure() -> None:
    first = failure(1, "RuntimeError: CUDA error: an illegal memory access was encountered", step=7)
    later = failure(0, "", kind="hang", step=9)
    reason = "recovery 2 did not complete within 120s\nrank 1:\nTraceback ..."
    quoted = quote_first_failure(reason, [first, later])
    assert quoted == ("recovery 2 did not complete within 120s; first failure: crash of rank 1: "
                      "RuntimeError: CUDA error: an illegal memory access was encountered\nrank 1:\nTraceback ...")
    said = f"rank 1 exited (exited with code 1: {NO_DATA}); the whole group was already restarted"
    assert quote_first_failure(said, [failure(1)]) == said, "already quoted: said once"
    assert quote_first_failure(said, [failure(0, NO_DATA.replace("3", "0"))]) == said, "numbers aside"
    assert quote_first_failure("a bad checkpoint dir", []) == "a bad checkpoint dir"


# --- a real manager ---------------------------------------------------------------------------------------------

def leave_error(manager: Manager, rank: int, raised: str) -> None:
    """The rank's current process raised ``raised``: torchrun's error file, as the worker's boot writes it."""
    folder = Path(worker_dir(manager.core.config.job_dir, rank, manager.ranks[rank].incarnation))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ERROR_FILE).write_text(json.dumps({"message": {"message": raised, "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n  File \"train.py\", line 3\n{raised}\n",
        "timestamp": "0"}}}))


def exit_with(manager: Manager, rank: int, raised: str | None) -> int:
    """The rank's process leaves ``raised`` (None: nothing) and exits 1; its pid."""
    if raised is not None:
        leave_error(manager, rank, raised)
    pid = manager.ranks[rank].pid
    manager.on_exit(rank, pid, 1, time.time())
    return pid


def test_a_torchrun_script_whose_ranks_raise_at_start_ends_after_two_starts(tmp_path: Path) -> None:
    async def job() -> None:
        manager, agent = starting(tmp_path, step_api=False, max_restarts=10)
        try:
            leave_error(manager, 1, NO_DATA)  # rank 1 raised too; the restart kills it
            first = manager.ranks[1].pid
            exit_with(manager, 0, NO_DATA)
            assert manager.state is JobState.RUNNING and manager.recoveries.restarts == 1
            assert len(agent.spawned) == 4 and agent.killed == [1]
            manager.on_exit(1, first, -9, time.time())  # the first start's rank 1, killed: old news
            leave_error(manager, 1, NO_DATA)
            exit_with(manager, 0, NO_DATA)
            assert manager.state is JobState.STOPPING and manager.recoveries.restarts == 1, manager.exit_reason
            assert len(agent.spawned) == 4, "no third start"
            head = manager.exit_reason.splitlines()[0]
            assert head.startswith(f"every rank raised the same error, twice in a row: {NO_DATA}; "), head
            assert "rank 0:\nTraceback (most recent call last)" in manager.exit_reason  # the traceback, below
            assert [i.status for i in manager.incidents] == [IncidentStatus.RECOVERED, IncidentStatus.FAILED]
            assert manager.incidents[1].detail["raised"] == NO_DATA and manager.incidents[1].detail["startup"]
        finally:
            manager.close()

    asyncio.run(job())


def test_a_torchrun_script_whose_one_rank_fails_at_start_gets_every_restart(tmp_path: Path) -> None:
    async def job() -> None:
        manager, agent = starting(tmp_path, step_api=False, max_restarts=2)
        try:
            for _ in range(2):
                exit_with(manager, 0, NO_DATA)  # rank 1 waits for it, raises nothing, is killed
                assert manager.state is JobState.RUNNING
            exit_with(manager, 0, NO_DATA)
            assert manager.recoveries.restarts == 2 and len(agent.spawned) == 6
            head = manager.exit_reason.splitlines()[0]
            assert f"rank 0 exited (exited with code 1: {NO_DATA})" in head and "(--max-restarts 2)" in head, head
        finally:
            manager.close()

    asyncio.run(job())


def test_a_step_api_script_whose_ranks_raise_before_their_first_step_ends_after_two_starts(tmp_path: Path) -> None:
    async def job() -> None:
        manager, agent = starting(tmp_path, step_api=True, max_restarts=10)
        try:
            exit_with(manager, 0, NO_DATA)
            assert [i.action for i in manager.incidents] == ["replace"]  # rank 1 may hold the state
            exit_with(manager, 1, NO_DATA)
            assert [i.action for i in manager.incidents] == ["replace", "restart"], manager.exit_reason
            assert manager.state is JobState.RUNNING and len(agent.spawned) == 5  # 2, the replacement, 2 again
            exit_with(manager, 1, NO_DATA)
            assert manager.state is JobState.STOPPING, [i.detail.get("reason") for i in manager.incidents]
            assert manager.exit_reason.startswith(
                f"every rank raised the same error before it committed a step, twice in a row: {NO_DATA}")
        finally:
            manager.close()

    asyncio.run(job())
