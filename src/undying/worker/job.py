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
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from undying.checkpoint.mac import key_from_environ, set_key
from undying.checkpoint.planner import StatePlan
from undying.checkpoint.safe_load import check_state_loadable
from undying.errors import UsageError
from undying.protocol.store_client import JobStore
from undying.protocol.store_wire import CONTROL_STORE
from undying.protocol.worker_wire import (
    Done,
    Hello,
    Progress,
    StepBegun,
    StepCommitted,
    wire_metrics,
)
from undying.worker import rng
from undying.worker.checkpoints import Checkpoints
from undying.worker.commands import AgentLink, Commands, leave_early
from undying.worker.context import JobContext, SaveClock
from undying.worker.data import DataCursor
from undying.worker.ddp import GenerationalDDP
from undying.worker.env import WorkerEnv
from undying.worker.faults import FaultSwitch, block_forever, crash_self, spin_forever, stop_self
from undying.worker.gasp import Preemption, dying_gasp
from undying.worker.group import break_connections, claim_existing_sockets, is_comm_failure
from undying.worker.heartbeat import beat
from undying.worker.numerics import NumericFault, Numerics
from undying.worker.numerics_guard import NumericsGuard
from undying.worker.rejoin import Rejoin
from undying.worker.seed import seed_everything, seed_from_env
from undying.worker.shards import Shards
from undying.worker.startup import join_at_start, resume_at_start, unmanaged_context
from undying.worker.state import State
from undying.worker.step import Outcome, Step, StepHooks
from undying.worker.threads import StoppedAtExit
from undying.worker.tracing import WorkerTracing
from undying.worker.verify import Verification, serve, serving, start_verification, verify_every
from undying.worker.virtual import invariant_mode
from undying.worker.wrappers import watch_optimizer_steps

__all__ = ["init", "Job", "Step"]

_job: Job | None = None


def init(seed: int | None = None) -> Job:
    """Join the job and set up ``torch.distributed`` for its current generation.

    Call it once, near the top of the script, before building the dataset,
    the model and samplers that ask ``torch.distributed`` for the rank. Safe to
    call after the script's own ``init_process_group``. Outside ``undying run``
    it returns an unmanaged job (plain ``torchrun`` or ``python``) that trains
    without fault tolerance.

    ``seed`` is the job's seed (default: ``undying run --seed``, else 0). It
    seeds torch, Python's ``random`` and NumPy here, before the script's setup
    runs, so a replacement rank builds the same dataset and model as the rank
    it replaces; it is also the default seed of ``job.steps``. A script that
    seeds itself after this call wins.
    """
    global _job
    if _job is None:
        job_seed = seed_from_env() if seed is None else seed
        seed_everything(job_seed)
        env = WorkerEnv.from_environ()
        _job = Job(env, seed=job_seed)
    elif seed is not None and seed != _job.seed:
        raise UsageError(f"undying.init(seed={seed}) after this process joined "
                         f"with seed {_job.seed}: "
                         "call init once, with the seed the job uses")
    return _job


class Job:
    """This process's membership in an undying job.

    It owns the step loop (``steps``) and the step transaction's hooks; the
    rest are parts it builds: its line to the agent and the agent's commands
    (``worker.commands``), its heartbeat (``worker.heartbeat``), its start-up
    and resume (``worker.startup``). What the job's parts share lives in
    ``ctx`` (``worker.context``): recovery (``worker.rejoin``), the savers
    (``worker.checkpoints``, ``worker.gasp``, ``worker.shards``) and the DDP
    wrapper get it, never this object.
    """

    def __init__(self, env: WorkerEnv | None, *, seed: int = 0) -> None:
        self.env = env
        self.seed = seed
        self.managed = env is not None
        # Its reports out; opened once the parts that take the commands exist.
        self._link = AgentLink()
        if env is None:
            self.ctx = unmanaged_context()
        else:
            # Checkpoints signed and checked under the job's key (checkpoint.mac).
            set_key(key_from_environ())
            if dist.is_initialized():
                claim_existing_sockets()
            send = self._link.send
            self.ctx = JobContext(
                env, env.rank, env.world_size, env.local_rank, env.generation, send,
                FaultSwitch(env.rank, send,
                            {"crash": crash_self, "hang": stop_self, "hang:spin": spin_forever,
                             "hang:block": block_forever, "comm-error": break_connections,
                             "migrate": lambda: self._commands.leave_for_migration(),
                             "leave": leave_early}),
                WorkerTracing(env, env.rank, send), close_channel=self._link.close,
                clock=SaveClock(env.checkpoint.save_every, env.checkpoint.save_interval),
            )
        self._state_checked = False  # the state's weights_only round trip, done at the first commit
        self._wrappers: list[GenerationalDDP] = []
        self._current: Step | None = None
        self._hooks = StepHooks(self._replicate_before_commit, self._commit,
                                lambda exc: self.managed and is_comm_failure(exc), self.ctx.aborted,
                                self.ctx.report_fatal, self._began, self._numeric_verdict)
        self._numerics: NumericsGuard | None = None
        self._verify: Verification | None = None  # --verify-every (worker.verify)
        self._state: State | None = None
        # Sharded state (FSDP2): DCP checkpoints by every rank, ring replicas, restore by shards.
        self._shards = Shards(self.ctx)
        self._checkpoints = Checkpoints(self.ctx)
        self._preemption = Preemption(self.ctx)
        # The agent's commands, by message class (anything else is logged and ignored).
        self._commands = Commands(self.ctx, self._preemption)
        if env is None:
            # Where this process's state comes from before its first step (an unmanaged script: its
            # own).
            self._start: StatePlan = resume_at_start(None, self._checkpoints, self._shards)
            return
        self._link.open(env.agent_host, env.agent_port, self._commands.on_command)
        control = JobStore(env.control_host, env.control_port, CONTROL_STORE, env.store_key,
                           timedelta(seconds=env.timeouts.rendezvous_timeout))
        self._rejoin = Rejoin(self.ctx, control, self._shards, self._checkpoints, self._wrappers)
        self.ctx.send(Hello(self.rank, os.getpid(), self.generation, env.joining, time.time(),
                           env.incarnation))
        # Stopped at exit: it calls into torch (see undying.worker.threads).
        StoppedAtExit(lambda stopped: beat(self.ctx, stopped), name="undying-heartbeat")
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._preemption.on_sigterm)
        # The one planner: a replacement's state comes from the members, a launch's from its
        # checkpoint.
        self._start = resume_at_start(env, self._checkpoints, self._shards)
        join_at_start(env, self._rejoin)

    # --- where this process stands (the context's, read here) ---------------

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def local_rank(self) -> int:
        return self.ctx.local_rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def generation(self) -> int:
        return self.ctx.generation

    @property
    def job_id(self) -> str:
        """The job's id (``undying run --job-id``), "" outside ``undying run``: a tracker's run."""
        return self.env.job_id if self.env is not None else ""

    @property
    def current_step(self) -> int:
        return self.ctx.current_step

    @property
    def tracing(self) -> WorkerTracing:
        return self.ctx.tracing

    # --- public API --------------------------------------------------------

    def state(self, model: torch.nn.Module | None = None,
              optimizer: torch.optim.Optimizer | None = None,
              scheduler: Any = None, loader: Any = None, **extras: Any) -> State:
        """Declare what must survive a fault (see ``undying.State``)."""
        return State(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, **extras)

    def ddp(self, module: torch.nn.Module, **ddp_kwargs: Any) -> GenerationalDDP:
        """A DDP wrapper rebuilt on every new process-group generation."""
        wrapper = GenerationalDDP(self.ctx, module, **ddp_kwargs)
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
        seed: int | None = None,
        numerics: Numerics | bool | None = None,
        virtual_ranks: int | None = None,
    ) -> Iterator[Step]:
        """Yield the job's steps from where it is, each a transaction.

        ``total`` counts steps; ``epochs`` counts passes over ``state.loader``
        (the loop calls ``sampler.set_epoch``). ``seed`` (default: the job's,
        ``undying.init(seed=...)``) seeds the random state of every step
        (derived per rank and step, see ``undying.worker.rng``).
        ``numerics`` (True or a ``Numerics``) checks each step before it commits
        and replays a failed one in place (see ``undying.worker.numerics``).
        ``virtual_ranks`` (default: ``undying run --virtual-ranks``) opts in to invariant mode
        (``undying.worker.virtual``): the same losses on any number of ranks.
        """
        seed = self.seed if seed is None else seed
        if not isinstance(state, State):
            raise UsageError(f"job.steps() needs an undying.State, got {type(state).__name__}")
        # This process is the job's verifier (worker.verify): it replays steps, it does not train.
        if serving():
            yield from serve(state, Numerics.of(numerics) or Numerics())
            return
        ctx = self.ctx
        virtual = invariant_mode(ctx, state, virtual_ranks, seed=seed, total=total, epochs=epochs)
        for wrapper in self._wrappers:
            wrapper.invariant = virtual is not None
        cursor = virtual.cursor if virtual is not None else DataCursor(
            state.loader, rank=self.rank, seed=seed, total=total, epochs=epochs,
            origin=ctx.data_origin)
        ctx.cursor = cursor
        self._state = state
        config = Numerics.of(numerics)
        every = verify_every(config.verify_every if config is not None else None)
        # The fingerprints are its.
        config = Numerics() if config is None and every is not None else config
        self._numerics = None if config is None else NumericsGuard(
            config, state, self.rank, lambda: self.generation, self.ctx.send, cursor)
        self._verify = start_verification(every, managed=self.managed, rank=self.rank,
                                          world=self.world_size, seed=seed,
                                          generation=lambda: self.generation, send=self.ctx.send)
        self._attach(state)
        if self.managed and self.rank == 0:
            self.ctx.send(Progress(self.rank, self.generation, "state_layout", time.time(),
                                detail=self._shards.layout(state)))
        committed = self._checkpoints.load_waiting(state, self._start, self._shards)
        if self.managed and self.rank == 0:  # the progress `undying status` shows
            self.ctx.send(Progress(self.rank, self.generation, "steps_planned", time.time(),
                                   step=committed, detail=cursor.outline(state.loader)))
        if self.managed and state.sharded and not self._shards.replicate_initial(state, committed):
            committed = self._rejoin.recover(state, committed, clean=True)
        while True:
            while committed < cursor.total_steps:
                index = committed + 1
                ctx.step_in_flight = index  # first, then the leave: see Commands.leave_from
                if self.managed and self._commands.take_planned_leave(index):
                    committed = self._rejoin.recover(state, committed, clean=True, planned=True)
                    continue
                verify = self._verify
                if verify is not None and verify.due(index):
                    back = self._verified(state, committed, verify.begin, index, state)
                    if back is not None:
                        committed = back
                        continue
                if not self._preemption.may_start(index, committed):
                    dying_gasp(ctx, state, committed, self._checkpoints, self._shards)
                self.tracing.step_started(index, self.generation)
                batch = None if virtual is not None \
                    else self.tracing.batch(cursor.batch_for, index) \
                    if self.tracing.active else cursor.batch_for(index)
                rng.reseed(seed, self.rank, "body", index)
                if self.managed:
                    ctx.faults.check("step", index)
                step = Step(self._hooks, index, cursor.epoch_of(index), batch, self.generation,
                            virtual.micro_steps if virtual is not None else None)
                self._current = step
                if self._numerics is not None:
                    self._numerics.begin(step)
                yield step
                if step.outcome is Outcome.COMMITTED:
                    committed = index
                    if not self._state_checked:
                        self._check_state_loadable(state, index)
                    cursor.forget_through(index)
                    if self.managed and not self._checkpoints.maybe_save(
                            state, index, self._shards, last=index == cursor.total_steps):
                        committed = self._rejoin.recover(state, committed, clean=True)
                elif step.outcome is Outcome.REPLAY:
                    # The same step from the same state, batch and random state (worker.numerics).
                    pass
                elif step.outcome is Outcome.ABORTED:
                    committed = self._rejoin.recover(state, committed,
                                                     clean=not step.optimizer_stepped)
                else:
                    raise UsageError(
                        f"step {index} was not run as a transaction: "
                        "put its body inside `with step:`"
                    )
            # What the verifier still owes: a flip in the last steps.
            if (verify := self._verify) is not None:
                back = self._verified(state, committed, verify.finish, state, committed)
                if back is not None:
                    committed = back
                    continue
            if self._finished(state, committed):
                break
            committed = self._rejoin.recover(state, committed, clean=True)
        if self._verify is not None:
            self._verify.close()
        if self.managed:
            ctx.phase = "done"
            self._checkpoints.finish_writes()
            self._shards.saves.finish_writes()
            self.tracing.close()
            self.ctx.send(Done(self.rank, committed, state.digest(), time.time()))

    # --- the transaction's hooks --------------------------------------------

    def _attach(self, state: State) -> None:
        """Know when the optimizer steps: a step that fails after it leaves the state torn."""
        if state.optimizer is not None:
            watch_optimizer_steps(state.optimizer, self._before_optimizer_step)
        if state.sharded:
            self._shards.attach(state)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._shards.quiet:
            return  # torch creating optimizer state for a sharded save or load: no training step
        step = self._current
        if step is not None and step.outcome is Outcome.PENDING and self._numerics is not None:
            self._numerics.check(step)  # raises NumericFault before any state changes
            # The suspect of a verified step: its fingerprint, for the replay.
            if self._verify is not None:
                self._verify.after_check(step, self._numerics.prints())
        if step is not None and step.outcome is Outcome.PENDING:
            step.optimizer_stepped = True
        if self.managed:
            self.ctx.faults.check("optimizer", self.current_step)

    def _replicate_before_commit(self, step: Step) -> bool:
        """Ring replication of a sharded state, inside the transaction; False: it failed and the
        step aborts."""
        state = self._state
        if not self.managed or state is None or not state.sharded \
                or not self._shards.due(step.index):
            return True
        try:
            self._shards.replicate(state, step.index)
            return True
        except Exception as e:
            if not is_comm_failure(e):
                raise
            step.outcome = Outcome.ABORTED
            # The body ran to its end: the live state is past the committed step.
            step.optimizer_stepped = True
            self.ctx.aborted(e)
            return False

    def _numeric_verdict(self, step: Step, exc: BaseException) -> str | None:
        """A failed numeric check's outcome ("replay", "skip"), or None: the step fails (no
        check, or "stop")."""
        guard = self._numerics
        if guard is None or not isinstance(exc, NumericFault):
            return None
        verdict = guard.resolve(step, exc)
        return None if verdict == "stop" else verdict

    def _verified(self, state: State, committed: int, call: Callable[..., int | None],
                  *args: Any) -> int | None:
        """``--verify-every``'s word at a verified step or the loop's end: None, or the committed
        step to go on from.

        A roll-back re-runs from the verified state's step; the agreement's
        broadcast failing (a peer's fault) is recovered as an aborted step.
        """
        try:
            back = call(*args)
        except Exception as e:
            if not (self.managed and is_comm_failure(e)):
                raise
            self.ctx.aborted(e)
            return self._rejoin.recover(state, committed, clean=True)
        if back is None:
            return None
        self.ctx.current_step = back - 1
        return back - 1

    def _began(self, step: Step, fingerprint: str) -> None:
        self.ctx.send(StepBegun(self.rank, self.generation, step.index, fingerprint))

    def _commit(self, step: Step) -> None:
        self.ctx.phase = "step"
        self.tracing.committed(step.index)
        if self.managed:
            self.ctx.send(StepCommitted(self.rank, self.generation, step.index, time.time(),
                                     wire_metrics(step.metrics)))

    def _check_state_loadable(self, state: State, index: int) -> None:
        """Once, at the first commit: a state that weights_only=True would refuse fails now, by
        name."""
        self._state_checked = True
        try:
            origin = {"data_origin": self.ctx.data_origin}
            check_state_loadable({**state.state_dict(), "_undying": origin})
        except UsageError as e:
            self.ctx.report_fatal(index, e)
            raise

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
            self.ctx.aborted(e)
            return False
