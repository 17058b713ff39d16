"""Persistent checkpoints of a replicated (DDP) state: the resume, the periodic saves, a save now.

Rank 0 writes (every rank holds the same state): a periodic save copies the
state to CPU and writes it in the background (``AsyncCheckpointer``); a save
now (dying gasp, regroup) writes synchronously, unless the checkpoint of that
step exists already. A sharded state's checkpoints are collective and live in
``worker.shards``; ``maybe_save`` sends a sharded state there.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import TYPE_CHECKING, Any

from undying.checkpoint.checks import check_compatible, tensor_shapes
from undying.checkpoint.commit import SaveResult
from undying.checkpoint.gasp import state_nbytes
from undying.checkpoint.manifest import Manifest
from undying.checkpoint.planner import PersistedState, StatePlan
from undying.checkpoint.replicated import load_replicated, save_replicated
from undying.checkpoint.room import describe_os_error, with_room
from undying.checkpoint.safe_load import refused_global
from undying.checkpoint.sharded import read_manifest
from undying.checkpoint.writer import AsyncCheckpointer, CheckpointWriteError
from undying.errors import UsageError
from undying.protocol.worker_wire import CheckpointSaved, Progress
from undying.worker import sharding
from undying.worker.context import JobContext

if TYPE_CHECKING:
    from undying.worker.shards import Shards
    from undying.worker.state import State

__all__ = ["Checkpoints"]

log = logging.getLogger("undying.worker")


class Checkpoints:
    """This rank's persistent checkpoints: what it resumed from, the writer, the size told once."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        # (step, path) of the checkpoint this process loaded.
        self.resumed: tuple[int, str] | None = None
        self.resumed_manifest: Manifest | None = None
        self._writer: AsyncCheckpointer | None = None
        self._size_sent = False

    # --- the resume --------------------------------------------------------------

    @staticmethod
    def resume_point(path: str) -> tuple[PersistedState, Manifest]:
        """The checkpoint the launcher named (``UNDYING_RESUME_FROM``), as the start's planner
        takes it, and its manifest (read, not yet verified)."""
        probe = read_manifest(path)
        return PersistedState(probe.step, path=path), probe

    def resume(self, start: StatePlan, probe: Manifest, shards: Shards) -> None:
        """Start from the checkpoint ``start`` names (verified again here: every checksum, before
        anything is loaded).

        A sharded checkpoint is loaded by ``steps()``, collectively, once the
        sharded model exists to receive it (``JobContext.deferred``); a whole
        one waits in ``JobContext.stash``.
        """
        ctx = self.ctx
        path = start.source.path
        assert start.source.kind == "checkpoint" and path, start
        if probe.layout.get("kind") == "sharded":
            self.resumed, self.resumed_manifest = (probe.step, path), probe
            ctx.deferred = (probe.step, lambda state: shards.load_checkpoint(state, path, probe))
            log.warning("rank %d: resuming from sharded checkpoint %s "
                        "(step %d, written by %d ranks)",
                        ctx.rank, path, probe.step, probe.world_size)
            return
        try:
            payload, manifest = load_replicated(path)
        except pickle.UnpicklingError as e:
            # Never loaded with weights_only=False: a checkpoint must not be able to run code.
            held = refused_global(e) or "an object that is not plain data"
            raise UsageError(
                f"checkpoint {path} holds {held}, which undying "
                "will not unpickle (weights_only=True); register the class with "
                "torch.serialization.add_safe_globals in the script if it is yours and safe"
            ) from e
        ctx.stash = (manifest.step, payload)
        self.resumed, self.resumed_manifest = (manifest.step, path), manifest
        log.warning("rank %d: resuming from checkpoint %s (step %d)", ctx.rank, path, manifest.step)

    def resumed_at(self, step: int) -> Manifest | None:
        """The manifest of the checkpoint this process resumed from, if it is of ``step``."""
        if self.resumed is not None and self.resumed[0] == step:
            return self.resumed_manifest
        return None

    def load_waiting(self, state: State, start: StatePlan, shards: Shards) -> int:
        """Carry out ``start`` once the State exists: load what waited for it (the checkpoint it
        named, or the state the members sent a replacement at its first restore); the step it
        holds."""
        ctx = self.ctx
        committed = 0
        resumed = self.resumed
        if start.source.kind == "fresh":
            assert ctx.stash is None and ctx.deferred is None, "a fresh start found a state waiting"
        if ctx.stash is not None and state.sharded:
            where = f"checkpoint {resumed[1]}" if resumed is not None else "a peer"
            error = UsageError(f"the state from {where} was saved whole (replicated), "
                               "but this model is sharded "
                               "(DTensors): resume it with the layout it was saved with")
            ctx.report_fatal(ctx.stash[0], error)
            raise error
        if ctx.deferred is not None:
            committed, load = ctx.deferred
            ctx.deferred = None
            load(state)
            ctx.current_step = committed
            if resumed is None or resumed[0] != committed:
                ctx.send(Progress(ctx.rank, ctx.generation, "state_loaded", time.time(),
                                  step=committed))
        if ctx.stash is not None:
            committed, payload = ctx.stash
            manifest = self.resumed_at(committed) if start.source.kind == "checkpoint" else None
            if manifest is not None:
                assert resumed is not None
                # Another model, or another job's checkpoint: said by name, never half-loaded.
                try:
                    check_compatible(manifest, path=resumed[1],
                                     state_shapes=tensor_shapes(state.state_dict()))
                except UsageError as e:
                    ctx.report_fatal(committed, e)
                    raise
            meta = payload.pop("_undying", {})
            origin = meta.get("data_origin")
            state.load_state_dict(payload)
            ctx.stash = None
            ctx.current_step = committed
            if manifest is not None:
                assert resumed is not None
                detail: dict[str, Any] = {"checkpoint": resumed[1],
                                          "saved_world_size": manifest.world_size}
                if shards.resume_digest:
                    detail["digest"] = sharding.full_digest(state.state_dict())
                ctx.checkpoint_loaded(manifest, detail)
            else:
                if origin is not None:
                    ctx.set_data_origin((int(origin[0]), int(origin[1])))
                # A peer's state: its donor's fingerprint and ours once loaded (the manager's
                # divergence compares).
                digests = ({"digest": state.digest(), "donor_digest": str(meta["digest"])}
                           if "digest" in meta else {})
                ctx.send(Progress(ctx.rank, ctx.generation, "state_loaded", time.time(),
                                  step=committed, detail=digests))
        return committed

    # --- periodic saves ----------------------------------------------------------

    def _checkpointer(self) -> AsyncCheckpointer:
        env = self.ctx.env
        assert env is not None
        if self._writer is None:
            cfg = env.checkpoint
            self._writer = AsyncCheckpointer(
                cfg.checkpoint_dir, job_id=env.job_id, world_size=self.ctx.world_size,
                keep=cfg.keep, if_busy="skip", on_done=self._report_save,
                on_pruned=self._report_pruned,
            )
        return self._writer

    def _report_save(self, result: SaveResult | None, error: CheckpointWriteError | None) -> None:
        """From the writer thread: the manager logs every save and every failed one."""
        ctx = self.ctx
        if result is not None:
            ctx.tracing.checkpoint_written(result.step, result.write_s, result.bytes)
            ctx.send(CheckpointSaved(ctx.rank, result.step, result.kind, result.path,
                                     result.blocking_s, result.write_s, result.bytes, time.time()))
        elif error is not None:
            ctx.send(CheckpointSaved(ctx.rank, error.step, "periodic", "", 0.0, 0.0, 0, time.time(),
                                     error=str(error), os_error=describe_os_error(error)))

    def _report_pruned(self, step: int, names: list[str]) -> None:
        """The save of ``step`` found no room and deleted older checkpoints first: the log says
        which."""
        ctx = self.ctx
        ctx.send(Progress(ctx.rank, ctx.generation, "checkpoint_room_made", time.time(), step=step,
                          detail={"removed": names}))

    def _send_size(self, state: State, index: int) -> None:
        """Once, from rank 0: what the manager sizes the dying gasp's grace period from (DTensors
        count whole)."""
        ctx = self.ctx
        if not self._size_sent and ctx.rank == 0:
            self._size_sent = True
            ctx.send(Progress(ctx.rank, ctx.generation, "state_size", time.time(), step=index,
                              detail={"bytes": state_nbytes(state.state_dict())}))

    def maybe_save(self, state: State, index: int, shards: Shards, *, last: bool = False) -> bool:
        """After a committed step that is due: rank 0 copies the state to CPU and writes it
        beside training.

        ``last``: the job's last step; its save waits for one still writing instead of being
        skipped.

        Sharded state: every rank writes its shard, together (``ShardSaves.maybe_save``).
        False: a peer failed during a collective save; the caller recovers.
        """
        ctx = self.ctx
        self._send_size(state, index)
        if state.sharded:
            return shards.saves.maybe_save(state, index, ctx.data_meta(index))
        if ctx.rank != 0:
            # Replicated state: rank 0 writes; the others' stall is recorded (about zero) so ranks
            # compare.
            if ctx.tracing.active and ctx.clock.due(index):
                ctx.clock.mark()
                with ctx.tracing.checkpoint_stall():
                    pass
            return True
        if not ctx.clock.due(index):
            return True
        ctx.clock.mark()
        with ctx.tracing.checkpoint_stall():
            self._checkpointer().save(index, state.state_dict(), generation=ctx.generation,
                                      meta=ctx.data_meta(index), last=last)
        return True

    def finish_writes(self, *, retries: bool = True) -> SaveResult | None:
        """Wait for the write in flight (and its retries, unless a dying gasp is about to write
        anyway); a failure was reported when it happened."""
        if self._writer is None:
            return None
        try:
            return self._writer.wait(retries=retries)
        except CheckpointWriteError:
            return self._writer.last_result

    # --- a save now ----------------------------------------------------------------

    def save_now(self, state: State, step: int, kind: str) -> bool:
        """Persist the whole (replicated) state of ``step`` synchronously, unless that checkpoint
        exists.

        True once it is on disk (written now, or there already).
        """
        ctx = self.ctx
        env = ctx.env
        assert env is not None
        store = self._checkpointer().store
        last = self.finish_writes(retries=False)
        if last is not None and last.step == step:
            reused: tuple[int, str] | None = (step, last.path)
        else:
            reused = self.resumed if self.resumed is not None and self.resumed[0] == step else None
        t = time.time()
        if reused is not None:
            log.warning("rank %d: %s: the checkpoint of step %d already exists: %s",
                        ctx.rank, kind, step, reused[1])
            ctx.send(CheckpointSaved(ctx.rank, step, "existing", reused[1], 0.0, 0.0, 0, t))
            return True
        try:
            result = with_room(store, lambda: save_replicated(
                store, step, state.state_dict(), job_id=env.job_id, generation=ctx.generation,
                world_size=ctx.world_size, kind=kind, keep=env.checkpoint.keep,
                meta=ctx.data_meta(step),
            ), on_pruned=lambda names: self._report_pruned(step, names))
            ctx.send(CheckpointSaved(ctx.rank, step, kind, result.path, 0.0, result.write_s,
                                     result.bytes, time.time()))
            return True
        except Exception as e:
            # A full disk, a lost mount: reported; the latest valid checkpoint stands.
            log.error("rank %d: %s checkpoint of step %d failed: %s", ctx.rank, kind, step, e)
            ctx.send(CheckpointSaved(ctx.rank, step, kind, "", 0.0, time.time() - t, 0, time.time(),
                                     error=f"{type(e).__name__}: {e}",
                                     os_error=describe_os_error(e)))
            return False
