"""The signals that end a launcher or an agent in order, and what a hung-up terminal leaves behind.

A launcher started from a terminal gets SIGHUP when the terminal closes (a
window shut, an ssh session dropped) and SIGQUIT from Ctrl-\\. Python's
defaults end the process on the spot (SIGQUIT with a core dump): no agreed
stop step, no dying gasp, the steps since the last checkpoint lost. Here both
are a preemption, as SIGTERM is: the ranks agree on a stop step, rank 0 writes
the dying gasp, and the launcher exits 75 (a multi-node agent leaves the job
as on SIGTERM, and its ranks are recovered elsewhere). SIGQUIT first writes
every thread's stack of the process to its stderr: Ctrl-\\ is what a user
presses on a process that looks stuck.

After a hang-up the terminal is gone: a write to it fails (EIO) or blocks
nothing but goes nowhere. ``detach_from_terminal`` points the process's stdout
and stderr, where they are a terminal, at ``<job dir>/launcher.log`` (the end
summary and the last line land there, to read after reconnecting), so no
write of the stop path (a log line, the summary) can fail it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import faulthandler
import fcntl
import os
import signal
import stat
import sys
import termios
from collections.abc import Callable, Iterable
from pathlib import Path

from undying.config import HANGUP_LOG

__all__ = ["STOP_SIGNALS", "PREEMPT_SIGNALS", "LOG_NAME", "detach_from_terminal", "on_quit",
           "open_launcher_log", "not_ignored", "handle_on",
           "hangup_line", "handle", "after_the_job"]


# SIGINT stops the job (Ctrl-C); the others preempt it: a stop with a dying gasp, then exit 75.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
STOP_SIGNALS = (signal.SIGINT, *PREEMPT_SIGNALS)
LOG_NAME = HANGUP_LOG  # in the job dir: what the process said after its terminal hung up


def not_ignored(signals: Iterable[signal.Signals]) -> tuple[signal.Signals, ...]:
    """Of ``signals``, those this process does not ignore: the ones it handles.

    A signal ignored when the job starts stays ignored, as whoever started it
    asked: `nohup undying run ...` (SIGHUP ignored) goes on when its terminal
    closes, and a launcher a script started in the background (``&`` without
    job control: SIGINT and SIGQUIT ignored) is not stopped by a Ctrl-C meant
    for the foreground. Its workers inherit the same (an ignored signal stays
    ignored across fork and exec).
    """
    return tuple(s for s in signals if signal.getsignal(s) is not signal.SIG_IGN)


def handle_on(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object,
              signals: Iterable[signal.Signals] = STOP_SIGNALS) -> Callable[[], None]:
    """Handle each of ``signals`` not ignored, on ``loop``: ``callback(sig, *args)``; the undo.

    The undo removes the handlers and puts back the ones before (asyncio alone
    would leave the defaults): a launcher, agent or manager run inside another
    program, or a test, leaves its process's handlers as it found them.
    """
    handled = not_ignored(signals)
    previous = {sig: signal.getsignal(sig) for sig in handled}
    for sig in handled:
        loop.add_signal_handler(sig, callback, sig, *args)

    def undo() -> None:
        for sig in handled:
            loop.remove_signal_handler(sig)
            before = previous[sig]
            with contextlib.suppress(TypeError, ValueError, OSError):
                signal.signal(sig, before if before is not None else signal.SIG_DFL)

    return undo


def open_launcher_log(job_dir: str | Path) -> int:
    """``<job dir>/launcher.log`` opened to append: 0600, never through a link (OSError as
    ``os.open`` raises it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
    return os.open(Path(job_dir) / LOG_NAME, flags, 0o600)


def detach_from_terminal(job_dir: str | Path) -> Path | None:
    """Stdout and stderr that are a terminal now append to ``<job dir>/launcher.log``; that file, or
    None.

    Pending output is flushed first (to the terminal, if it still takes it);
    nothing here raises: a folder that cannot be written leaves the streams as
    they were, and a failing write is then what logging already tolerates.
    """
    ttys = [fd for fd in (1, 2) if _isatty(fd)]
    if not ttys:
        return None
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    path = Path(job_dir) / LOG_NAME
    try:
        fd = open_launcher_log(job_dir)
    except OSError:
        fd = _devnull()
        if fd < 0:
            return None
        path = Path(os.devnull)
    try:
        for target in ttys:
            os.dup2(fd, target)
    finally:
        os.close(fd)
    return path


def on_quit() -> None:
    """SIGQUIT: every thread's stack to stderr (what a stuck-looking process was doing), then as
    SIGTERM."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


def hangup_line(sig: signal.Signals, detached: Path | None, what: str) -> str:
    """The log line of a stop signal: which, ``what`` it does, and where the rest of the output
    goes."""
    why = {signal.SIGHUP: "SIGHUP (the terminal hung up)",
           signal.SIGQUIT: "SIGQUIT (Ctrl-\\)"}.get(sig, sig.name)
    rest = f"; the rest of this output goes to {detached}" if detached is not None else ""
    return f"{why}: {what}" + rest


def handle(sig: signal.Signals, job_dir: str | Path,
           then: Callable[[signal.Signals, Path | None], None]) -> None:
    """A stop signal's common part: SIGQUIT's stacks, the terminal left after SIGHUP, then
    ``then``."""
    if sig == signal.SIGQUIT:
        on_quit()
    detached = detach_from_terminal(job_dir) if sig == signal.SIGHUP else None
    then(sig, detached)


def after_the_job(job_dir: str | Path) -> None:
    """Once the event loop's handlers are gone (the workers stopped, the summary and exit code to
    come).

    A hang-up then only moves the output off the terminal, and SIGQUIT dumps
    the stacks: neither ends the process before its last line and exit code.
    """
    then = {signal.SIGHUP: lambda signum, frame: detach_from_terminal(job_dir),
            signal.SIGQUIT: lambda signum, frame: on_quit()}
    for sig in not_ignored(then):
        signal.signal(sig, then[sig])


def _isatty(fd: int) -> bool:
    """A terminal, or one that hung up: its every call fails with EIO then, ``isatty`` too."""
    try:
        if os.isatty(fd):
            return True
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            return False
        fcntl.ioctl(fd, termios.TCGETS, bytes(64))
    except OSError as e:
        return e.errno == errno.EIO
    return False


def _devnull() -> int:
    try:
        return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return -1
