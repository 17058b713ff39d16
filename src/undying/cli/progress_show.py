"""The launcher's progress on its stderr while the job runs: a live line on a terminal, else a line
every ``--progress-every`` seconds.

The process that runs the job shows it (the launcher of a single-node job, ``undying manager`` of
a multi-node one; an agent stays quiet), from ``Manager.status()``: no bookkeeping of its own.
The words are ``cli/progress_line.py``'s.

- On a terminal (and ``TERM`` not ``dumb``): one line, rewritten in place each second as tqdm's
  is. The launcher's own lines (its log, the banner, a traceback) still print above it: while it
  is shown, this process's stderr and its log's handlers write through ``_AboveTheLine``, which
  erases the line, writes theirs, and draws it again below. The ranks write to the terminal
  themselves: a line a rank prints while the progress line is shown starts after it (the next
  redraw is on the line below). A terminal that hung up (its descriptor moved onto
  ``launcher.log``, ``agent.hangup``) ends the live line.
- Elsewhere (a file, a pipe, a CI log): ``[undying HH:MM:SS] step 40/80, ...`` every
  ``--progress-every`` seconds (30 by default).
- ``--progress-every 0``: neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TextIO

from undying.cli.progress_line import WIDTH, live_line, periodic_line
from undying.protocol.env import LIVE_LINE_ENV

__all__ = ["LIVE", "PERIODIC", "OFF", "choose_mode", "ProgressShow"]

log = logging.getLogger("undying.cli.progress_show")

LIVE, PERIODIC, OFF = "live", "periodic", "off"
# How often the live line is drawn again (its figures change with each step; a person reads it).
_REDRAW_S = 1.0
_ERASE = "\r\x1b[K"


def choose_mode(stream: TextIO, every_s: float, env: Mapping[str, str] | None = None) -> str:
    """``LIVE`` on a terminal, ``PERIODIC`` elsewhere, ``OFF`` with ``--progress-every 0``."""
    if every_s <= 0:
        return OFF
    term = (os.environ if env is None else env).get("TERM", "")
    return LIVE if _is_terminal(stream) and term != "dumb" else PERIODIC


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):  # (a terminal that hung up, a closed stream)
        return False


def _line_width(stream: TextIO) -> int:
    """At most ``WIDTH`` columns, and the terminal's."""
    columns = shutil.get_terminal_size((WIDTH, 24)).columns
    with contextlib.suppress(OSError, ValueError):  # (not a terminal: $COLUMNS, or 80)
        columns = os.get_terminal_size(stream.fileno()).columns or columns
    return max(20, min(WIDTH, columns))


class _AboveTheLine:
    """A stream that writes above the live line: erase it, write, draw it again after a full
    line."""

    def __init__(self, show: ProgressShow, stream: TextIO) -> None:
        self._show = show
        self._stream = stream

    def write(self, text: str) -> int:
        with self._show.lock:
            self._show.erase()
            written = self._stream.write(text)
            if text.endswith("\n"):
                self._show.draw()
            return written

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ... of the stream's
        return getattr(self._stream, name)


class ProgressShow:
    """The progress of one job on ``stream`` (the launcher's stderr) from ``status`` (the manager's
    ``status``), until ``close``; ``url``: the status page's."""

    def __init__(self, status: Callable[[], Mapping[str, Any]], url: str, every_s: float,
                 stream: TextIO | None = None) -> None:
        self._status = status
        self._url = url
        self._every_s = every_s
        self._stream = stream or sys.stderr
        self.mode = choose_mode(self._stream, every_s)
        self.lock = threading.RLock()
        self._line = ""  # the live line last drawn
        self._shown = False  # it is on the terminal now
        self._task: asyncio.Task[None] | None = None
        self._swapped: list[tuple[logging.StreamHandler[Any], Any]] = []
        self._above: _AboveTheLine | None = None
        self._env_before: str | None = None  # UNDYING_LIVE_LINE as it was before start()

    def start(self) -> ProgressShow:
        """Begin (on the running event loop); returns itself."""
        if self.mode == LIVE:
            # the ranks started from now on erase it to print (until close(): none is drawn then)
            self._env_before = os.environ.get(LIVE_LINE_ENV)
            os.environ[LIVE_LINE_ENV] = "1"
            self._above = _AboveTheLine(self, self._stream)
            self._divert(self._above)
            self._task = asyncio.ensure_future(self._live())
        elif self.mode == PERIODIC:
            self._task = asyncio.ensure_future(self._periodic())
        return self

    def close(self) -> None:
        """Stop, and take the live line off the terminal (what follows prints where it was)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        with self.lock:
            self.erase()
            self._undivert()
        if self.mode == LIVE:
            if self._env_before is None:
                os.environ.pop(LIVE_LINE_ENV, None)
            else:
                os.environ[LIVE_LINE_ENV] = self._env_before

    # --- the live line ------------------------------------------------------------------------

    def _divert(self, above: _AboveTheLine) -> None:
        """This process's stderr and its log's handlers on it write above the line."""
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is self._stream:
                self._swapped.append((handler, handler.stream))
                handler.setStream(above)
        if sys.stderr is self._stream:
            sys.stderr = above

    def _undivert(self) -> None:
        for handler, stream in self._swapped:
            handler.setStream(stream)
        self._swapped.clear()
        if self._above is not None and sys.stderr is self._above:
            sys.stderr = self._stream

    async def _live(self) -> None:
        while True:
            if not _is_terminal(self._stream):  # hung up: its output now goes to a file
                with self.lock:
                    self._shown = False
                    self._undivert()
                return
            line = self._figures(lambda status: live_line(status, url=self._url, now=time.time(),
                                                          width=_line_width(self._stream)))
            if line is not None:
                with self.lock:
                    self._line = line
                    self.draw()
            await asyncio.sleep(_REDRAW_S)

    def draw(self) -> None:
        """(Under ``lock``.) The line, in place of the one shown; nothing once the stream is no
        terminal (a hang-up moved it onto a file)."""
        if not self._line or self._task is None or not _is_terminal(self._stream):
            return
        self._write(_ERASE + self._line)
        self._shown = True

    def erase(self) -> None:
        """(Under ``lock``.) The line off the terminal, the cursor at its start."""
        if self._shown and _is_terminal(self._stream):
            self._write(_ERASE)
        self._shown = False

    # --- the periodic line ---------------------------------------------------------------------

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            prefix = f"[undying {time.strftime('%H:%M:%S')}] "
            line = self._figures(partial(_periodic_words, width=WIDTH - len(prefix)))
            if line is not None:
                self._write(prefix + line + "\n")

    # --- both ---------------------------------------------------------------------------------

    def _figures(self, words: Callable[[Mapping[str, Any]], str]) -> str | None:
        try:
            return words(self._status())
        except Exception as e:  # noqa: BLE001 - a figure it cannot read never stops the job
            log.info("progress line: %s: %s", type(e).__name__, e)
            return None

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # a terminal that hung up (EIO), a closed stream
            pass


def _periodic_words(status: Mapping[str, Any], *, width: int) -> str:
    return periodic_line(status, now=time.time(), width=width)
