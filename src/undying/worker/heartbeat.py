"""The heartbeat: this process's beats to its agent, each with where the training thread stands.

Run by a thread ``Job`` starts (stopped at exit: see ``worker.threads``).
The beats stop when the process is stopped or its interpreter is stuck; the
progress they carry stops when the training thread is.
"""

from __future__ import annotations

import threading
import time

from undying.protocol.worker_wire import Heartbeat
from undying.worker.context import JobContext
from undying.worker.group import collectives_entered

__all__ = ["beat"]


def beat(ctx: JobContext, stopped: threading.Event) -> None:
    """Heartbeats with progress: they stop when the process is stopped or its
    interpreter is stuck, and their progress stops when the training thread is.

    Progress is sampled four times a second, so its time is exact to a
    quarter second whatever the beat interval.
    """
    assert ctx.env is not None
    interval = min(0.5, max(0.05, ctx.env.timeouts.heartbeat_timeout / 5))
    sample = min(0.25, interval)
    last: tuple[int, str, int, int] | None = None
    read = 0  # batches the loader gave: a replacement replaying its loader moves, not stuck
    progress_t = time.time()
    next_beat = 0.0
    while not stopped.wait(sample):
        now = time.time()
        key = (ctx.generation, ctx.phase, ctx.current_step,
               collectives_entered() - ctx.collectives_base)
        changed_phase = last is not None and key[:2] != last[:2]
        fetched = ctx.cursor.fetched if ctx.cursor is not None else 0
        if key != last or fetched != read:
            last, read, progress_t = key, fetched, now
        # A new phase is told at once: "I left the stuck group".
        if now >= next_beat or changed_phase:
            next_beat = now + interval - sample / 2
            ctx.send(Heartbeat(ctx.rank, now, *key, progress_t=progress_t))
