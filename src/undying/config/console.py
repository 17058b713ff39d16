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
import sys
from typing import TextIO

from undying.inputs import env_value
from undying.protocol.env import VERBOSE_ENV

__all__ = ["SHOWN_LOG", "show_launcher_log", "show_rank_log"]

# The logger of the INFO lines a person reads whatever the level (undying.shown).
SHOWN_LOG = "undying.shown"
_FORMAT = "[undying %(asctime)s %(levelname)s] %(message)s"
_DATE = "%H:%M:%S"


def show_launcher_log(verbose: bool) -> None:
    """The log of an ``undying`` command on its stderr: WARNING and above and ``SHOWN_LOG``'s INFO
    lines, or every INFO line with ``verbose`` (``-v``)."""
    # Other libraries' lines, through the root logger, as they were.
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=_FORMAT,
                        datefmt=_DATE, stream=sys.stderr)
    _own_handler(logging.INFO if verbose else logging.WARNING)
    logging.getLogger(SHOWN_LOG).setLevel(logging.INFO)


class _OwnStderr(logging.StreamHandler[TextIO]):
    """undying's lines on the process's stderr as it is at each line (a rank's is redirected by
    worker/streams.py after this handler exists)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _own_handler(level: int) -> None:
    """The ``undying`` logger at ``level``, on its own stderr handler, never the root logger's."""
    ours = logging.getLogger("undying")
    ours.setLevel(level)
    ours.propagate = False
    if not any(isinstance(h, _OwnStderr) for h in ours.handlers):
        handler = _OwnStderr()
        handler.setFormatter(logging.Formatter(_FORMAT, _DATE))
        ours.addHandler(handler)


def show_rank_log() -> None:
    """In a rank, before its script runs: undying's lines at WARNING and above, or at INFO when the
    launcher was run with ``-v`` (``UNDYING_VERBOSE=1``)."""
    _own_handler(logging.INFO if env_value(VERBOSE_ENV) == "1" else logging.WARNING)
