"""Where a worker's stdout and stderr go: torchrun's ``--redirects``, ``--tee`` and
``--local-ranks-filter``.

The agent puts the decision in the rank's environment (``UNDYING_LOG_DIR``,
``UNDYING_REDIRECTS``, ``UNDYING_TEE``: torchrun's Std numbers, 1 stdout,
2 stderr, 3 both; ``UNDYING_CONSOLE=0``: this rank is filtered off the
console), and the worker sets its own file descriptors before the script runs:

- redirected: the stream goes to ``<dir>/stdout.log`` (``stderr.log``) only;
- teed: to the file and the console, through a ``tee`` process that ends when
  the worker's last descriptor on it closes (a killed worker loses nothing it wrote);
- filtered off the console: to the file if one is asked for, else nowhere.

A console that is a terminal may hang up under the job (a closed window, a
dropped ssh session): the launcher then takes its dying gasp, and every write
to the dead terminal fails with EIO. A rank's ``print`` raising there would
fail the very steps the gasp waits for, so ``sys.stdout`` and ``sys.stderr``
on a terminal are guarded (``_Guarded``): on EIO the descriptor is moved onto
``<job dir>/launcher.log`` (where the launcher's own output goes then) and the
write is done there. Where the launcher draws its live progress line on that terminal
(``UNDYING_LIVE_LINE``), a print that starts a line first erases it: the rank's words take the
line, and the launcher draws its own again below them.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from typing import Any, TextIO

from undying.config import HANGUP_LOG
from undying.inputs import env_value
from undying.protocol.env import (
    CONSOLE_ENV,
    JOB_DIR_ENV,
    LIVE_LINE_ENV,
    LOG_DIR_ENV,
    REDIRECTS_ENV,
    TEE_ENV,
)

__all__ = ["direct_streams"]

_STREAMS = ((1, "stdout", 1), (2, "stderr", 2))  # fd, file name, torchrun's Std bit
_ERASE = "\r\x1b[K"  # to the line's start, and clear it
# (held: the copies outlive nothing of ours but must not be collected)
_tees: list[subprocess.Popen[bytes]] = []


def direct_streams() -> None:
    """Point fds 1 and 2 where this rank's environment says; guard what stays on a terminal
    against its hang-up."""
    _point_streams()
    _guard_terminal()


def _point_streams() -> None:
    env = os.environ
    console = env.get(CONSOLE_ENV, "1") != "0"
    folder = env.get(LOG_DIR_ENV, "")
    # (undying.inputs: the one reader)
    redirects = int(env_value(REDIRECTS_ENV) or 0) if folder else 0
    tee = int(env_value(TEE_ENV) or 0) if folder else 0
    if console and not redirects and not tee:
        return
    if folder:
        os.makedirs(folder, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name, bit in _STREAMS:
        path = os.path.join(folder, f"{name}.log") if folder else ""
        if path and (redirects & bit or (tee & bit and not console)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        elif path and tee & bit:
            target = _tee(path, fd)
        elif not console:
            target = os.open(os.devnull, os.O_WRONLY)
        else:
            continue
        os.dup2(target, fd)
        os.close(target)


def _tee(path: str, fd: int) -> int:
    """A pipe whose reader writes to ``path`` and to what ``fd`` is now; returns the pipe's write
    end."""
    read_end, write_end = os.pipe()
    console = os.dup(fd)
    # Its own session: a signal to the worker's group does not cut the copy short; it ends at EOF.
    _tees.append(subprocess.Popen(["tee", "-a", path], stdin=read_end, stdout=console,
                                  stderr=subprocess.DEVNULL, start_new_session=True,
                                  close_fds=True))
    os.close(read_end)
    os.close(console)
    return write_end


class _Guarded:
    """A standard stream on a terminal whose writes survive the terminal's hang-up (see the
    module's doc)."""

    def __init__(self, stream: TextIO, fd: int, erase: bool = False) -> None:
        self._stream = stream
        self._fd = fd
        self._erase = erase  # the launcher's live line may be on this line: erase it first
        self._line_start = True

    def _again(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
        _off_the_terminal(self._fd)
        try:
            return call(*args)
        except OSError:  # nowhere to write at all: the words are lost, never the step
            return len(args[0]) if args and isinstance(args[0], str) else None

    def write(self, text: str) -> int:
        if self._erase and self._line_start and text:
            self._again(self._stream.write, _ERASE)  # (the launcher draws it again below)
        if text:
            self._line_start = text.endswith("\n")
        return int(self._again(self._stream.write, text) or 0)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._again(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _guard_terminal() -> None:
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        try:
            on_terminal = stream is not None and stream.fileno() == fd and os.isatty(fd)
        except (OSError, ValueError, AttributeError):
            on_terminal = False
        if on_terminal:
            setattr(sys, name, _Guarded(stream, fd, erase=os.environ.get(LIVE_LINE_ENV) == "1"))


def _off_the_terminal(fd: int) -> None:
    """The hung-up terminal on ``fd`` replaced by ``<job dir>/launcher.log`` (or /dev/null
    without a job dir)."""
    job_dir = os.environ.get(JOB_DIR_ENV, "")
    try:
        target = os.open(os.path.join(job_dir, HANGUP_LOG) if job_dir else os.devnull,
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError:
        try:
            target = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
    os.dup2(target, fd)
    os.close(target)
