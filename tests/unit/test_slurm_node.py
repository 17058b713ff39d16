"""The first node's launcher under Slurm (launch/slurm_node.py), on real processes and files: a
manager child stopped and continued, or stopped for good; a token in the shared job dir that
another user may have made."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from undying.errors import UsageError
from undying.jobfiles.ownership import private_dir, write_private
from undying.launch.slurm_node import ManagerChild, process_state, wait_for_token

# A stand-in manager: a real process that runs until told to end (the file ``end`` appears).
MANAGER = ("import os, sys, time\n"
           "while not os.path.exists(sys.argv[1]):\n"
           "    time.sleep(0.05)\n"
           "raise SystemExit(0)\n")


def _until(what: str, condition: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout}s")
        time.sleep(0.05)


@pytest.fixture
def child(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ManagerChild]:
    """A launcher's manager child; ended when stopped ``getattr(request, "param", 2.0)`` s."""
    made = ManagerChild([sys.executable, "-c", MANAGER, str(tmp_path / "end")],
                        stopped_limit=getattr(request, "param", 2.0))
    made.start()
    try:
        yield made
    finally:
        if made.process is not None and made.process.poll() is None:
            os.kill(made.process.pid, signal.SIGCONT)
        made.stop()


@pytest.mark.parametrize("child", [60.0], indirect=True)  # (a pause far below the limit)
def test_a_paused_manager_is_waited_for_and_carries_on_when_continued(
        child: ManagerChild, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="undying.slurm")
    assert child.process is not None
    pid = child.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        _until("the stop seen", lambda: "is stopped (SIGSTOP)" in caplog.text)
    finally:
        os.kill(pid, signal.SIGCONT)
    _until("the manager seen again", lambda: "continues after" in caplog.text)
    assert child.process.pid == pid and child.process.poll() is None  # the same, never ended
    assert f"`kill -CONT {pid}` carries it on" in caplog.text
    assert not child.gave_up and child.exited() is None
    (tmp_path / "end").write_text("")
    assert child.finish(0) == 0


def test_a_manager_stopped_for_good_is_ended_in_one_line_and_not_started_again(
        child: ManagerChild, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="undying.slurm")
    assert child.process is not None
    os.kill(child.process.pid, signal.SIGSTOP)
    _until("the stopped manager ended", lambda: child.process is not None
           and child.process.poll() is not None)
    assert child.process.returncode == -signal.SIGKILL
    assert "stayed stopped for" in child.gave_up and "scontrol suspend" in child.gave_up
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        child.gave_up]
    assert child.restarts == 0  # ended for good: not started again
    assert child.exited() == child.gave_up  # a node still waiting for the token says why
    with pytest.raises(UsageError, match="stayed stopped"):
        wait_for_token(Path("/nonexistent-job-dir"), 30, child.exited)
    assert child.finish(0) == 1  # the job failed, whatever the agent said


LAUNCHER = textwrap.dedent("""\
    import logging, sys, time
    from undying.launch.slurm_node import ManagerChild
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    child = ManagerChild([sys.executable, "-c", "import time; time.sleep(120)"],
                         stopped_limit=3.0)
    child.start()
    print("manager", child.process.pid, flush=True)
    time.sleep(60)
    """)


def test_a_whole_job_suspended_is_no_stop_of_its_manager(tmp_path: Path) -> None:
    """`scontrol suspend` (or a paused VM) stops every process of the job, the launcher too:
    its manager's stop is counted only over time the launcher ran, so a suspend longer than the
    limit, resumed, ends nothing."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    manager = 0
    try:
        assert launcher.stdout is not None
        first = launcher.stdout.readline().split()
        assert first[:1] == ["manager"], first
        manager = int(first[1])
        _until("the manager running", lambda: process_state(manager) in ("R", "S"))
        # slurmstepd stops one process after another: the launcher may see its manager
        # stopped before it stops itself
        os.kill(manager, signal.SIGSTOP)
        assert launcher.stdout.readline().startswith(f"the job's manager (pid {manager}) is "
                                                     "stopped")
        os.kill(launcher.pid, signal.SIGSTOP)
        _until("both stopped", lambda: process_state(launcher.pid) == "T")
        time.sleep(5.0)  # past the limit, the launcher stopped too
        os.kill(launcher.pid, signal.SIGCONT)
        time.sleep(0.8)  # (slurmstepd continues one process after another)
        os.kill(manager, signal.SIGCONT)
        _until("the manager continued", lambda: process_state(manager) in ("R", "S"), 5)
        time.sleep(1.5)  # the launcher's next looks
        assert process_state(manager) in ("R", "S"), "a suspended job's manager was ended"
    finally:
        for pid in (manager, launcher.pid):  # (the manager holds the launcher's stdout too)
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=30)
    assert "did not run for" in out, out  # the launcher saw its own stall
    assert "stayed stopped" not in out, out


# --- a token another user may have made ------------------------------------------------------

@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A job dir as the first node's manager leaves it: 0700, the token 0600."""
    made = tmp_path / "undying-jobs" / "slurm-7"
    private_dir(made)
    write_private(made / "token", b"the-token\n")
    return made


def test_the_token_as_the_first_node_s_manager_writes_it_is_taken(job_dir: Path) -> None:
    wait_for_token(job_dir, 0.3, lambda: None)


def _refused(job_dir: Path) -> str:
    """The one line a node waiting for the token says, refused at once (no 120 s wait)."""
    with pytest.raises(UsageError) as refused:
        wait_for_token(job_dir, 30, lambda: None)
    line = str(refused.value)
    assert "\n" not in line
    return line


def test_a_token_that_is_a_link_is_refused_even_one_to_nowhere(job_dir: Path,
                                                                tmp_path: Path) -> None:
    (job_dir / "token").unlink()
    (job_dir / "token").symlink_to(tmp_path / "planted")  # to nowhere: not waited for
    line = _refused(job_dir)
    assert f"token file {job_dir / 'token'} is a symbolic link" in line and "remove it" in line
    (tmp_path / "planted").write_text("known-token\n")
    os.chmod(tmp_path / "planted", 0o600)
    assert "is a symbolic link" in _refused(job_dir)


def test_a_job_dir_that_is_a_link_is_refused(job_dir: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(job_dir)
    line = _refused(link)
    assert f"the job dir {link} is a symbolic link" in line and "--job-dir" in line


@pytest.mark.parametrize(("mode", "by"), [(0o770, "group"), (0o707, "others"),
                                          (0o777, "group and others")])
def test_a_job_dir_others_may_write_is_refused(job_dir: Path, mode: int, by: str) -> None:
    os.chmod(job_dir, mode)
    line = _refused(job_dir)
    assert f"the job dir {job_dir} is writable by {by}" in line, line
    assert f"chmod go-w {job_dir}" in line


def test_a_token_others_may_read_is_refused(job_dir: Path) -> None:
    os.chmod(job_dir / "token", 0o644)
    line = _refused(job_dir)
    assert f"token file {job_dir / 'token'} is readable by group or others" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("whose", ["token", "job dir"])
def test_a_token_or_job_dir_of_another_user_is_refused_root_included(job_dir: Path,
                                                                     whose: str) -> None:
    """As root too: root trusts a container volume's owner elsewhere, not here (the first
    node's manager, this same user, made the job dir)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    os.chown(job_dir / "token", nobody.pw_uid, nobody.pw_gid)
    if whose == "job dir":
        os.chown(job_dir, nobody.pw_uid, nobody.pw_gid)
    line = _refused(job_dir)
    shown = job_dir if whose == "job dir" else job_dir / "token"
    assert f"{shown} belongs to nobody (uid {nobody.pw_uid}), not to you" in line, line
    assert "another user made it" in line
