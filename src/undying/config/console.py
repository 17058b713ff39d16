"""What a job's processes show on the terminal, and what only the log keeps.

A fault the job handles is one line there, and its recovery one more; the details are for
the job's log (the event log's ``comm_failure`` and incident rows), ``undying status`` and the
page, and for ``undying -v``:

- the process that runs the job (the launcher of a single-node job, ``undying manager`` of a
  multi-node one) writes its log to stderr: WARNING and above (a fault and the action taken on
  it), and the lines a person reads at INFO, logged on ``SHOWN_LOG`` (a recovery: how long it
  took, which step it restored). With ``-v``, every INFO line;
- a rank shows WARNING and above only: what a handled fault makes a survivor say (its
  collective failed, in gloo's words; it leaves the generation) is INFO. ``undying -v run``
  sets ``UNDYING_VERBOSE=1`` for its ranks, which then show their INFO lines as well. A script
  that sets up logging of its own (``logging.basicConfig(level=logging.INFO)``) does not raise
  undying's lines in its ranks: the ``undying`` logger has its level set.

In both, the ``undying`` logger writes through a handler of its own and does not propagate to the
root logger: a library that owns the root logger (hydra, accelerate, a script's ``basicConfig``)
keeps its log free of undying's lines, and undying's lines keep their own form and destination.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import textwrap
from typing import TextIO

from undying.inputs import env_value
from undying.protocol.env import VERBOSE_ENV

__all__ = ["SHOWN_LOG", "WIDTH", "show_launcher_log", "show_rank_log", "fit_terminal", "wrap"]

# The logger of the INFO lines a person reads whatever the level (undying.shown).
SHOWN_LOG = "undying.shown"
_FORMAT = "[undying %(asctime)s %(levelname)s] %(message)s"
_DATE = "%H:%M:%S"
# The columns a line the launcher prints fits in.
WIDTH = 80
# A number and the unit after it, kept on one line.
_UNIT = re.compile(r"(\d) (s|ms|min|h|GB|MB|KB)\b")


def show_launcher_log(verbose: bool) -> None:
    """The log of an ``undying`` command on its stderr: WARNING and above and ``SHOWN_LOG``'s INFO
    lines, or every INFO line with ``verbose`` (``-v``); on a terminal, within 80 columns."""
    # Other libraries' lines, through the root logger, as they were (fitted on a terminal too).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Fitted(sys.stderr, _FORMAT, _DATE))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])
    _own_handler(logging.INFO if verbose else logging.WARNING, _Fitted(sys.stderr, _FORMAT, _DATE))
    logging.getLogger(SHOWN_LOG).setLevel(logging.INFO)


def fit_terminal(text: str, stream: TextIO) -> str:
    """``text``'s first line in lines of at most 80 columns (the terminal's, if narrower) where
    ``stream`` is a terminal, the lines after it indented by two; a word that cannot break (a
    path, a URL) stands alone on its line. Elsewhere (a file, a pipe) ``text`` as it is: one line
    per line to search."""
    head, newline, rest = text.partition("\n")
    try:
        if not stream.isatty():
            return text
        width = min(WIDTH, os.get_terminal_size(stream.fileno()).columns or WIDTH)
    except (OSError, ValueError, AttributeError):  # (a hung-up terminal: EIO; a closed stream)
        return text
    if len(head) <= width:
        return text
    return "\n".join(wrap(head, width, "", "  ")) + newline + rest


def wrap(text: str, width: int, indent: str = "", more: str = "") -> list[str]:
    """``text`` in lines of at most ``width`` columns (``more``: the indent of the lines after the
    first): broken between words, never inside one (a path stands alone on its line), nor between
    a number and its unit (``12.6 s``)."""
    kept = _UNIT.sub("\\1\u00a0\\2", text)  # (textwrap breaks at whitespace; U+00A0 is none)
    lines = textwrap.wrap(kept, width, initial_indent=indent, subsequent_indent=more or indent,
                          break_long_words=False, break_on_hyphens=False)
    return [line.replace("\u00a0", " ") for line in lines] or [indent.rstrip()]


class _Fitted(logging.Formatter):
    """The launcher's log lines, each within 80 columns on a terminal (``fit_terminal``)."""

    def __init__(self, stream: TextIO, fmt: str, datefmt: str) -> None:
        super().__init__(fmt, datefmt)
        self._stream = stream

    def format(self, record: logging.LogRecord) -> str:
        return fit_terminal(super().format(record), self._stream)


class _OwnStderr(logging.StreamHandler[TextIO]):
    """undying's lines on the process's stderr as it is at each line (a rank's is redirected by
    worker/streams.py after this handler exists; the launcher's live progress line diverts it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _own_handler(level: int, formatter: logging.Formatter | None = None) -> None:
    """The ``undying`` logger at ``level``, on its own stderr handler, never the root logger's."""
    ours = logging.getLogger("undying")
    ours.setLevel(level)
    ours.propagate = False
    if not any(isinstance(h, _OwnStderr) for h in ours.handlers):
        handler = _OwnStderr()
        handler.setFormatter(formatter or logging.Formatter(_FORMAT, _DATE))
        ours.addHandler(handler)


def show_rank_log() -> None:
    """In a rank, before its script runs: undying's lines at WARNING and above, or at INFO when the
    launcher was run with ``-v`` (``UNDYING_VERBOSE=1``)."""
    _own_handler(logging.INFO if env_value(VERBOSE_ENV) == "1" else logging.WARNING)
