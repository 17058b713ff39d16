"""Losing a Slurm job's first node (the manager's): the survivors' judgement, the requeue's
guard, and the restart count in the log and status (docs/slurm.md, "Losing the first node").

The whole path, on a real Slurm cluster, is tests/integration/test_slurm.py's
``test_losing_the_first_node_requeues_the_job_which_resumes_from_its_newest_checkpoint``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import stat
from pathlib import Path

import pytest
from rich.console import Console

from undying.agent.remote import ManagerLost, NodeRunner, run_node
from undying.cli.status_view import render
from undying.config import EXIT_PREEMPTED_BEHIND, JobConfig, Timeouts
from undying.jobfiles.events import EventLog
from undying.jobfiles.jobdir import JobDir
from undying.launch.manager_service import _resumable
from undying.launch.slurm import SlurmStep, slurm_facts
from undying.launch.slurm_node import manager_lost, manager_lost_after, requeue, run_slurm_node


def test_the_manager_is_judged_lost_after_two_heartbeat_windows_at_least_20s_at_most_the_rendezvous(
) -> None:
    assert manager_lost_after(Timeouts()) == 60.0  # heartbeat 30 s
    assert manager_lost_after(dataclasses.replace(Timeouts(), heartbeat_timeout=3.0)) == 20.0
    assert manager_lost_after(dataclasses.replace(Timeouts(), rendezvous_timeout=10.0)) == 10.0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_agent_whose_manager_stays_unreachable_raises_manager_lost_or_ends_1(
        tmp_path: Path) -> None:
    """Under Slurm (a bound given) an agent that had joined its manager raises ManagerLost once
    the manager stays unreachable past the bound, in words that name it and the bound. One that
    never joined waits the rendezvous timeout, as without a bound, and ends 1."""
    script = tmp_path / "t.py"
    script.write_text("print('never started')\n")
    manager = f"127.0.0.1:{_closed_port()}"
    config = JobConfig(job_id="j1", job_dir=str(tmp_path / "jd"), nnodes=2, node_rank=1)
    runner = NodeRunner(config, str(script), [], manager, "t" * 32, manager_lost_s=1.0)
    runner._joined = True  # (as after a join; then the manager went away)
    # (an agent's end sets the process's SIGHUP and SIGQUIT for its last lines: agent.hangup)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    try:
        with pytest.raises(ManagerLost,
                           match=rf"the manager at {manager} stayed unreachable for 1s"):
            asyncio.run(runner.run())
        config = dataclasses.replace(
            config, timeouts=dataclasses.replace(config.timeouts, rendezvous_timeout=1.0))
        assert run_node(config, str(script), [], manager, "t" * 32, manager_lost_s=600.0) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_slurm_s_job_and_restart_count_are_read_and_checked() -> None:
    assert slurm_facts({}) is None
    assert slurm_facts({"SLURM_JOB_ID": "x1"}) is None
    assert slurm_facts({"SLURM_JOB_ID": "7"}) == {"job_id": "7", "restarts": 0}
    assert slurm_facts({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "2"}) == {
        "job_id": "7", "restarts": 2}
    assert slurm_facts({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "-1"}) == {
        "job_id": "7", "restarts": 0}


def _log(job_dir: Path, slurm: dict[str, object] | None) -> JobDir:
    job_dir.mkdir()
    events = EventLog(job_dir / "events.db")
    for key, value in (("job_id", "slurm-7"), ("state", "running"), ("config", {}),
                       *((("slurm", slurm),) if slurm else ())):
        events.set_job(key, value)
    events.flush()
    events.close()
    return JobDir(job_dir)


def test_a_requeued_launch_does_not_carry_on_the_lost_launch_s_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager started again in the same launch carries the job on from its log; the first one
    of a launch Slurm requeued (SLURM_RESTART_COUNT changed) starts afresh and says why."""
    jd = _log(tmp_path / "a", {"job_id": "7", "restarts": 0})
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert _resumable(jd, "slurm-7") == (True, "")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    resumable, why = _resumable(jd, "slurm-7")
    assert not resumable and "resumes from the newest checkpoint" in why, why
    # Outside Slurm, or a log that has no Slurm fact: as before.
    assert _resumable(_log(tmp_path / "b", None), "slurm-7") == (True, "")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert _resumable(jd, "slurm-7") == (True, "")


def test_status_says_the_slurm_job_and_its_requeues() -> None:
    console = Console(width=100, record=True)
    base = {"job_id": "slurm-7", "state": "running", "generation": 1, "world_size": 2,
            "step": 3, "live": True}
    render({**base, "slurm": {"job_id": "7", "restarts": 1}}, console)
    render({**base, "slurm": {"job_id": "8", "restarts": 0}}, console)
    render(base, console)
    text = console.export_text()
    assert "Slurm job 7 requeued 1x" in text and "Slurm job 8" in text, text
    assert "Slurm job 8 requeued" not in text and text.count("Slurm job") == 2, text


def _scontrol(folder: Path, show: str) -> None:
    """A stand-in ``scontrol`` on PATH (no Slurm here): ``show job`` prints ``show``, ``requeue``
    leaves a mark. The real one runs in tests/integration/test_slurm.py."""
    tool = folder / "scontrol"
    tool.write_text(f"#!/bin/sh\nif [ \"$1\" = requeue ]; then touch {folder}/requeued; exit 0; fi"
                    f"\necho '{show}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)


def test_a_survivor_does_not_requeue_a_job_another_survivor_requeued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    step = SlurmStep(job_id="7", nodes=("n0", "n1", "n2"), node_rank=2, submit_dir="/s",
                     restart_count=0)
    _scontrol(tmp_path, "JobId=7 JobState=RUNNING Requeue=1 Restarts=1 BatchFlag=1")
    said = requeue(step, 20)
    assert said.startswith("not requeued again") and "Restarts=1" in said, said
    assert not (tmp_path / "requeued").exists()
    _scontrol(tmp_path, "JobId=7 JobState=RUNNING Requeue=1 Restarts=0 BatchFlag=1")
    assert requeue(step, 20) == "requeued Slurm job 7"
    assert (tmp_path / "requeued").exists()
    (tmp_path / "requeued").unlink()
    said = requeue(dataclasses.replace(step, restart_count=20), 20)  # the cap: never asked
    assert said.startswith("not requeued") and "--max-requeues 20" in said, said
    assert not (tmp_path / "requeued").exists()


def test_a_survivor_says_so_in_the_job_dir_requeues_and_ends_74_never_through_a_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its srun ran on the lost node: the survivor's lines go to ``<job dir>/launcher.log`` too
    (0600); a link planted there is not followed, and the node still requeues and ends 74."""
    tools = tmp_path / "tools"
    tools.mkdir()
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    _scontrol(tools, "JobId=7 JobState=RUNNING Requeue=1 Restarts=0 BatchFlag=1")
    step = SlurmStep(job_id="7", nodes=("n0", "n1"), node_rank=0, submit_dir="/s",
                     restart_count=0)
    job_dir = tmp_path / "jd"
    job_dir.mkdir(mode=0o700)
    assert manager_lost(step, "slurm-7", str(job_dir), "the manager at n0:1 stayed unreachable "
                        "for 20s", 20) == EXIT_PREEMPTED_BEHIND
    log = job_dir / "launcher.log"
    text = log.read_text()
    assert "node 0: the manager at n0:1 stayed unreachable for 20s: its node (n0) is taken as " \
        "lost; this node ends with 74" in text, text
    assert "node 0: requeueing Slurm job 7 (requeue 1 of at most 20)" in text, text
    assert "node 0: requeued Slurm job 7" in text and stat.S_IMODE(log.stat().st_mode) == 0o600
    assert (tools / "requeued").exists()
    log.unlink()
    (tools / "requeued").unlink()
    other = tmp_path / "someone-else"
    other.write_text("theirs\n")
    log.symlink_to(other)
    assert manager_lost(step, "slurm-7", str(job_dir), "gone", 20) == EXIT_PREEMPTED_BEHIND
    assert other.read_text() == "theirs\n" and (tools / "requeued").exists()


def test_a_node_s_agent_ending_otherwise_than_0_says_so_in_the_job_dir(tmp_path: Path) -> None:
    """A node but the first whose agent ends with a code or an error: one line in
    ``<job dir>/launcher.log`` (its srun output may have gone with the first node); a 0 adds
    nothing there."""
    job_dir = tmp_path / "jd"
    job_dir.mkdir(mode=0o700)
    token = job_dir / "token"
    token.write_text("t" * 64)
    token.chmod(0o600)
    step = SlurmStep(job_id="7", nodes=("n0", "n1"), node_rank=1, submit_dir="/s",
                     restart_count=0)
    log = job_dir / "launcher.log"
    assert run_slurm_node(step, "slurm-7", str(job_dir), 1, verbose=False, join=lambda: 0) == 0
    assert not log.exists()
    assert run_slurm_node(step, "slurm-7", str(job_dir), 1, verbose=False, join=lambda: 143) == 143
    assert "job slurm-7: node 1: this node's agent ended with 143" in log.read_text()

    def broken() -> int:
        raise RuntimeError("the agent's socket is gone")

    with pytest.raises(RuntimeError):
        run_slurm_node(step, "slurm-7", str(job_dir), 1, verbose=False, join=broken)
    assert "node 1: ended by RuntimeError: the agent's socket is gone" in log.read_text()


def _flaky_scontrol(folder: Path, fail_shows: int, *, requeue_answer_lost: bool = False) -> None:
    """A stand-in ``scontrol`` whose first ``fail_shows`` ``show job`` calls fail as a controller
    that does not answer; ``requeue`` leaves a mark (and, with ``requeue_answer_lost``, fails as if
    its answer were lost, after which ``show job`` says the job was requeued)."""
    tool = folder / "scontrol"
    lost = "echo 'slurm_requeue error: Socket timed out on send/recv operation' >&2; exit 1" \
        if requeue_answer_lost else "exit 0"
    tool.write_text(f"""#!/bin/sh
echo "$@" >> {folder}/calls
if [ "$1" = requeue ]; then touch {folder}/requeued; {lost}; fi
if [ "$(grep -c '^show' {folder}/calls)" -le {fail_shows} ]; then
  echo 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2; exit 1
fi
if [ -e {folder}/requeued ]; then r=1; else r=0; fi
echo "JobId=7 JobState=RUNNING Requeue=1 Restarts=$r BatchFlag=1"
""")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)


def test_a_controller_that_does_not_answer_is_asked_again_and_a_lost_answer_not_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's only way back into the queue is the survivor's requeue: a controller that does not
    answer (restarting, failing over) is asked again; a requeue done whose answer was lost is not
    asked for twice; one that never answers ends in one line that says how to resume."""
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    step = SlurmStep(job_id="7", nodes=("n0", "n1"), node_rank=1, submit_dir="/s",
                     restart_count=0)
    said: list[str] = []
    _flaky_scontrol(tmp_path, fail_shows=2)
    assert requeue(step, 20, said.append, pause_s=0) == "requeued Slurm job 7"
    assert (tmp_path / "calls").read_text().split("\n")[:4] == [
        "show job --oneliner 7", "show job --oneliner 7", "show job --oneliner 7", "requeue 7"]
    assert "Unable to contact slurm controller" in said[0] and "try 2 of 3" in said[0], said
    assert said[-1].startswith("requeueing Slurm job 7 (requeue 1 of at most 20)"), said

    for name in ("calls", "requeued"):
        (tmp_path / name).unlink()
    said.clear()
    _flaky_scontrol(tmp_path, fail_shows=0, requeue_answer_lost=True)
    assert requeue(step, 20, said.append, pause_s=0) == "requeued Slurm job 7"
    assert (tmp_path / "calls").read_text().count("requeue 7") == 1  # asked once
    assert sum(line.startswith("requeueing") for line in said) == 1, said

    (tmp_path / "calls").unlink()
    (tmp_path / "requeued").unlink()
    _flaky_scontrol(tmp_path, fail_shows=99)
    answer = requeue(step, 20, said.append, pause_s=0)
    assert answer.startswith("not requeued: cannot ask Slurm about job 7 (slurm_load_jobs error: "
                             "Unable to contact slurm controller"), answer
    assert "3 tries; to resume, submit the same batch script again" in answer, answer
    assert not (tmp_path / "requeued").exists()
