"""The agent's judgement of one rank's beats: hung, stalled or fine (undying.agent.liveness)."""

from __future__ import annotations

from undying.agent.liveness import is_stalled, judge_silence, stall_to_report
from undying.config import Timeouts
from undying.protocol.kinds import WorkerPhase
from undying.protocol.worker_wire import Heartbeat

TIMEOUTS = Timeouts(heartbeat_timeout=5.0, init_timeout=60.0)


def test_a_rank_that_spoke_is_hung_after_the_heartbeat_timeout() -> None:
    assert judge_silence(104.9, started=0.0, last_seen=100.0, timeouts=TIMEOUTS, step_api=True) is None
    silence = judge_silence(105.5, started=0.0, last_seen=100.0, timeouts=TIMEOUTS, step_api=True)
    assert silence is not None and (silence.phase, silence.limit_s) == ("heartbeat", 5.0)
    assert abs(silence.silent_s - 5.5) < 1e-9


def test_a_rank_that_never_spoke_has_the_init_timeout_and_a_plain_script_none() -> None:
    assert judge_silence(59.0, started=0.0, last_seen=0.0, timeouts=TIMEOUTS, step_api=True) is None
    silence = judge_silence(61.0, started=0.0, last_seen=0.0, timeouts=TIMEOUTS, step_api=True)
    assert silence is not None and silence.phase == "init"
    # A script without the step API never speaks to undying: only its exit counts.
    assert judge_silence(10_000.0, started=0.0, last_seen=0.0, timeouts=TIMEOUTS, step_api=False) is None


def _beat(phase: str, t: float, progress_t: float) -> Heartbeat:
    return Heartbeat(rank=0, t=t, phase=phase, progress_t=progress_t)


def test_a_stall_is_judged_by_the_beats_own_clock_and_the_limit_of_its_phase() -> None:
    assert not is_stalled(_beat(WorkerPhase.STEP, t=109.0, progress_t=100.0), 10.0, TIMEOUTS)
    assert is_stalled(_beat(WorkerPhase.STEP, t=111.0, progress_t=100.0), 10.0, TIMEOUTS)
    assert not is_stalled(_beat(WorkerPhase.INIT, t=150.0, progress_t=100.0), 10.0, TIMEOUTS)  # init: 60 s
    assert is_stalled(_beat(WorkerPhase.INIT, t=161.0, progress_t=100.0), 10.0, TIMEOUTS)
    # Any other phase (waiting for a generation, restoring) has no stall limit here.
    other = next(p for p in WorkerPhase if p not in (WorkerPhase.STEP, WorkerPhase.INIT))
    assert not is_stalled(_beat(other, t=10_000.0, progress_t=0.0), 10.0, TIMEOUTS)


def _reaches(pid: int, state: str) -> bool:
    import time

    from undying.agent.liveness import process_state

    deadline = time.monotonic() + 10
    while process_state(pid) != state and time.monotonic() < deadline:
        time.sleep(0.01)
    return process_state(pid) == state


def test_a_silent_rank_that_already_exited_is_not_hung_and_a_stopped_one_is() -> None:
    """/proc tells an exit whose report is late (a zombie) from a stop: only the stop is a hang."""
    import os
    import signal
    import subprocess

    from undying.agent.liveness import has_exited, process_state

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _reaches(child.pid, "S") and not has_exited(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        assert _reaches(child.pid, "T") and not has_exited(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        assert _reaches(child.pid, "Z") and has_exited(child.pid)  # exited, its status not yet collected
    finally:
        child.kill()
        child.wait(10)
    assert process_state(child.pid) == "?" and not has_exited(child.pid)  # gone: its exit was recorded


def test_a_stall_is_reported_once_and_again_each_limit_it_lasts() -> None:
    """The manager may judge a first report too early (a rank behind that still moved, a replacement still
    replaying its loader): a stall that lasts is heard again, never only logged once."""
    beat = _beat(WorkerPhase.STEP, t=111.0, progress_t=100.0)
    assert stall_to_report(beat, (0.0, 0.0), 111.0, 10.0, TIMEOUTS), "a new stall"
    assert not stall_to_report(beat, (100.0, 111.0), 115.0, 10.0, TIMEOUTS), "reported already"
    assert stall_to_report(_beat(WorkerPhase.STEP, t=121.5, progress_t=100.0), (100.0, 111.0), 121.5, 10.0, TIMEOUTS)
    moving = _beat(WorkerPhase.STEP, t=121.5, progress_t=120.0)
    assert not stall_to_report(moving, (100.0, 111.0), 121.5, 10.0, TIMEOUTS), "it moved: no stall"
