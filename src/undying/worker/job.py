"""The worker library's entry points: ``init``, ``Job.steps`` and the step transaction.

A step is a transaction. Its body runs inside ``with step:``; if a peer fails
the body's collective raises, the transaction swallows the error, and the step
loop recovers in place: it leaves the broken process group, joins the next
generation, agrees with the other members on the newest state someone holds
cleanly, receives it if it lacks it, and runs the next step. The process never
exits and never reads a checkpoint from disk. An exception that is not a
communication failure is the user's bug: it is reported with its traceback and
propagates, so the process exits and the manager's policy decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from undying.checkpoint import (
    AsyncCheckpointer,
    CheckpointWriteError,
    Manifest,
    SaveResult,
    check_compatible,
    load_replicated,
    save_replicated,
    state_nbytes,
    tensor_shapes,
)
from undying.checkpoint.mac import key_from_environ, set_key
from undying.checkpoint.room import describe_os_error, with_room
from undying.checkpoint.safe_load import check_state_loadable, refused_global
from undying.checkpoint.sharded import read_manifest
from undying.config import EXIT_FENCED, EXIT_PREEMPTED, EXIT_REGROUPED
from undying.errors import ControlStoreLostError, FencedError, RecoveryError, UsageError
from undying.protocol.codec import Message
from undying.protocol.generations import generation_key
from undying.protocol.store_client import JobStore
from undying.protocol.store_wire import CONTROL_STORE
from undying.protocol.worker_wire import (
    Abort,
    ArmFault,
    CheckpointSaved,
    CommFailure,
    Done,
    Fatal,
    Heartbeat,
    Hello,
    Preempt,
    Progress,
    StepCommitted,
    Stop,
    StopAt,
    StopProposal,
    Terminated,
    TraceSet,
)
from undying.worker import rng
from undying.worker.channel import AgentChannel
from undying.worker.data import DataCursor, map_position
from undying.worker.ddp import GenerationalDDP
from undying.worker.env import WorkerEnv
from undying.worker.faults import FaultSwitch, block_forever, crash_self, spin_forever, stop_self
from undying.worker.group import (
    break_connections,
    claim_existing_sockets,
    collectives_entered,
    is_comm_failure,
    join_generation,
    leave_group,
)
from undying.worker.restore import (
    MODE_REPLICATED,
    MODE_SHARDED,
    RankStatus,
    RestorePlan,
    exchange_statuses,
    plan_restore,
    recv_state,
    send_state,
)
from undying.worker.sharding import rebind_groups, reset_after_failure
from undying.worker.shards import Shards
from undying.worker.state import State
from undying.worker.threads import StoppedAtExit
from undying.worker.tracing import WorkerTracing

__all__ = ["init", "Job", "Step"]

log = logging.getLogger("undying.worker")

_job: Job | None = None


def init() -> Job:
    """Join the job and set up ``torch.distributed`` for its current generation.

    Call it once, near the top of the script, before building samplers that
    ask ``torch.distributed`` for the rank. Safe to call after the script's own
    ``init_process_group``. Outside ``undying run`` it returns an unmanaged job
    (plain ``torchrun`` or ``python``) that trains without fault tolerance.
    """
    global _job
    if _job is None:
        env = WorkerEnv.from_environ()
        _job = Job(env)
    return _job


def _prewarm_imports() -> None:
    """Import in the background what a replacement's first restore and step import lazily.

    ``optimizer.load_state_dict`` and the first optimizer step import
    ``torch._dynamo`` (seconds on a small machine); started now, the import
    overlaps the rendezvous and the transfer, which wait on the network.
    """

    def target(stopped: threading.Event) -> None:
        try:
            importlib.import_module("torch._dynamo")
        except Exception as e:  # only an optimization
            log.debug("prewarming torch._dynamo failed: %s", e)

    # A job that ends first waits for the import at exit: it runs torch code that releases the GIL.
    StoppedAtExit(target, name="undying-prewarm", join_s=30)


class Outcome(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    ABORTED = "aborted"
    FAILED = "failed"


class Step:
    """One training step as a transaction: ``with step:`` around its body."""

    def __init__(self, job: Job, index: int, epoch: int, batch: Any) -> None:
        self.index = index
        self.epoch = epoch
        self.batch = batch
        self.generation = job.generation
        self.metrics: dict[str, float] = {}
        self.outcome = Outcome.PENDING
        self.optimizer_stepped = False
        self._job = job

    def log(self, **metrics: float | torch.Tensor) -> None:
        """Record values of this step (e.g. ``loss=loss``); committed with the step."""
        for name, value in metrics.items():
            self.metrics[name] = float(value.item() if isinstance(value, torch.Tensor) else value)

    def __enter__(self) -> Step:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            if self._job._replicate_before_commit(self):
                self.outcome = Outcome.COMMITTED
                self._job._commit(self)
            return False
        if self._job.managed and is_comm_failure(exc):
            self.outcome = Outcome.ABORTED
            self._job._abort_reason = f"{type(exc).__name__}: {exc}"
            return True
        self.outcome = Outcome.FAILED
        if isinstance(exc, Exception):
            self._job._report_fatal(self.index, exc)
        return False

    def __repr__(self) -> str:
        return f"Step(index={self.index}, epoch={self.epoch}, generation={self.generation})"


class Job:
    """This process's membership in an undying job."""

    def __init__(self, env: WorkerEnv | None) -> None:
        self.env = env
        self.managed = env is not None
        if self.managed:
            set_key(key_from_environ())  # checkpoints signed and checked under the job's key (checkpoint.mac)
        self.current_step = 0
        self._state_checked = False  # the state's weights_only round trip, done at the first commit
        self._wrappers: list[GenerationalDDP] = []
        self._stash: tuple[int, dict[str, Any]] | None = None
        self._abort_reason = ""
        self._current: Step | None = None
        # What the heartbeats report: init until this process completes a step,
        # and the collectives entered since the group's state was restored
        # (the transfer's point-to-point sends count on their two ends only).
        self._phase = "init"
        self._collectives_base = 0
        # Persistent checkpoints (rank 0 writes; the state is replicated under DDP).
        self._ckpt: AsyncCheckpointer | None = None
        self._last_save_t = time.monotonic()
        self._size_sent = False
        self._resumed: tuple[int, str] | None = None  # (step, path) of the checkpoint this process loaded
        self._resumed_manifest: Manifest | None = None
        # The dying gasp: Preempt -> StopProposal -> StopAt(step) -> finish it, rank 0 saves, exit.
        self._preempt_lock = threading.Lock()
        self._preempted = False
        self._stop_at: int | None = None
        self._stop_heard = threading.Event()
        self._stop_grace_s = 30.0
        self._stopping = False  # an ordered stop (Stop), not a preemption
        self._terminated = False
        # Sharded state (FSDP2): DCP checkpoints by every rank, ring replicas, restore by shards.
        self._shards = Shards(self)
        self._state: State | None = None
        # A load that needs the State (a sharded checkpoint, a shard received before the model existed).
        self._deferred: tuple[int, Callable[[State], None]] | None = None
        # Where the data stands: (step, batches read per rank after it); see DataCursor.origin.
        self._data_origin: tuple[int, int] | None = None
        self._cursor: DataCursor | None = None
        if env is None:
            self._start_unmanaged()
            return
        if dist.is_initialized():
            claim_existing_sockets()
        self.rank = env.rank
        self.local_rank = env.local_rank
        self.world_size = env.world_size
        self.generation = env.generation
        self._purpose = ""  # of the generation joined last (see GenerationRecord.purpose)
        self.tracing = WorkerTracing(env, self.rank, self._send)
        self._faults = FaultSwitch(
            self.rank, self._send,
            {"crash": crash_self, "hang": stop_self, "hang:spin": spin_forever,
             "hang:block": block_forever, "comm-error": break_connections},
        )
        self._channel = AgentChannel(env.agent_host, env.agent_port, self._on_command)
        self._control: dist.Store = JobStore(env.control_host, env.control_port, CONTROL_STORE, env.store_key,
                                             timedelta(seconds=env.timeouts.rendezvous))
        self._send(Hello(self.rank, os.getpid(), self.generation, env.joining, time.time()))
        # Stopped at exit: it calls into torch (see undying.worker.threads).
        StoppedAtExit(self._beat, name="undying-heartbeat")
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if env.resume_from and not env.joining:
            self._load_checkpoint(env.resume_from)
        if env.joining:
            _prewarm_imports()
            # A script that built its own group joined this generation already.
            self._join_as_replacement(adopt=dist.is_initialized())
        elif dist.is_initialized():
            self._adopt_user_group()
        else:
            self._join(self.generation)

    # --- public API --------------------------------------------------------

    def state(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              scheduler: Any = None, loader: Any = None, **extras: Any) -> State:
        """Declare what must survive a fault (see ``undying.State``)."""
        return State(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, **extras)

    def ddp(self, module: torch.nn.Module, **ddp_kwargs: Any) -> GenerationalDDP:
        """A DDP wrapper rebuilt on every new process-group generation."""
        wrapper = GenerationalDDP(self, module, **ddp_kwargs)
        self._wrappers.append(wrapper)
        return wrapper

    def span(self, kind: str, **fields: Any) -> contextlib.AbstractContextManager[Any]:
        """A marker around user code: ``with job.span("comm", name="all_gather", bytes=n):``.

        ``kind`` is one of step, comm, ckpt, fp, data; it records only while that
        kind is switched on (``undying trace``), and costs a flag test otherwise.
        """
        return self.tracing.tracer.span(kind, **fields)

    def steps(
        self,
        state: State,
        *,
        total: int | None = None,
        epochs: int | None = None,
        seed: int = 0,
    ) -> Iterator[Step]:
        """Yield the job's steps from where it is, each a transaction.

        ``total`` counts steps; ``epochs`` counts passes over ``state.loader``
        (the loop calls ``sampler.set_epoch``). ``seed`` seeds the random state
        of every step (derived per rank and step, see ``undying.worker.rng``).
        """
        if not isinstance(state, State):
            raise UsageError(f"job.steps() needs an undying.State, got {type(state).__name__}")
        cursor = DataCursor(state.loader, rank=self.rank, seed=seed, total=total, epochs=epochs,
                            origin=self._data_origin)
        self._cursor = cursor
        self._state = state
        self._attach(state)
        if self.managed and self.rank == 0:
            self._send(Progress(self.rank, self.generation, "state_layout", time.time(),
                                detail=self._shards.layout(state)))
        committed = 0
        if self._stash is not None and state.sharded:
            where = f"checkpoint {self._resumed[1]}" if self._resumed is not None else "a peer"
            error = UsageError(f"the state from {where} was saved whole (replicated), but this model is sharded "
                               "(DTensors): resume it with the layout it was saved with")
            self._report_fatal(self._stash[0], error)
            raise error
        if self._deferred is not None:
            committed, load = self._deferred
            self._deferred = None
            load(state)
            self.current_step = committed
            if self._resumed is None or self._resumed[0] != committed:
                self._send(Progress(self.rank, self.generation, "state_loaded", time.time(), step=committed))
        if self._stash is not None:
            committed, payload = self._stash
            if self._resumed_manifest is not None and self._resumed is not None and self._resumed[0] == committed:
                # Another model, or another job's checkpoint: said by name, never half-loaded.
                try:
                    check_compatible(self._resumed_manifest, path=self._resumed[1],
                                     state_shapes=tensor_shapes(state.state_dict()))
                except UsageError as e:
                    self._report_fatal(committed, e)
                    raise
            origin = payload.pop("_undying", {}).get("data_origin")
            state.load_state_dict(payload)
            self._stash = None
            self.current_step = committed
            if self._resumed is not None and self._resumed[0] == committed and self._resumed_manifest is not None:
                detail: dict[str, Any] = {"checkpoint": self._resumed[1],
                                          "saved_world_size": self._resumed_manifest.world_size}
                if self._shards.resume_digest:
                    from undying.worker.sharding import full_digest

                    detail["digest"] = full_digest(state.state_dict())
                self._on_checkpoint_loaded(self._resumed_manifest, detail)
            else:
                if origin is not None:
                    self._set_data_origin((int(origin[0]), int(origin[1])))
                self._send(Progress(self.rank, self.generation, "state_loaded", time.time(), step=committed))
        if self.managed and state.sharded and not self._shards.replicate_initial(state, committed):
            committed = self._recover(state, committed, clean=True)
        while True:
            while committed < cursor.total_steps:
                index = committed + 1
                if not self._may_start(index, committed):
                    self._dying_gasp(state, committed)
                self.tracing.step_started(index, self.generation)
                batch = self.tracing.batch(cursor.batch_for, index) if self.tracing.active \
                    else cursor.batch_for(index)
                rng.reseed(seed, self.rank, "body", index)
                if self.managed:
                    self._faults.check("step", index)
                step = Step(self, index, cursor.epoch_of(index), batch)
                self._current = step
                yield step
                if step.outcome is Outcome.COMMITTED:
                    committed = index
                    if not self._state_checked:
                        self._check_state_loadable(state, index)
                    cursor.forget_through(index)
                    if self.managed and not self._maybe_save(state, index):
                        committed = self._recover(state, committed, clean=True)
                elif step.outcome is Outcome.ABORTED:
                    committed = self._recover(state, committed, clean=not step.optimizer_stepped)
                else:
                    raise UsageError(
                        f"step {index} was not run as a transaction: put its body inside `with step:`"
                    )
            if self._finished(state, committed):
                break
            committed = self._recover(state, committed, clean=True)
        if self.managed:
            self._phase = "done"
            if self._ckpt is not None:
                self._finish_writes()
            self._shards.finish_writes()
            self.tracing.close()
            self._send(Done(self.rank, committed, state.digest(), time.time()))

    # --- the transaction's hooks --------------------------------------------

    def _attach(self, state: State) -> None:
        """Know when the optimizer steps: a step that fails after it leaves the state torn."""
        if state.optimizer is not None:
            state.optimizer.register_step_pre_hook(self._before_optimizer_step)
        if state.sharded:
            self._shards.attach(state)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._shards.quiet:
            return  # torch creating optimizer state for a sharded save or load: no training step
        step = self._current
        if step is not None and step.outcome is Outcome.PENDING:
            step.optimizer_stepped = True
        if self.managed:
            self._faults.check("optimizer", self.current_step)

    def _commit(self, step: Step) -> None:
        self._phase = "step"
        self.tracing.committed(step.index)
        if self.managed:
            self._send(StepCommitted(self.rank, self.generation, step.index, time.time(), step.metrics))

    def _check_state_loadable(self, state: State, index: int) -> None:
        """Once, at the first commit: a state that weights_only=True would refuse fails now, by name."""
        self._state_checked = True
        try:
            check_state_loadable({**state.state_dict(), "_undying": {"data_origin": self._data_origin}})
        except UsageError as e:
            self._report_fatal(index, e)
            raise

    def _report_fatal(self, index: int, exc: Exception) -> None:
        if self.managed:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self._send(Fatal(self.rank, index, f"{type(exc).__name__}: {exc}", text, time.time()))

    def _finished(self, state: State, committed: int) -> bool:
        """Every member must reach the end: a barrier, recovered like any step."""
        if not self.managed or not dist.is_initialized():
            return True
        try:
            dist.barrier()
            return True
        except Exception as e:
            if not is_comm_failure(e):
                raise
            self._abort_reason = f"{type(e).__name__}: {e}"
            return False

    # --- persistent checkpoints ---------------------------------------------

    def _load_checkpoint(self, path: str) -> None:
        """Start from a checkpoint (verified again here: every checksum, before anything is loaded).

        A sharded checkpoint is loaded by ``steps()``, collectively, once the
        sharded model exists to receive it.
        """
        probe = read_manifest(path)
        if probe.layout.get("kind") == "sharded":
            self._resumed = (probe.step, path)
            self._resumed_manifest = probe
            self._deferred = (probe.step, lambda state: self._shards.load_checkpoint(state, path, probe))
            log.warning("rank %d: resuming from sharded checkpoint %s (step %d, written by %d ranks)",
                        self.rank, path, probe.step, probe.world_size)
            return
        try:
            payload, manifest = load_replicated(path)
        except pickle.UnpicklingError as e:
            # Never loaded with weights_only=False: a checkpoint must not be able to run code.
            raise UsageError(
                f"checkpoint {path} holds {refused_global(e) or 'an object that is not plain data'}, which undying "
                "will not unpickle (weights_only=True); register the class with "
                "torch.serialization.add_safe_globals in the script if it is yours and safe"
            ) from e
        self._stash = (manifest.step, payload)
        self._resumed = (manifest.step, path)
        self._resumed_manifest = manifest
        log.warning("rank %d: resuming from checkpoint %s (step %d)", self.rank, path, manifest.step)

    def _checkpointer(self) -> AsyncCheckpointer:
        assert self.env is not None
        if self._ckpt is None:
            cfg = self.env.checkpoint
            self._ckpt = AsyncCheckpointer(
                cfg.dir, job_id=self.env.job_id, world_size=self.world_size, keep=cfg.keep,
                if_busy="skip", on_done=self._report_save, on_pruned=self._report_pruned,
            )
        return self._ckpt

    def _report_save(self, result: SaveResult | None, error: CheckpointWriteError | None) -> None:
        """From the writer thread: the manager logs every save and every failed one."""
        if result is not None:
            self.tracing.checkpoint_written(result.step, result.write_s, result.bytes)
            self._send(CheckpointSaved(self.rank, result.step, result.kind, result.path, result.blocking_s,
                                       result.write_s, result.bytes, time.time()))
        elif error is not None:
            self._send(CheckpointSaved(self.rank, error.step, "periodic", "", 0.0, 0.0, 0, time.time(),
                                       error=str(error), os_error=describe_os_error(error)))

    def _report_pruned(self, step: int, names: list[str]) -> None:
        """The save of ``step`` found no room and deleted older checkpoints first: the log says which."""
        self._send(Progress(self.rank, self.generation, "checkpoint_room_made", time.time(), step=step,
                            detail={"removed": names}))

    def _maybe_save(self, state: State, index: int) -> bool:
        """After a committed step that is due: rank 0 copies the state to CPU and writes it beside training.

        Sharded state: every rank writes its shard, together (``Shards.maybe_save``).
        False: a peer failed during a collective save; the caller recovers.
        """
        assert self.env is not None
        if state.sharded:
            if not self._size_sent and self.rank == 0:
                self._size_sent = True  # DTensors count whole: the checkpoint's total size
                self._send(Progress(self.rank, self.generation, "state_size", time.time(), step=index,
                                    detail={"bytes": state_nbytes(state.state_dict())}))
            return self._shards.maybe_save(state, index, self._data_meta(index))
        if self.rank != 0:
            # Replicated state: rank 0 writes; the others' stall is recorded (about zero) so ranks compare.
            if self.tracing.active and self._save_due(index):
                self._last_save_t = time.monotonic()
                with self.tracing.checkpoint_stall():
                    pass
            return True
        if not self._size_sent:  # what the manager sizes the dying gasp's grace period from
            self._size_sent = True
            self._send(Progress(self.rank, self.generation, "state_size", time.time(), step=index,
                                detail={"bytes": state_nbytes(state.state_dict())}))
        if not self._save_due(index):
            return True
        self._last_save_t = time.monotonic()
        with self.tracing.checkpoint_stall():
            self._checkpointer().save(index, state.state_dict(), generation=self.generation,
                                      meta=self._data_meta(index))
        return True

    def _data_meta(self, step: int) -> dict[str, Any]:
        """What a checkpoint records of the data position, so a resume on another world size maps it."""
        cursor = self._cursor
        if cursor is None:
            return {}
        return {"data": {"position": cursor.position(step), "steps_per_epoch": cursor.steps_per_epoch,
                         "world_size": self.world_size}}

    def _set_data_origin(self, origin: tuple[int, int]) -> None:
        self._data_origin = origin
        if self._cursor is not None:
            self._cursor.set_origin(origin)

    def _on_checkpoint_loaded(self, manifest: Manifest, detail: dict[str, Any]) -> None:
        """A checkpoint is loaded: place the data where it left it (mapped when the world size changed)."""
        data = manifest.meta.get("data") or {}
        position = int(data.get("position", manifest.step))
        saved_spe = data.get("steps_per_epoch")
        spe = self._cursor.steps_per_epoch if self._cursor is not None else None
        if saved_spe and spe and int(saved_spe) != spe:
            mapped = map_position(position, int(saved_spe), spe)
            detail["data_position"] = {"saved": position, "saved_steps_per_epoch": int(saved_spe),
                                       "now": mapped, "steps_per_epoch": spe}
            if self.rank == 0:
                log.warning("resumed on %d ranks from a checkpoint of %d: the data position of %d batches of %d "
                            "per epoch is %d of %d here", self.world_size, manifest.world_size, position,
                            int(saved_spe), mapped, spe)
            position = mapped
        self._set_data_origin((manifest.step, position))
        self._send(Progress(self.rank, self.generation, "state_restored", time.time(), step=manifest.step,
                            detail=detail))

    def _save_due(self, index: int) -> bool:
        assert self.env is not None
        cfg = self.env.checkpoint
        return (cfg.save_every > 0 and index % cfg.save_every == 0) or (
            cfg.save_interval > 0 and time.monotonic() - self._last_save_t >= cfg.save_interval
        )

    def _finish_writes(self, *, retries: bool = True) -> SaveResult | None:
        """Wait for the write in flight (and its retries, unless a dying gasp is about to write anyway);
        a failure was reported when it happened."""
        assert self._ckpt is not None
        try:
            return self._ckpt.wait(retries=retries)
        except CheckpointWriteError:
            return self._ckpt.last_result

    # --- the dying gasp -----------------------------------------------------

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM to this worker (a kill of its group): tell the agent; the job takes its dying gasp."""
        if self._stopping:
            os._exit(128 + signal.SIGTERM)
        if self._terminated or self._preempted:
            return  # a dying gasp is under way
        self._terminated = True
        log.warning("rank %d: SIGTERM received; asking the job for its dying gasp", self.rank)
        # Not from the handler itself: the training thread may hold the channel's lock.
        threading.Thread(target=self._send, args=(Terminated(self.rank, time.time()),), daemon=True).start()

    def _may_start(self, index: int, committed: int) -> bool:
        """Start step ``index`` unless the job is preempted and agreed to stop at ``committed``."""
        with self._preempt_lock:
            if not self._preempted:
                self.current_step = index
                return True
        if not self._stop_heard.wait(self._stop_grace_s):
            log.warning("rank %d: no stop step heard; stopping at step %d", self.rank, committed)
            self._stop_at = committed
        assert self._stop_at is not None
        if committed < self._stop_at:
            self.current_step = index
            return True
        return False

    def _dying_gasp(self, state: State, step: int) -> None:
        """Every rank stopped at the agreed ``step``; rank 0 persists it, synchronously. Then exit."""
        assert self.env is not None
        self._phase = "done"
        if state.sharded:
            self._shards.dying_gasp(state, step, self._data_meta(step), self._resumed)
        elif self.rank == 0:
            self._save_now(state, step, "dying-gasp")
        self._send(Progress(self.rank, self.generation, "preempt_exit", time.time(), step=step))
        self._exit_now(EXIT_PREEMPTED)

    def _save_now(self, state: State, step: int, kind: str) -> bool:
        """Persist the whole (replicated) state of ``step`` synchronously, unless that checkpoint exists.

        True once it is on disk (written now, or there already).
        """
        assert self.env is not None
        ckpt = self._checkpointer()
        last = self._finish_writes(retries=False)
        if last is not None and last.step == step:
            reused: tuple[int, str] | None = (step, last.path)
        else:
            reused = self._resumed if self._resumed is not None and self._resumed[0] == step else None
        t = time.time()
        if reused is not None:
            log.warning("rank %d: %s: the checkpoint of step %d already exists: %s", self.rank, kind, step, reused[1])
            self._send(CheckpointSaved(self.rank, step, "existing", reused[1], 0.0, 0.0, 0, t))
            return True
        env = self.env
        try:
            result = with_room(ckpt.store, lambda: save_replicated(
                ckpt.store, step, state.state_dict(), job_id=env.job_id, generation=self.generation,
                world_size=self.world_size, kind=kind, keep=env.checkpoint.keep,
                meta=self._data_meta(step),
            ), on_pruned=lambda names: self._report_pruned(step, names))
            self._send(CheckpointSaved(self.rank, step, kind, result.path, 0.0, result.write_s,
                                       result.bytes, time.time()))
            return True
        except Exception as e:
            log.error("rank %d: %s checkpoint of step %d failed: %s", self.rank, kind, step, e)
            self._send(CheckpointSaved(self.rank, step, kind, "", 0.0, time.time() - t, 0, time.time(),
                                       error=f"{type(e).__name__}: {e}", os_error=describe_os_error(e)))
            return False

    def _save_and_leave(self, state: State | None, step: int, saver: int) -> None:
        """A regroup generation: every member holds the same state now; ``saver`` (the restore's donor,
        which held it before: a replacement that joined meanwhile may have no State yet) saves it; all leave.

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
        self._phase = "done"
        self._faults.check("regroup", step)  # (tests: a second fault while the regroup saves)
        saved = state is not None and dist.get_rank() == saver and self._save_now(state, step, "regroup")
        try:
            flag = torch.tensor([int(saved)], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if not flag.item():
                log.warning("rank %d: the regroup's save of step %d failed; leaving all the same", self.rank, step)
        except Exception as e:
            if not is_comm_failure(e):
                raise
            if not saved:
                self._abort_reason = f"the regroup's save was not confirmed: {type(e).__name__}: {e}"
                return
        self._send(Progress(self.rank, self.generation, "regroup_exit", time.time(), step=step))
        self._exit_now(EXIT_REGROUPED)

    def _exit_now(self, code: int) -> None:
        # Out at once: the state is safe, and an orderly interpreter teardown (process groups,
        # loader workers) can take seconds of a grace period that Kubernetes ends with SIGKILL.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            self._channel.close()
        os._exit(code)

    # --- recovery -----------------------------------------------------------

    def _recover(self, state: State, committed: int, *, clean: bool) -> int:
        """Leave the broken generation, join the next, restore; returns the step now held."""
        assert self.env is not None
        self._faults.check("recovery", self.current_step)
        log.warning(
            "job %s gen %d rank %d step %d: collective failed (%s); recovering",
            self.env.job_id, self.generation, self.rank, self.current_step, self._abort_reason,
        )
        self._send(CommFailure(self.rank, self.generation, self.current_step, self._abort_reason, time.time()))
        state.discard_gradients()
        if state.sharded:
            # The write uses a group of this generation, which leaving destroys; a dead peer fails it at once.
            self._shards.finish_writes(timeout=self.env.timeouts.collective)
            try:
                reset_after_failure(state.model)  # FSDP left mid-forward/backward: reshard, clear hooks
            except RecoveryError:
                raise
            except Exception as e:
                log.warning("rank %d: resetting FSDP after the failed step: %s", self.rank, e)
            status = self._shards.status(committed, clean)
        else:
            status = RankStatus(self.rank, committed, clean=clean, has_state=True, mode=MODE_REPLICATED)
        return self._rejoin(status, state)

    def _join_as_replacement(self, *, adopt: bool) -> None:
        assert self.env is not None
        if adopt:
            self._adopt_user_group()
        status = RankStatus(self.rank, committed=0, clean=False, has_state=False)
        self._rejoin(status, None, first=self.generation, joined=adopt)

    def _rejoin(self, status: RankStatus, state: State | None, first: int | None = None,
                joined: bool = False) -> int:
        """Join generations until one forms and the state is restored in it."""
        generation = self.generation + 1 if first is None else first
        resume_phase = "init" if first is not None else self._phase
        self._phase = "recovery"
        while True:
            if not joined:
                for wrapper in self._wrappers:
                    wrapper.invalidate()
                leave_group()  # now, not when the next generation opens: peers wait on our sockets
                self._join(generation)
            joined = False
            regroup = self._purpose == "regroup"
            if regroup and state is not None and state.sharded:
                # Never asked of a sharded job (it regroups from its persisted checkpoint); leave as asked.
                self._exit_now(EXIT_REGROUPED)
            if state is not None and state.sharded:
                rebind_groups(state.model)  # FSDP keeps the group it was built with
            self._send(Progress(self.rank, self.generation, "group_rebuilt", time.time()))
            try:
                # In a regroup generation the members are numbered anew: statuses carry the group's rank.
                statuses = exchange_statuses(dataclasses.replace(status, rank=dist.get_rank()) if regroup
                                             else status)
                if any(s.mode == MODE_SHARDED for s in statuses):
                    target, status = self._shards.restore(statuses, state)
                    plan = RestorePlan(target, -1, ())
                else:
                    plan = self._restore_replicated(statuses, state)
                    if dist.get_rank() in plan.receivers:
                        status = RankStatus(self.rank, plan.target, clean=True, has_state=True,
                                            mode=MODE_REPLICATED)
            except Exception as e:
                if not is_comm_failure(e):
                    raise
                self._abort_reason = f"{type(e).__name__}: {e}"
                self._send(CommFailure(self.rank, self.generation, self.current_step, self._abort_reason, time.time()))
                generation = self.generation + 1
                continue
            self._send(
                Progress(
                    self.rank, self.generation, "state_restored", time.time(), step=plan.target,
                    detail={"donor": plan.donor, "receivers": list(plan.receivers)},
                )
            )
            self.current_step = plan.target
            if regroup:
                self._save_and_leave(state, plan.target, saver=plan.donor)
                # Not confirmed: meet the members left in the next regroup generation, the state still held.
                self._send(CommFailure(self.rank, self.generation, self.current_step, self._abort_reason, time.time()))
                self._phase = "recovery"
                generation = self.generation + 1
                continue
            if first is not None:
                self._faults.check("rejoin", plan.target)
            self._collectives_base = max(0, collectives_entered())
            self._phase = resume_phase
            return plan.target

    def _restore_replicated(self, statuses: list[RankStatus], state: State | None) -> RestorePlan:
        """Every rank holds the whole state (DDP): the newest clean holder sends it to the others."""
        plan = plan_restore(statuses)
        me = dist.get_rank()  # this generation's number for the rank (a regroup renumbers)
        if me == plan.donor and plan.receivers:
            assert state is not None
            send_state({**state.state_dict(), "_undying": {"data_origin": self._data_origin}}, plan.receivers)
        elif me in plan.receivers:
            payload = recv_state(plan.donor)
            origin = payload.pop("_undying", {}).get("data_origin")
            if state is not None:
                state.load_state_dict(payload)
            else:
                self._stash = (plan.target, payload)
            if origin is not None:
                self._set_data_origin((int(origin[0]), int(origin[1])))
        return plan

    def _replicate_before_commit(self, step: Step) -> bool:
        """Ring replication of a sharded state, inside the transaction; False: it failed and the step aborts."""
        state = self._state
        if not self.managed or state is None or not state.sharded or not self._shards.due(step.index):
            return True
        try:
            self._shards.replicate(state, step.index)
            return True
        except Exception as e:
            if not is_comm_failure(e):
                raise
            step.outcome = Outcome.ABORTED
            step.optimizer_stepped = True  # the body ran to its end: the live state is past the committed step
            self._abort_reason = f"{type(e).__name__}: {e}"
            return False

    def _join(self, generation: int) -> None:
        assert self.env is not None
        t = self.env.timeouts
        deadline = time.monotonic() + t.rendezvous
        while True:
            try:
                record = join_generation(
                    self._control,
                    generation,
                    rank=self.rank,
                    backend=self.env.backend,
                    rendezvous_s=t.rendezvous,
                    connect_s=t.connect,
                    collective_s=t.collective,
                    incarnation=self.env.incarnation,
                    deadline=deadline,
                    key=self.env.store_key,
                )
                break
            except FencedError as e:
                log.warning("job %s rank %d (pid %d): %s", self.env.job_id, self.rank, os.getpid(), e)
                os._exit(EXIT_FENCED)
            except ControlStoreLostError as e:
                # The manager restarted: a new one serves the same store address. Training never
                # needed it; joining a generation does.
                log.warning("job %s rank %d: %s; connecting again", self.env.job_id, self.rank, e)
                self._control = self._connect_control(deadline)
        self.generation = record.generation
        self._purpose = record.purpose

    def _connect_control(self, deadline: float) -> dist.Store:
        assert self.env is not None
        while True:
            try:
                return JobStore(self.env.control_host, self.env.control_port, CONTROL_STORE, self.env.store_key,
                                timedelta(seconds=max(1.0, min(10.0, deadline - time.monotonic()))))
            except (RuntimeError, dist.DistError) as e:
                if time.monotonic() >= deadline:
                    raise RecoveryError(f"the manager's control store at {self.env.control_host}:"
                                        f"{self.env.control_port} stayed unreachable: {e}") from e
                time.sleep(0.5)

    def _adopt_user_group(self) -> None:
        """The script called ``init_process_group`` itself (env:// on this generation's store)."""
        if dist.get_world_size() != self.world_size:
            raise UsageError(
                f"the script's process group has {dist.get_world_size()} ranks but the job has "
                f"{self.world_size}; let undying.init() create it or use the launcher's WORLD_SIZE"
            )
        self._control.get(generation_key(self.generation))  # the generation exists

    def _start_unmanaged(self) -> None:
        """Outside ``undying run``: plain torchrun or a single process, no fault tolerance."""
        if not dist.is_initialized() and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group("gloo")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.generation = 0
        self._faults = FaultSwitch(self.rank, lambda message: None, {})
        self.tracing = WorkerTracing(None, self.rank, lambda message: None)

    # --- agent channel ------------------------------------------------------

    def _beat(self, stopped: threading.Event) -> None:
        """Heartbeats with progress: they stop when the process is stopped or its
        interpreter is stuck, and their progress stops when the training thread is.

        Progress is sampled four times a second, so its time is exact to a
        quarter second whatever the beat interval.
        """
        assert self.env is not None
        interval = min(0.5, max(0.05, self.env.timeouts.heartbeat / 5))
        sample = min(0.25, interval)
        last: tuple[int, str, int, int] | None = None
        progress_t = time.time()
        next_beat = 0.0
        while not stopped.wait(sample):
            now = time.time()
            key = (self.generation, self._phase, self.current_step, collectives_entered() - self._collectives_base)
            changed_phase = last is not None and key[:2] != last[:2]
            if key != last:
                last, progress_t = key, now
            if now >= next_beat or changed_phase:  # a new phase is told at once: "I left the stuck group"
                next_beat = now + interval - sample / 2
                self._send(Heartbeat(self.rank, now, *key, progress_t=progress_t))

    def _send(self, message: Message) -> None:
        if self.managed:
            self._channel.send(message)

    def _on_command(self, message: Message) -> None:
        if isinstance(message, ArmFault) and message.kind == "slow":
            self.tracing.arm_slowdown(message)
        elif isinstance(message, ArmFault):
            self._faults.arm(message)
        elif isinstance(message, TraceSet):
            self.tracing.apply(message)
        elif isinstance(message, Preempt):
            with self._preempt_lock:
                self._preempted = True
                proposal = self.current_step
            self._send(StopProposal(self.rank, self.generation, proposal, time.time()))
        elif isinstance(message, StopAt):
            self._stop_grace_s = message.grace_s
            with self._preempt_lock:
                self._preempted = True
                self._stop_at = message.step
            self._stop_heard.set()
        elif isinstance(message, Stop):
            self._stopping = True
            with contextlib.suppress(Exception):
                self._channel.close()
            os._exit(128 + signal.SIGTERM)
        elif isinstance(message, Abort):
            if message.generation == self.generation:
                log.warning("rank %d: leaving generation %d: %s", self.rank, message.generation, message.reason)
                break_connections()
        else:
            log.warning("rank %d: ignoring unexpected command %r", self.rank, message)
