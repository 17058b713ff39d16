"""Leaving with the state safe: the dying gasp of a preempted job, and the save of a regroup.

Preemption is agreed, not raced: Preempt -> every rank proposes the step it is
at (StopProposal) -> the manager answers the step all stop after (StopAt) ->
each rank finishes it, the state of that step is persisted once, and every
process exits. A regroup generation (``undying.rendezvous``) ends the same way:
the members hold one state, one of them saves it, all leave, and the job
starts again on its new set of nodes from that checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from undying.config import EXIT_PREEMPTED, EXIT_REGROUPED
from undying.protocol.worker_wire import Preempt, Progress, Stop, StopAt, StopProposal, Terminated
from undying.worker.context import JobContext
from undying.worker.group import is_comm_failure

if TYPE_CHECKING:
    from undying.worker.checkpoints import Checkpoints
    from undying.worker.shards import Shards
    from undying.worker.state import State

__all__ = ["Preemption", "dying_gasp", "save_and_leave"]

log = logging.getLogger("undying.worker")


class Preemption:
    """The agreement on where to stop, fed by the agent's commands and SIGTERM, read by the step
    loop."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self.preempted = False
        self._stop_at: int | None = None
        self._stop_heard = threading.Event()
        self._grace_s = 30.0
        self._stopping = False  # an ordered stop (Stop), not a preemption
        self._terminated = False

    def on_preempt(self, message: Preempt) -> None:
        ctx = self.ctx
        with self._lock:
            self.preempted = True
            proposal = ctx.current_step
        ctx.send(StopProposal(ctx.rank, ctx.generation, proposal, time.time()))

    def on_stop_at(self, message: StopAt) -> None:
        self._grace_s = message.grace_s
        with self._lock:
            self.preempted = True
            self._stop_at = message.step
        self._stop_heard.set()

    def on_stop(self, message: Stop) -> None:
        """An ordered stop: out now, as a SIGTERM would end a process without undying."""
        self._stopping = True
        self.ctx.close_channel()
        os._exit(128 + signal.SIGTERM)

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM to this worker (a kill of its group): tell the agent; the job takes its dying
        gasp."""
        if self._stopping:
            os._exit(128 + signal.SIGTERM)
        if self._terminated or self.preempted:
            return  # a dying gasp is under way
        self._terminated = True
        log.warning("rank %d: SIGTERM received; asking the job for its dying gasp", self.ctx.rank)
        # Not from the handler itself: the training thread may hold the channel's lock.
        told = Terminated(self.ctx.rank, time.time(), os.getpid())
        threading.Thread(target=self.ctx.send, args=(told,), daemon=True).start()

    def may_start(self, index: int, committed: int) -> bool:
        """Start step ``index`` unless the job is preempted and agreed to stop at ``committed``."""
        ctx = self.ctx
        with self._lock:
            if not self.preempted:
                ctx.current_step = index
                return True
        if not self._stop_heard.wait(self._grace_s):
            log.warning("rank %d: no stop step heard; stopping at step %d", ctx.rank, committed)
            self._stop_at = committed
        assert self._stop_at is not None
        if committed < self._stop_at:
            ctx.current_step = index
            return True
        return False


def dying_gasp(ctx: JobContext, state: State, step: int, checkpoints: Checkpoints,
               shards: Shards) -> None:
    """Every rank stopped at the agreed ``step``: its state is persisted (rank 0, or every rank's
    shard together), synchronously. Then exit."""
    ctx.phase = "done"
    if state.sharded:
        shards.saves.dying_gasp(state, step, ctx.data_meta(step), checkpoints.resumed)
    elif ctx.rank == 0:
        checkpoints.save_now(state, step, "dying-gasp")
    ctx.send(Progress(ctx.rank, ctx.generation, "preempt_exit", time.time(), step=step))
    ctx.exit_now(EXIT_PREEMPTED)


def save_and_leave(ctx: JobContext, state: State | None, step: int, saver: int,
                   checkpoints: Checkpoints) -> None:
    """A regroup generation: every member holds the same state now; ``saver`` (one that held it
    before the restore: a replacement that joined meanwhile may have no State yet) saves it; all
    leave.

    The job starts again on its new set of nodes from this checkpoint, so a
    resized world loses no step (see ``undying.rendezvous``). A member leaves
    only once the saver is done with its save (a collective that carries
    whether it saved): one that left earlier would take the last copy of the
    state with it if the saver died mid-save. Returns (no exit) when that
    collective failed and this member did not save: a member was lost
    meanwhile, and the manager has the members left meet again
    (``undying.manager.regroup``). A save that failed (an OS error, which the
    saver reported) is no fault of the group: every member leaves, and the
    job starts from its latest valid checkpoint.
    """
    ctx.phase = "done"
    ctx.faults.check("regroup", step)  # (tests: a second fault while the regroup saves)
    saved = state is not None and dist.get_rank() == saver \
        and checkpoints.save_now(state, step, "regroup")
    try:
        flag = torch.tensor([int(saved)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            log.warning("rank %d: the regroup's save of step %d failed; leaving all the same",
                        ctx.rank, step)
    except Exception as e:
        if not is_comm_failure(e):
            raise
        if not saved:
            ctx.abort_reason = f"the regroup's save was not confirmed: {type(e).__name__}: {e}"
            return
    ctx.send(Progress(ctx.rank, ctx.generation, "regroup_exit", time.time(), step=step))
    ctx.exit_now(EXIT_REGROUPED)
