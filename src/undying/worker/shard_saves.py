"""A sharded state's DCP checkpoints, by every rank together: periodic ones in the background,
the dying gasp.

``Shards`` (``worker.shards``) owns one: a save is collective
(``save_sharded``: every rank writes its own files through
torch.distributed.checkpoint, rank 0 commits the manifest and reports it).
A periodic save copies the shard to CPU (``stage``: the loop's only stall)
and writes it from a thread, over a gloo group of its own; a dying gasp is
written at once, unless a checkpoint of its step exists. Loading one is a
restore's move, and stays in ``worker.shards``.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from undying.checkpoint.commit import SaveResult
from undying.checkpoint.sharded import save_sharded
from undying.protocol.worker_wire import CheckpointSaved
from undying.worker.context import JobContext
from undying.worker.group import is_comm_failure

if TYPE_CHECKING:
    from undying.worker.state import State

__all__ = ["ShardSaves", "stage"]

log = logging.getLogger("undying.worker")


class ShardSaves:
    """One job's sharded checkpoints: when they are due, their writer thread, the newest one
    written."""

    def __init__(self, ctx: JobContext, shape: Callable[[State], dict[str, Any]]) -> None:
        self.ctx = ctx
        self._shape = shape  # the state as DCP saves it (Shards.dcp_state_dict)
        self.last_save: SaveResult | None = None  # the newest sharded checkpoint this job wrote
        # The background writer of periodic sharded checkpoints, and the gloo group it uses.
        self._writer: threading.Thread | None = None
        self._group: dist.ProcessGroup | None = None
        self._group_generation = -1

    def maybe_save(self, state: State, index: int, meta: dict[str, Any]) -> bool:
        """After a committed step: start a background save when due. False: a peer failed (recover).

        Every rank must start a save or none: the decision is one all-reduce
        of (due, busy) when it could go either way -- a clock (``--save-interval``)
        is per rank, and a rank's previous write may still run while another's
        is done. A save due while one is still written is skipped by all.
        """
        ctx = self.ctx
        assert ctx.env is not None
        cfg = ctx.env.checkpoint
        try:
            due = ctx.clock.due(index)
            if cfg.save_interval <= 0 and not due:
                return True
            flags = torch.tensor([int(due), int(self.writing)], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if not flags[0]:
                return True
            ctx.clock.mark()
            if flags[1]:
                if ctx.rank == 0:
                    log.info("sharded checkpoint of step %d skipped: the previous one is still "
                             "being written", index)
                return True
            with ctx.tracing.checkpoint_stall():
                self._start_save(state, index, meta)
        except Exception as e:
            if not is_comm_failure(e):
                raise
            ctx.aborted(e)
            return False
        return True

    @property
    def writing(self) -> bool:
        thread = self._writer
        return thread is not None and thread.is_alive()

    def _checkpoint_group(self) -> dist.ProcessGroup:
        """A gloo group of its own for the writer thread's collectives (a collective itself:
        every rank, now).

        The training thread keeps the default group; two threads must never
        share one group. Built once per generation: a new generation destroys
        every group of the old one.
        """
        if self._group is None or self._group_generation != self.ctx.generation:
            self._group = dist.new_group(backend="gloo")
            self._group_generation = self.ctx.generation
        return self._group

    def _start_save(self, state: State, step: int, meta: dict[str, Any]) -> None:
        """Copy this rank's shard to CPU (the loop's only stall) and write it in a thread, with
        the others."""
        ctx = self.ctx
        assert ctx.env is not None
        group = self._checkpoint_group()
        started = time.perf_counter()
        snapshot = stage(self._shape(state))
        blocking = time.perf_counter() - started
        env, generation = ctx.env, ctx.generation

        def write() -> None:
            t0 = time.time()
            try:
                result = save_sharded(
                    env.checkpoint.checkpoint_dir, step, snapshot, group=group, job_id=env.job_id,
                    generation=generation, kind="periodic", keep=env.checkpoint.keep, meta=meta,
                    layout_extra={"world_size": ctx.world_size},
                )
            # a peer gone mid-write, a full disk: reported; the latest valid one stands
            except Exception as e:
                log.error("rank %d: sharded checkpoint of step %d failed: %s", ctx.rank, step, e)
                if ctx.rank == 0:
                    ctx.send(CheckpointSaved(0, step, "periodic", "", blocking, time.time() - t0, 0,
                                              time.time(), error=f"{type(e).__name__}: {e}"))
                return
            self.last_save = result
            if ctx.rank == 0:
                ctx.tracing.checkpoint_written(result.step, result.write_s, result.bytes)
                ctx.send(CheckpointSaved(0, step, "periodic", result.path, blocking,
                                          result.write_s, result.bytes, time.time()))

        self._writer = threading.Thread(target=write, name="undying-sharded-ckpt", daemon=True)
        self._writer.start()

    def finish_writes(self, timeout: float | None = None) -> None:
        """Wait for the write in flight: before the group it uses is destroyed, a dying gasp, or
        the end."""
        thread = self._writer
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            log.error("rank %d: the sharded checkpoint write still runs after %.0fs; going on "
                      "without it", self.ctx.rank, timeout or 0)
            return
        self._writer = None

    def save(self, state: State, step: int, kind: str, meta: dict[str, Any]) -> SaveResult | None:
        """Collective ``save_sharded``; rank 0 reports it (or its failure) to the manager."""
        ctx = self.ctx
        assert ctx.env is not None
        started = time.time()
        try:
            result = save_sharded(
                ctx.env.checkpoint.checkpoint_dir, step, self._shape(state), job_id=ctx.env.job_id,
                generation=ctx.generation, kind=kind, keep=ctx.env.checkpoint.keep, meta=meta,
                layout_extra={"world_size": ctx.world_size},
            )
        except Exception as e:
            if is_comm_failure(e):
                raise
            log.error("rank %d: sharded checkpoint of step %d failed: %s", ctx.rank, step, e)
            if ctx.rank == 0:
                ctx.send(CheckpointSaved(0, step, kind, "", 0.0, time.time() - started, 0,
                                          time.time(), error=f"{type(e).__name__}: {e}"))
            return None
        self.last_save = result
        if ctx.rank == 0:
            ctx.tracing.checkpoint_written(result.step, result.write_s, result.bytes)
            ctx.send(CheckpointSaved(0, step, kind, result.path, result.blocking_s, result.write_s,
                                      result.bytes, time.time()))
        return result

    def dying_gasp(self, state: State, step: int, meta: dict[str, Any],
                   resumed: tuple[int, str] | None) -> None:
        """Every rank stopped at ``step``: save it together, unless a checkpoint of it exists."""
        ctx = self.ctx
        self.finish_writes()  # a periodic save of this very step may be the dying gasp already
        existing = (self.last_save.path
                    if self.last_save is not None and self.last_save.step == step
                    else resumed[1] if resumed is not None and resumed[0] == step else None)
        if existing is not None:
            if ctx.rank == 0:
                log.warning("rank 0: dying gasp: the checkpoint of step %d already exists: %s",
                            step, existing)
                ctx.send(CheckpointSaved(0, step, "existing", existing, 0.0, 0.0, 0, time.time()))
            return
        try:
            self.save(state, step, "dying-gasp", meta)
        except Exception as e:  # a peer gone mid-save: the latest valid checkpoint stands
            log.error("rank %d: dying-gasp checkpoint of step %d failed: %s", ctx.rank, step, e)
            if ctx.rank == 0:
                ctx.send(CheckpointSaved(0, step, "dying-gasp", "", 0.0, 0.0, 0, time.time(),
                                          error=f"{type(e).__name__}: {e}"))


def stage(obj: Any) -> Any:
    """A private CPU copy of a state dict for the writer thread: DTensors stay DTensors (local
    data cloned)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: stage(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [stage(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(stage(v) for v in obj)
    return copy.deepcopy(obj)
