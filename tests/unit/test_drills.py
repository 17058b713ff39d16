"""Drills that tell the truth: a fault that could never fire as asked is refused, in one line.

Real Managers (tests/unit/live_manager.py, and tests/unit/test_http_auth.py's ``Served`` for the
HTTP API and the ``undying inject`` command); only the node's agent is a recorder. Refused: a step
the rank already committed (it would fire late, at the next step), a step past the job's end, a
rank that ran its last step, and any armed fault in a script without the step API. A valid drill
is still armed, at the step asked.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from tests.unit.live_manager import FakeAgent, running
from tests.unit.test_http_auth import JOB, Served, bearer, raw
from undying.cli.main import main
from undying.config import JobConfig
from undying.errors import ConflictError, UsageError
from undying.jobfiles.events import EventLog, LogReader
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.tokens import TOKEN_ENV, TOKEN_FILE
from undying.manager.manager import Manager
from undying.protocol.worker_wire import Done, Progress, StepCommitted

LAST = 10  # the job's last step, as rank 0's plan says


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands find the token in the job dir (or --token-file), not in this shell's env."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _plan(manager: Manager, total: int = LAST) -> None:
    manager.on_message(Progress(0, 0, "steps_planned", 5.0, step=4, detail={"total_steps": total}))


def _armed_events(manager: Manager) -> list[dict[str, Any]]:
    manager.events.flush()
    with LogReader(manager.events.path) as log:
        return [dict(e.data, rank=e.rank) for e in log.events("fault_armed")]


@pytest.fixture
def planned(tmp_path: Path) -> Any:
    """A job of 2 ranks at step 4 of 10."""
    manager, agent = running(tmp_path)
    _plan(manager)
    yield manager, agent
    manager.close()


# kind, at_step, phase, how, factor -> the words of the refusal (ranks at step 4 of 10)
REFUSED = [
    (("crash", 2, None, None, None), "step 2 has passed: rank 1 committed step 4; pick a later step (up to 10)"),
    (("crash", 4, "forward", None, None), "step 4 has passed"),  # the step just committed
    (("comm-error", 3, "backward", None, None), "step 3 has passed"),
    (("leave", 1, "optimizer", None, None), "step 1 has passed"),
    (("hang", 2, None, "spin", None), "step 2 has passed"),
    (("slow", 3, "compute", None, 1.5), "step 3 has passed"),
    (("nan", 2, None, "once", None), "step 2 has passed"),  # the numeric drills: manager.integrity
    (("bitflip", 4, None, "param", None), "step 4 has passed"),
    (("crash", 11, None, None, None), "step 11 is past the job's end: its last step is 10; pick a step from 5 to 10"),
    (("crash", 99, "recovery", None, None), "step 99 is past the job's end"),  # an event's phase too
    (("nan", 11, None, "persistent", None), "step 11 is past the job's end"),
]


@pytest.mark.parametrize(("call", "words"), REFUSED, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c, _ in REFUSED])
def test_a_drill_that_would_never_fire_as_asked_is_refused_and_arms_nothing(
        planned: tuple[Manager, FakeAgent], call: tuple[Any, ...], words: str) -> None:
    manager, agent = planned
    kind, at_step, phase, how, factor = call
    with pytest.raises(ConflictError, match=words.replace("(", r"\(").replace(")", r"\)")) as refused:
        manager.inject(kind, 1, at_step, phase, how, factor=factor)
    assert "\n" not in str(refused.value)
    assert agent.armed == [] and agent.killed == [] and _armed_events(manager) == []


def test_a_valid_drill_is_still_armed_at_the_step_asked(planned: tuple[Manager, FakeAgent]) -> None:
    manager, agent = planned
    answers = [
        manager.inject("crash", 1, 5, None),  # the rank's next step
        manager.inject("crash", 0, LAST, "backward"),  # the job's last
        manager.inject("comm-error", 1, None, None),  # no step: the next one
        manager.inject("slow", 0, 7, "data", factor=1.5),
        manager.inject("nan", 1, 6, None, "once"),
        # an event's phase takes its step as "not before": passed, it means the next such event
        manager.inject("crash", 1, 2, "recovery"),
    ]
    assert [(a["at_step"], a["phase"]) for a in answers] == [
        (5, "step"), (LAST, "backward"), (5, "step"), (7, "data"), (6, "backward"), (2, "recovery")]
    assert agent.armed == [(1, "crash"), (0, "crash"), (1, "comm-error"), (0, "slow"), (1, "nan:once"),
                           (1, "crash")]
    assert [(e["rank"], e["at_step"]) for e in _armed_events(manager)] == [
        (1, 5), (0, LAST), (1, 5), (0, 7), (1, 6), (1, 2)]
    assert manager.inject("crash", 1, None, None)["when"] == "now" and agent.killed == [1]


def test_a_rank_past_its_last_step_has_nothing_left_to_inject_into(planned: tuple[Manager, FakeAgent]) -> None:
    manager, agent = planned
    for step in range(5, LAST + 1):
        manager.on_message(StepCommitted(1, 0, step, 5.0 + step, {"loss": 1.0}))
    for call in (("comm-error", None, None), ("crash", LAST, "recovery")):
        with pytest.raises(ConflictError, match=r"rank 1 has run its last step \(10\); nothing is left"):
            manager.inject(call[0], 1, call[1], call[2])
    manager.on_message(Done(1, LAST, "d", 20.0))
    with pytest.raises(ConflictError, match=r"rank 1 has run its last step \(10\)"):
        manager.inject("crash", 1, None, None)  # now: its process has ended for good, not "try again"
    assert agent.armed == [] and agent.killed == []
    assert manager.inject("crash", 0, 6, None)["at_step"] == 6  # rank 0 still has steps


def test_a_script_without_the_step_api_has_no_steps_to_fault_at(tmp_path: Path) -> None:
    manager = Manager(JobConfig(job_id="plain", job_dir=str(tmp_path), nproc_per_node=2, port=0, step_api=False),
                      EventLog(tmp_path / "e.db"))
    try:
        manager.start_control_store(os.urandom(32))
        agent = FakeAgent()
        manager.add_agent(cast(Any, agent))
        record = manager.core.open_generation("start")
        for rank in (0, 1):
            manager.core.spawn(rank, record, joining=False)  # (a torchrun-style script: no hello, no steps)
        for kind, at_step, phase, how, where in (("crash", 3, None, None, "crash at step 3"),
                                                 ("comm-error", None, None, None, "comm-error at its next step"),
                                                 ("crash", None, "forward", None, "crash at phase forward"),
                                                 ("hang", None, None, "block", "hang:block at its next step"),
                                                 ("nan", 5, None, None, "nan at step 5")):
            with pytest.raises(ConflictError) as refused:
                manager.inject(kind, 1, at_step, phase, how)
            assert str(refused.value) == (
                f"job plain's script does not use the step API (job.steps), so it has no steps: {where} would "
                "never fire; inject crash or hang now (no --at-step, no --phase)")
        assert agent.armed == []
        assert manager.inject("crash", 1, None, None)["when"] == "now" and agent.killed == [1]  # a signal reaches it
    finally:
        manager.close()


def test_a_drill_armed_before_the_plan_is_told_when_the_plan_says_it_never_fires(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager, agent = running(tmp_path)
    try:
        # No plan yet (rank 0's loop has not said how long the job is): armed, as asked.
        assert manager.inject("crash", 1, 50, None)["at_step"] == 50
        assert manager.inject("crash", 0, 8, None)["at_step"] == 8
        with caplog.at_level(logging.WARNING):
            _plan(manager)
        manager.events.flush()
        with LogReader(manager.events.path) as log:
            told = [(e.rank, e.data["kind"], e.data["at_step"], e.data["last_step"])
                    for e in log.events("fault_unreachable")]
        assert told == [(1, "crash", 50, LAST)]  # step 8 fires: nothing said of it
        assert "the crash armed for rank 1 at step 50 will never fire: the job's last step is 10" in caplog.text
        with pytest.raises(ConflictError, match="past the job's end"):  # and from now on, refused
            manager.inject("crash", 1, 50, None)
    finally:
        manager.close()


# --- through the HTTP API and `undying inject` ----------------------------------------------------------


def _at_step_4_of_10(served: Served) -> None:
    manager = served.manager

    async def commit() -> None:
        for rank in (0, 1):
            for step in range(1, 5):
                manager.on_message(StepCommitted(rank, 0, step, 1.0 + step, {"loss": 1.0}))
        _plan(manager)

    served.call(commit)


def test_the_api_answers_409_with_the_reason_and_the_command_one_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    served = Served(tmp_path)
    try:
        _at_step_4_of_10(served)
        before = {k: v for k, v in served.snapshot().items() if k in ("events", "agent")}
        headers = {"Content-Type": "application/json", **bearer(served.token)}
        code, answer = raw(served.url + "/api/inject", "POST", b'{"rank": 1, "at_step": 2}', headers)
        assert code == 409 and isinstance(answer, dict)
        assert answer["error"].startswith("step 2 has passed: rank 1 committed step 4")
        code, answer = raw(served.url + "/api/inject", "POST", b'{"rank": 1, "at_step": 0}', headers)
        assert code == 400  # a bad field stays 400
        token_file = str(tmp_path / TOKEN_FILE)
        for at_step, words in (("2", "step 2 has passed"), ("11", "its last step is 10")):
            rc = main(["inject", "crash", "--rank", "1", "--at-step", at_step, "--manager", served.url,
                       "--token-file", token_file])
            out, err = capsys.readouterr()
            assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
            assert err.startswith("undying: error: ") and words in err
        after = {k: v for k, v in served.snapshot().items() if k in ("events", "agent")}
        assert after == before  # refused: nothing armed, nothing logged
        assert main(["inject", "crash", "--rank", "1", "--at-step", "6", "--manager", served.url,
                     "--token-file", token_file]) == 0
        assert capsys.readouterr().out.startswith("armed: crash of rank 1 ")
        assert ("arm", 1, "crash", 6) in served.agent.calls
    finally:
        served.close()


def test_wait_arms_a_drill_on_a_job_that_comes_up_after_the_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_dir = tmp_path / "job"  # not made yet: the launcher makes it
    started: list[Served] = []

    def launch() -> None:
        time.sleep(0.5)  # (the command is waiting by then; it waits up to 60 s either way)
        job_dir.mkdir()
        served = Served(job_dir)
        started.append(served)
        JobDir(job_dir).write_manager({"url": served.url, "pid": os.getpid(), "job_id": JOB})

    launcher = threading.Thread(target=launch)
    launcher.start()
    try:
        rc = main(["inject", "crash", "--rank", "1", "--at-step", "3", "--wait", "60", "--job-dir", str(job_dir)])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert out == "armed: crash of rank 1 at step 3, phase step\n"  # no pid: its process is still to come
        assert ("arm", 1, "crash", 3) in started[0].agent.calls
    finally:
        launcher.join()
        for served in started:
            served.close()


@pytest.mark.parametrize(("argv", "words"), [
    (["--wait", "5"], "--wait needs --job-dir or --manager"),
    (["--wait", "-1", "--job-dir", "x"], "--wait must be between 0 and 3600 seconds, got -1"),
    (["--wait", "nan", "--job-dir", "x"], "--wait"),
])
def test_bad_waits_are_refused_by_name(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    assert main(["inject", "crash", "--rank", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err, err


@pytest.mark.parametrize("where", ["--job-dir", "--manager"])
def test_a_wait_that_sees_no_job_come_up_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 where: str) -> None:
    if where == "--job-dir":
        job = str(tmp_path / "never")
    else:  # an address where nothing listens
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            job = f"127.0.0.1:{s.getsockname()[1]}"
    assert main(["inject", "crash", "--rank", "0", "--wait", "0.3", where, job]) == 2
    err = capsys.readouterr().err
    assert f"no job came up in 0.3 s at {job}" in err and len(err.strip().splitlines()) == 1, err


def test_a_conflict_is_a_usage_error() -> None:
    """Every command that catches UsageError (exit 2, one line) catches the refusal too."""
    assert issubclass(ConflictError, UsageError)
