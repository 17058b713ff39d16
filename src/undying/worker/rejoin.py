"""Recovery in place: leave the broken generation, join the next, agree on the state, restore it.

After a collective fails, every surviving rank (and each replacement, from its
first moment) meets the others in the next process-group generation, tells
them what it holds (``worker.restore.exchange_statuses``), and every rank asks
the one restore planner (``checkpoint.planner.plan``) where each rank's state
comes from. All get the same plan; each carries out its part: a whole state
from a peer (DDP), a shard from its snapshot or its ring replica, or, when no
step has every shard in memory, the latest checkpoint loaded by every rank.
The planner's call has no ``except`` around it: a plan that cannot be made
(no complete state anywhere) fails this process with the planner's words,
told to the manager, never a silent fallback. A collective that fails on the
way (another peer lost) starts the round again in the next generation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Literal, TypeVar

import torch.distributed as dist

from undying.checkpoint import planner
from undying.checkpoint.layout import Layout
from undying.checkpoint.manifest import Manifest
from undying.checkpoint.planner import UNREAD, Member, RestorePlan
from undying.config import EXIT_FENCED, EXIT_REGROUPED
from undying.errors import (
    ControlStoreLostError,
    FencedError,
    NoStateSourceError,
    RecoveryError,
    UsageError,
)
from undying.protocol.generations import generation_key
from undying.protocol.store_client import JobStore
from undying.protocol.store_wire import CONTROL_STORE
from undying.protocol.worker_wire import CommFailure, Progress
from undying.worker.context import JobContext
from undying.worker.gasp import save_and_leave
from undying.worker.group import collectives_entered, is_comm_failure, join_generation, leave_group
from undying.worker.restore import (
    MODE_REPLICATED,
    MODE_SHARDED,
    RankStatus,
    exchange_statuses,
    recv_state,
    send_state,
    settle,
)
from undying.worker.sharding import rebind_groups, reset_after_failure

if TYPE_CHECKING:
    from undying.worker.checkpoints import Checkpoints
    from undying.worker.ddp import GenerationalDDP
    from undying.worker.shards import Shards
    from undying.worker.state import State

__all__ = ["Rejoin", "connect_control"]

log = logging.getLogger("undying.worker")

T = TypeVar("T")


class _Failed(enum.Enum):
    """A collective of the round failed (a peer lost): the round starts again in the next
    generation."""

    FAILED = "failed"


_FAILED = _Failed.FAILED


@dataclasses.dataclass(frozen=True)
class _Restored:
    target: int
    status: RankStatus  # this rank's holdings now, for the next round if one follows
    donor: int  # who held the state before (-1: sharded, every rank holds its own)
    receivers: tuple[int, ...]


def connect_control(ctx: JobContext, deadline: float) -> dist.Store:
    """The manager's control store (its generations), tried again until ``deadline``."""
    env = ctx.env
    assert env is not None
    while True:
        try:
            return JobStore(env.control_host, env.control_port, CONTROL_STORE, env.store_key,
                            timedelta(seconds=max(1.0, min(10.0, deadline - time.monotonic()))))
        except (RuntimeError, dist.DistError) as e:
            if time.monotonic() >= deadline:
                raise RecoveryError(f"the manager's control store at {env.control_host}:"
                                    f"{env.control_port} stayed unreachable: {e}") from e
            time.sleep(0.5)


class Rejoin:
    """Joining generations and restoring the state in them, for one job (its context and savers)."""

    def __init__(self, ctx: JobContext, control: dist.Store, shards: Shards,
                 checkpoints: Checkpoints, wrappers: list[GenerationalDDP]) -> None:
        self.ctx = ctx
        self.control = control
        self.shards = shards
        self.checkpoints = checkpoints
        self.wrappers = wrappers
        self.purpose = ""  # of the generation joined last (see GenerationRecord.purpose)
        # a receiver's state and its donor's, told with state_restored
        self.restored_digests: dict[str, str] = {}

    # --- generations ---------------------------------------------------------------

    def join(self, generation: int) -> None:
        ctx, env = self.ctx, self.ctx.env
        assert env is not None
        t = env.timeouts
        deadline = time.monotonic() + t.rendezvous_timeout
        while True:
            try:
                record = join_generation(
                    self.control, generation, rank=ctx.rank, backend=env.backend,
                    rendezvous_s=t.rendezvous_timeout, connect_s=t.connect_timeout,
                    collective_s=t.collective_timeout, incarnation=env.incarnation,
                    deadline=deadline, key=env.store_key, unformed=self._unformed,
                )
                break
            except FencedError as e:
                log.warning("job %s rank %d (pid %d): %s", env.job_id, ctx.rank, os.getpid(), e)
                os._exit(EXIT_FENCED)
            except ControlStoreLostError as e:
                # The manager restarted: a new one serves the same store address. Training never
                # needed it; joining a generation does.
                log.warning("job %s rank %d: %s; connecting again", env.job_id, ctx.rank, e)
                self.control = connect_control(ctx, deadline)
        ctx.generation = record.generation
        self.purpose = record.purpose

    def adopt_user_group(self) -> None:
        """The script called ``init_process_group`` itself (env:// on this generation's store)."""
        ctx = self.ctx
        if dist.get_world_size() != ctx.world_size:
            raise UsageError(
                f"the script's process group has {dist.get_world_size()} ranks but the job has "
                f"{ctx.world_size}; let undying.init() create it or use the launcher's WORLD_SIZE"
            )
        self.control.get(generation_key(ctx.generation))  # the generation exists

    # --- recovery ----------------------------------------------------------------------

    def recover(self, state: State, committed: int, *, clean: bool, planned: bool = False) -> int:
        """Leave the broken generation, join the next, restore; returns the step now held.

        ``planned``: not a failure but a planned leave between steps (``ctx.abort_reason`` says
        which).
        """
        ctx = self.ctx
        assert ctx.env is not None
        ctx.faults.check("recovery", ctx.current_step)
        # (INFO: the manager says the fault and its recovery in one line each; the error's words
        # are in the comm_failure event, status and the page; `undying -v` shows this line.)
        log.info("job %s gen %d rank %d step %d: %s (%s); recovering",
                 ctx.env.job_id, ctx.generation, ctx.rank, ctx.current_step,
                 "leaving between steps" if planned else "collective failed", ctx.abort_reason)
        self._comm_failure(torn=not clean)
        state.discard_gradients()
        if state.sharded:
            # The write uses a group of this generation, which leaving destroys; a dead peer fails
            # it at once.
            self.shards.saves.finish_writes(timeout=ctx.env.timeouts.collective_timeout)
            try:
                # FSDP left mid-forward/backward: reshard, clear hooks
                reset_after_failure(state.model)
            except RecoveryError:
                raise
            except Exception as e:
                log.warning("rank %d: resetting FSDP after the failed step: %s", ctx.rank, e)
            status = self.shards.status(committed, clean)
        else:
            status = RankStatus(Member(ctx.rank, committed, clean=clean), MODE_REPLICATED)
        with self._told():
            return self._rejoin(status, state)

    def join_as_replacement(self, *, adopt: bool) -> None:
        """A new process for a lost rank: join the generation it was started for and receive the
        state."""
        if adopt:
            self.adopt_user_group()
        status = RankStatus(Member.lost(self.ctx.rank))
        with self._told():
            self._rejoin(status, None, first=self.ctx.generation, joined=adopt)

    @contextlib.contextmanager
    def _told(self) -> Iterator[None]:
        """A restore the planner refused (no complete state anywhere) ends this process: the manager
        hears it as this rank's error, in the planner's words, rather than as a crash."""
        try:
            yield
        except NoStateSourceError as e:
            self.ctx.report_fatal(self.ctx.current_step + 1, e)
            raise

    def _unformed(self, generation: int, error: Exception) -> None:
        """A generation failed to form on this rank: the manager hears it as that generation's
        failure (``group.join_generation``)."""
        ctx = self.ctx
        ctx.send(CommFailure(ctx.rank, generation, ctx.current_step,
                             f"generation {generation} failed to form: {error}", time.time(),
                             unformed=True))

    def _comm_failure(self, *, torn: bool = False) -> None:
        ctx = self.ctx
        ctx.send(CommFailure(ctx.rank, ctx.generation, ctx.current_step, ctx.abort_reason,
                             time.time(), torn=torn))

    def _rejoin(self, status: RankStatus, state: State | None, first: int | None = None,
                joined: bool = False) -> int:
        """Join generations until one forms and the state is restored in it."""
        ctx = self.ctx
        generation = ctx.generation + 1 if first is None else first
        resume_phase = "init" if first is not None else ctx.phase
        ctx.phase = "recovery"
        while True:
            if not joined:
                for wrapper in self.wrappers:
                    wrapper.invalidate()
                leave_group()  # now, not when the next generation opens: peers wait on our sockets
                ctx.faults.check("join", ctx.current_step)
                self.join(generation)
            joined = False
            regroup = self.purpose == "regroup"
            if state is not None and state.sharded:
                # never asked of a sharded job (it regroups from its checkpoint); leave as asked
                if regroup:
                    ctx.exit_now(EXIT_REGROUPED)
                rebind_groups(state.model)  # FSDP keeps the group it was built with
            ctx.send(Progress(ctx.rank, ctx.generation, "group_rebuilt", time.time()))
            restored = self._restore(status, state, regroup)
            if restored is None:
                self._comm_failure()
                generation = ctx.generation + 1
                continue
            status = restored.status
            digests, self.restored_digests = self.restored_digests, {}
            ctx.send(Progress(ctx.rank, ctx.generation, "state_restored", time.time(),
                              step=restored.target,
                              detail={"donor": restored.donor,
                                      "receivers": list(restored.receivers), **digests}))
            ctx.current_step = restored.target
            if regroup:
                save_and_leave(ctx, state, restored.target, restored.donor, self.checkpoints)
                # Not confirmed: meet the members left in the next regroup generation, the state
                # still held.
                self._comm_failure()
                ctx.phase = "recovery"
                generation = ctx.generation + 1
                continue
            if first is not None:
                ctx.faults.check("rejoin", restored.target)
            ctx.collectives_base = max(0, collectives_entered())
            ctx.phase = resume_phase
            return restored.target

    def _collective(self, work: Callable[[], T]) -> T | Literal[_Failed.FAILED]:
        """Run a collective step of the round; a communication failure ends the round (the error
        is kept)."""
        try:
            return work()
        except Exception as e:
            if not is_comm_failure(e):
                raise
            self.ctx.aborted(e)
            return _FAILED

    def _restore(self, status: RankStatus, state: State | None, regroup: bool) -> _Restored | None:
        """One round: exchange holdings, plan, carry out. None: a collective failed on the way."""
        # this generation's number for the rank (a regroup numbers its members anew)
        me = dist.get_rank()
        mine = (dataclasses.replace(status, member=status.member._replace(rank=me)) if regroup
                else status)
        statuses = self._collective(lambda: exchange_statuses(mine))
        if statuses is _FAILED:
            return None
        members = [s.member for s in statuses]
        if any(s.mode == MODE_SHARDED for s in statuses):
            return self._restore_shards(members, state)
        # Every rank holds the whole state (DDP): one shard, as many data-parallel copies as
        # members.
        plan = planner.plan(Layout(dp=len(members)), members)
        received = self._collective(lambda: self._move_whole_state(plan, state, me))
        if received is _FAILED:
            return None
        assert plan.target is not None
        keepers = [r for r, source in enumerate(plan.sources) if source.kind == "self"]
        transfers = plan.transfers()
        donor = transfers[0][0] if transfers else keepers[0]
        return _Restored(plan.target, received or status, donor,
                         tuple(sorted(r for _, r in transfers)))

    def _restore_shards(self, members: list[Member], state: State | None) -> _Restored | None:
        """Every rank holds a shard of its own (dp = 1): from memory, or all from the latest
        checkpoint."""
        layout, replica_of = Layout(dp=1, tp=len(members)), self.shards.replica_of()
        plan: RestorePlan = planner.plan(layout, members, replica_of=replica_of, checkpoint=UNREAD)
        manifest: Manifest | None = None
        if plan.read_checkpoint:
            found = self._collective(self.shards.latest_checkpoint)
            if found is _FAILED:
                return None
            persisted, manifest = found
            plan = planner.plan(layout, members, replica_of=replica_of, checkpoint=persisted)
        assert plan.target is not None
        if plan.needs_checkpoint:
            assert manifest is not None
            loaded = manifest
            status = self._collective(lambda: self.shards.rollback(plan, loaded, state))
        else:
            status = self._collective(lambda: self.shards.restore(plan, state))
        if status is _FAILED:
            return None
        return _Restored(plan.target, status, -1, ())

    def _move_whole_state(self, plan: RestorePlan, state: State | None,
                          me: int) -> RankStatus | None:
        """Carry out a DDP plan: each donor sends the whole state to its receivers; a receiver
        loads it (or keeps it for ``steps()`` when it has no State yet). Returns a receiver's new
        status."""
        ctx = self.ctx
        receivers = tuple(r for donor, r in plan.transfers() if donor == me)
        sent: list[dist.Work | None] = []
        if receivers:
            assert state is not None
            # The donor's fingerprint travels with it: the receiver's state, once loaded, must show
            # the same.
            extra = {"data_origin": ctx.data_origin, "digest": state.digest()}
            sent = send_state({**state.state_dict(), "_undying": extra}, receivers)
        source = plan.source(me)
        payload = recv_state(source.rank) if source.kind == "peer" and source.rank is not None \
            else None
        if plan.transfers():
            settle([], sent)  # every member: a receiver that died mid-transfer strands no donor
        if payload is None:
            return None
        assert plan.target is not None
        meta = payload.pop("_undying", {})
        origin = meta.get("data_origin")
        if state is not None:
            state.load_state_dict(payload)
            self.restored_digests = {"digest": state.digest(),
                                     "donor_digest": str(meta.get("digest", ""))}
        else:
            ctx.stash = (plan.target, {**payload, "_undying": meta})
        if origin is not None:
            ctx.set_data_origin((int(origin[0]), int(origin[1])))
        return RankStatus(Member(ctx.rank, plan.target), MODE_REPLICATED)
