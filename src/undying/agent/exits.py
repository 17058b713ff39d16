"""A worker's exit after its script returned: done, however the exit itself went.

The worker's boot marks the moment the script returned (a file in the process's folder,
``config.worker_dir``) and arms a timer: a process still there ``--exit-grace`` seconds later (a
thread that never ends, a deadlock in an atexit handler or in a library's teardown) has every
thread's stack written to its log (faulthandler's watchdog thread, which needs no interpreter lock)
and is ended by SIGALRM half a second later, which needs no lock either. The agent then reports the
rank as finished (exit 0 to the manager): its work is done and the job's result stands; the stuck
exit is noted in the job's log (``exit_stuck``, or ``exit_after_return`` for another non-zero end
after the script returned).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from undying.config import RETURNED_FILE, JobConfig, worker_dir

__all__ = ["returned_exit"]

log = logging.getLogger("undying.agent")


def returned_exit(config: JobConfig, rank: int, incarnation: int, pid: int, returncode: int,
                  note: Callable[..., None]) -> int:
    """The exit code the manager hears for ``rank``'s process: 0 when its script had returned."""
    marker = os.path.join(worker_dir(config.job_dir, rank, incarnation), RETURNED_FILE)
    if not os.path.exists(marker):
        return returncode
    with contextlib.suppress(OSError):
        os.unlink(marker)
    if returncode == 0:
        return 0
    grace = config.timeouts.exit_grace
    if returncode == -signal.SIGALRM:
        log.warning("rank %d (pid %d): its script returned, but the process was still in its exit "
                    "%gs later (--exit-grace): ended, every thread's stack is in its log just "
                    "before; the rank's result stands", rank, pid, grace)
        what = "exit_stuck"
    else:
        log.info("rank %d (pid %d): its script returned, then the process ended with %d; "
                 "the rank's result stands", rank, pid, returncode)
        what = "exit_after_return"
    detail: dict[str, Any] = {"rank": rank, "returncode": returncode, "exit_grace_s": grace}
    note(what, pid, **detail)
    return 0


async def heard_to_the_end(line_open: Callable[[], bool], limit_s: float = 0.5) -> None:
    """Until a dead process's line to the agent is read to its end (bounded by ``limit_s``).

    The agent sees an exit at once (a pidfd), while the process's last reports
    (a planned move's boundary, a commit) may still wait in its socket: read
    first, they reach the manager before its exit does, in the order they left it.
    """
    deadline = time.monotonic() + limit_s
    while line_open() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
