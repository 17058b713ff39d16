"""A worker's process title: its job and rank, as ``ps`` and ``/proc/PID/cmdline`` show them.

Without it every rank reads ``python3 -u -m undying.worker.zygote 16 <pid>`` (or the boot's
command line), the same for every job on the machine. The title is set once, as the script is
about to run: the rank is known then (a spare's arrives with its assignment); ``prepare`` loads
the library first, as the process starts. ``setproctitle``
(a dependency of the base install) rewrites the process's argument area; where it cannot be
imported, the title stays the command line and nothing else changes.
"""

from __future__ import annotations

import contextlib
import logging
import os

from undying.protocol.env import JOB_ID_ENV

__all__ = ["title_of", "name_process", "prepare"]

log = logging.getLogger("undying.worker")


def title_of(environ: dict[str, str] | os._Environ[str], script: str) -> str:
    """``undying: job <id> rank <r>: <script>`` (``?`` for what the environment does not say)."""
    job = environ.get(JOB_ID_ENV) or "?"
    rank = environ.get("RANK") or "?"
    return f"undying: job {job} rank {rank}: {os.path.basename(script)}"


def prepare() -> None:
    """Load ``setproctitle`` while the process's argument and environment areas are still the
    ones it was started with: it finds the argument area through them, and a zygote's child has
    its environment replaced (worker/zygote.py) before it knows its rank."""
    # SPT_NOENV: the title goes in the argument area alone. Without it setproctitle moves the
    # environment to make room, and /proc/PID/environ no longer shows it: the agent finds the
    # processes a rank started (forked ones share the area) by the mark in their environment.
    # It is read once, at the first call; the script's environment stays as it was given.
    added = "SPT_NOENV" not in os.environ
    os.environ.setdefault("SPT_NOENV", "1")
    try:
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.getproctitle()  # (its first call finds the area)
    finally:
        if added:
            os.environ.pop("SPT_NOENV", None)


def name_process(script: str) -> None:
    """Set this process's title from its environment (``title_of``)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        log.debug("setproctitle is not installed: the worker keeps its command line as title")
        return
    setproctitle(title_of(os.environ, script))
