"""SIGHUP and SIGQUIT to a launcher or an agent (issue #25 item 3): real signals to a real process.

The process runs ``agent.hangup``'s handling as the launcher and the agent do
(an asyncio loop, ``STOP_SIGNALS`` handled by ``hangup.handle``); its stop path
writes to its stdout and exits 75. The launcher's own wiring is tested end to
end in tests/integration/test_preempt.py (a closed terminal, the dying gasp,
the resume) and the multi-node agent's in tests/integration/test_multinode.py.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

_PROGRAM = r"""
import asyncio, signal, sys, time
from undying.agent import hangup

async def main(job_dir):
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    def then(sig, detached):
        print(f"stopping on {sig.name}, output now at {detached}", flush=True)
        done.set()
    for sig in hangup.STOP_SIGNALS:
        loop.add_signal_handler(sig, hangup.handle, sig, job_dir, then)
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 30)
    for sig in hangup.STOP_SIGNALS:
        loop.remove_signal_handler(sig)
    hangup.after_the_job(job_dir)
    time.sleep(0.2)
    print("the last line, after the job", flush=True)  # a write to the dead terminal would fail here (EIO)
    sys.stderr.write("and on stderr\n")

asyncio.run(main(sys.argv[1]))
sys.exit(75)
"""


def _controlling_terminal() -> None:
    fcntl.ioctl(1, termios.TIOCSCTTY, 0)


def _read_until(fd: int, word: bytes, timeout: float = 30) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while word not in got:
        assert time.monotonic() < deadline, got
        if select.select([fd], [], [], 0.1)[0]:
            got += os.read(fd, 4096)
    return got


def test_a_closed_terminal_is_a_stop_and_every_later_write_lands_in_the_job_dir(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-c", _PROGRAM, str(tmp_path)], stdin=subprocess.DEVNULL,
                               stdout=slave, stderr=slave, start_new_session=True, preexec_fn=_controlling_terminal)
    os.close(slave)
    try:
        assert b"ready" in _read_until(master, b"ready\r\n")  # (the whole line: a print may be two writes)
    finally:
        os.close(master)  # the hang-up: the kernel sends SIGHUP to the session's leader, the terminal dies
    assert process.wait(timeout=30) == 75
    said = (tmp_path / "launcher.log").read_text()
    assert said == (f"stopping on SIGHUP, output now at {tmp_path / 'launcher.log'}\n"
                    "the last line, after the job\nand on stderr\n"), said
    assert oct((tmp_path / "launcher.log").stat().st_mode & 0o777) == oct(0o600)


def test_sigquit_dumps_the_stacks_then_stops_in_order_without_a_core_dump(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", _PROGRAM, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    assert process.stdout is not None
    assert process.stdout.readline() == b"ready\n"
    process.send_signal(signal.SIGQUIT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 75, (out, err)  # not -SIGQUIT (Python's default: a core dump)
    assert b"stopping on SIGQUIT, output now at None" in out and b"the last line, after the job" in out
    assert b"Current thread" in err and b"in on_quit" in err and b"in run_forever" in err, err  # every thread's stack, as Ctrl-\ asks
    assert not (tmp_path / "launcher.log").exists()  # no terminal to leave: the output stays where it was


_RANK = r"""
import os, sys, time
from undying.worker.streams import direct_streams
direct_streams()  # as every rank does before its script runs
print("ready", flush=True)
go = os.path.join(os.environ["UNDYING_JOB_DIR"], "go")
while not os.path.exists(go):
    time.sleep(0.01)
for i in range(3):
    print(f"step {i} loss 0.5", flush=True)  # a script's print after the terminal hung up
sys.stderr.write("on stderr\n")
sys.stderr.flush()
"""


def test_a_ranks_print_to_a_hung_up_terminal_lands_in_the_job_dir_and_never_raises(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    env = {**os.environ, "UNDYING_JOB_DIR": str(tmp_path)}
    env.pop("UNDYING_LIVE_LINE", None)  # (no launcher's live line here to erase)
    # A session of its own without the terminal as its controlling one, as a rank runs: no SIGHUP reaches it,
    # only the failing writes.
    rank = subprocess.Popen([sys.executable, "-c", _RANK], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            env=env, start_new_session=True)
    os.close(slave)
    try:
        assert b"ready" in _read_until(master, b"ready\r\n")  # (the whole line: a print may be two writes)
    finally:
        os.close(master)  # the terminal hangs up: every write to it fails with EIO from now on
    (tmp_path / "go").touch()
    assert rank.wait(timeout=30) == 0  # (unguarded, the first print raises OSError: [Errno 5])
    said = (tmp_path / "launcher.log").read_text()
    # (A print is two writes, its text then its newline: the first to fail may land its newline first.)
    assert [line for line in said.splitlines() if line] == ["step 0 loss 0.5", "step 1 loss 0.5", "step 2 loss 0.5",
                                                           "on stderr"], said


def test_a_rank_s_print_erases_the_launcher_s_live_line_it_would_land_after() -> None:
    """Under the launcher's live line (UNDYING_LIVE_LINE), a write that starts a line first clears
    it; a write in the middle of a line does not."""
    import io

    from undying.worker.streams import _Guarded

    shown = io.StringIO()
    guarded = _Guarded(shown, 1, erase=True)  # type: ignore[arg-type]
    for text in ("epoch 0 loss 0.4656\n", "half ", "a line\n", ""):
        guarded.write(text)
    assert shown.getvalue() == "\r\x1b[Kepoch 0 loss 0.4656\n\r\x1b[Khalf a line\n"
    plain = io.StringIO()
    _Guarded(plain, 1).write("epoch 0\n")  # type: ignore[arg-type]
    assert plain.getvalue() == "epoch 0\n"


def test_a_signal_ignored_at_start_is_left_ignored_by_the_job_and_after_it(tmp_path: Path) -> None:
    """`nohup` ignores SIGHUP; a shell's `&` without job control ignores SIGINT and SIGQUIT. The launcher,
    the agent and the manager handle only the stop signals not ignored, and after the job leave them so.
    (End to end: tests/integration/test_preempt.py, a hang-up under nohup.)"""
    from undying.agent import hangup

    saved = {sig: signal.getsignal(sig) for sig in hangup.STOP_SIGNALS}
    try:
        for sig in hangup.STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGHUP else signal.SIG_DFL)
        assert hangup.not_ignored(hangup.STOP_SIGNALS) == (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
        hangup.after_the_job(tmp_path)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert callable(signal.getsignal(signal.SIGQUIT)), "SIGQUIT, not ignored, still dumps the stacks"
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_the_handlers_a_job_finds_are_the_ones_it_leaves(tmp_path: Path) -> None:
    """asyncio's remove_signal_handler puts the default back; undying puts back what it found (a launcher
    or a manager run inside another program, or a test). An ignored one it never touches."""
    import asyncio

    from undying.agent import hangup

    def mine(signum: int, frame: object) -> None:
        pass

    saved = {sig: signal.getsignal(sig) for sig in hangup.STOP_SIGNALS}
    try:
        signal.signal(signal.SIGTERM, mine)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

        async def job() -> None:
            undo = hangup.handle_on(asyncio.get_running_loop(), lambda sig: None)
            assert signal.getsignal(signal.SIGTERM) is not mine  # (the loop's, while the job runs)
            undo()

        asyncio.run(job())
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is saved[signal.SIGINT]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
