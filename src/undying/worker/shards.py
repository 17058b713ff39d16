"""The job loop's side of sharded state: DCP checkpoints by every rank, ring replicas, restore
by shards.

``Job`` calls in here where the state is sharded (``State.sharded``: the
model holds DTensors, FSDP2 ``fully_shard``); a replicated (DDP) state keeps
the paths in ``job.py``. Kept apart so the step loop reads the same for both:

- **checkpoints**: periodic and dying-gasp saves are collective
  (``save_sharded``: every rank writes its own files through
  torch.distributed.checkpoint, rank 0 commits the manifest), made by its
  part ``saves`` (``worker.shard_saves``); a resume loads them on any world
  size (``load_sharded``), after the shapes are checked;
- **replication** (``UNDYING_REPLICATE=ring``): a committed step's shards
  are copied to each rank's ring successor (``worker.replica``);
- **restore**: after a fault every rank gets its shard from where the
  restore planner says (itself, its snapshot, or the replica holder); when no
  step has every shard in memory, every rank rolls back in place to the
  latest valid checkpoint, and the steps since are re-run and reported lost.
  What to do is the plan's (``checkpoint.planner.plan``); this module moves
  the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from undying.checkpoint.checks import check_compatible, tensor_shapes
from undying.checkpoint.manifest import Manifest
from undying.checkpoint.planner import Member, PersistedState, RestorePlan, ring_replica_of
from undying.checkpoint.sharded import latest_valid_shared, load_sharded
from undying.errors import RecoveryError, UsageError
from undying.protocol.env import RESUME_DIGEST_ENV
from undying.protocol.worker_wire import Progress
from undying.worker import replica, sharding
from undying.worker.context import JobContext
from undying.worker.group import is_comm_failure
from undying.worker.restore import MODE_SHARDED, RankStatus, settle
from undying.worker.shard_saves import ShardSaves

if TYPE_CHECKING:
    from undying.worker.state import State

__all__ = ["Shards"]

log = logging.getLogger("undying.worker")

# The planner's words for a source, as the shards_restored event names them.
_SOURCE_NAMES = {"self": "live", "snapshot": "own", "replica": "replica"}

# "1": a resumed rank reports the digest of the whole state it loaded (a gather; for tests and
# audits).


class Shards:
    """Sharded-state support for one job (its rank, its channel to the agent, its config)."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.config = replica.ReplicationConfig.from_environ()
        self.copies = replica.Copies()
        self.resume_digest = os.environ.get(RESUME_DIGEST_ENV, "") == "1"
        # an internal optimizer step (DCP creating optimizer state) is no training step
        self.quiet = False
        self._hooked: set[int] = set()
        self._replicated_once = False
        # Its DCP checkpoints: periodic ones written in the background, the dying gasp
        # (worker.shard_saves).
        self.saves = ShardSaves(ctx, self.dcp_state_dict)

    # --- who is whose ring neighbour -----------------------------------------

    @property
    def offset(self) -> int:
        env = self.ctx.env
        local = env.local_world_size if env is not None else self.ctx.world_size
        return replica.ring_offset(self.ctx.world_size, local)

    @property
    def successor(self) -> int:
        return (self.ctx.rank + self.offset) % self.ctx.world_size

    @property
    def predecessor(self) -> int:
        return (self.ctx.rank - self.offset) % self.ctx.world_size

    @property
    def ring(self) -> bool:
        return self.config.ring and self.offset > 0

    def replica_of(self) -> dict[int, int]:
        """Which rank's shard each rank keeps a replica of (holder -> owner), for the restore
        planner."""
        return ring_replica_of(self.ctx.world_size, self.offset) if self.ring else {}

    # --- the state, shaped for DCP -----------------------------------------------

    @contextlib.contextmanager
    def _internal(self) -> Iterator[None]:
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False

    def dcp_state_dict(self, state: State) -> dict[str, Any]:
        with self._internal():
            return sharding.dcp_state_dict(state)

    def layout(self, state: State) -> dict[str, Any]:
        """What the manager needs to plan a restore: whose shard has a copy where."""
        if not state.sharded:
            return {"sharded": False}
        return {"sharded": True, "world_size": self.ctx.world_size,
                "replicate": "ring" if self.ring else "off", "every": self.config.every,
                "offset": self.offset}

    def status(self, committed: int, clean: bool) -> RankStatus:
        member = Member(self.ctx.rank, committed, clean=clean, has_state=True,
                        snapshots=tuple(self.copies.own), replicas=tuple(self.copies.replicas))
        return RankStatus(member, MODE_SHARDED)

    def attach(self, state: State) -> None:
        """Fault-injection points of the forward and backward pass (DDP's wrapper has them built
        in)."""
        model = state.model
        ctx = self.ctx
        if model is None or id(model) in self._hooked or not ctx.managed:
            return
        self._hooked.add(id(model))

        def in_backward(grad: torch.Tensor) -> None:
            ctx.faults.check("backward", ctx.current_step)

        def before_forward(module: torch.nn.Module, args: Any) -> None:
            ctx.faults.check("forward", ctx.current_step)

        def after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(in_backward)

        model.register_forward_pre_hook(before_forward)
        model.register_forward_hook(after_forward)

    # --- checkpoints ---------------------------------------------------------------

    def load_checkpoint(self, state: State, path: str, manifest: Manifest) -> None:
        """Collective: every rank loads its slices of ``path``, whatever world size wrote it."""
        sd = self.dcp_state_dict(state)
        try:
            check_compatible(manifest, path=path, state_shapes=tensor_shapes(sd))
        except UsageError as e:
            self.ctx.report_fatal(manifest.step, e)
            raise
        with self._internal():
            load_sharded(path, sd)
            sharding.load_dcp_state_dict(state, sd)
        self.copies.clear()
        detail: dict[str, Any] = {"checkpoint": path, "saved_world_size": manifest.world_size}
        if self.resume_digest:
            detail["digest"] = sharding.full_digest(self.dcp_state_dict(state))
        self.ctx.checkpoint_loaded(manifest, detail)

    # --- ring replication --------------------------------------------------------

    def due(self, index: int) -> bool:
        return self.ring and index % self.config.every == 0

    def replicate(self, state: State, step: int) -> None:
        """Inside step ``step``'s transaction, after its body: copy the shard to the successor,
        then agree.

        A comm failure propagates (the step aborts). A replica that fails its
        checksum is not kept: the older one stays, and the event says so.
        """
        started = time.perf_counter()
        ctx = self.ctx
        data = sharding.shard_bytes(state, {"data_origin": ctx.data_origin})
        self.copies.own[step] = data
        try:
            self.copies.replicas[step] = replica.exchange(data, self.successor, self.predecessor)
        except RecoveryError as e:
            log.error("rank %d: %s; keeping the older replica", ctx.rank, e)
            ctx.send(Progress(ctx.rank, ctx.generation, "replica_rejected", time.time(), step=step,
                              detail={"from": self.predecessor, "error": str(e)}))
        # The exchange ended in a barrier: every rank's successor holds its copy of this step.
        self.copies.committed(step)
        if not self._replicated_once:
            self._replicated_once = True
            # What one replication costs (serialize, exchange, agree): to size
            # UNDYING_REPLICATE_EVERY by.
            ctx.send(Progress(ctx.rank, ctx.generation, "replicating", time.time(), step=step,
                              detail={"to": self.successor, "from": self.predecessor,
                                      "every": self.config.every, "bytes": len(data),
                                      "seconds": round(time.perf_counter() - started, 6)}))

    def replicate_initial(self, state: State, committed: int) -> bool:
        """Before the first step of a launch: every shard has a copy from the start. False: a
        peer failed.

        Only processes that start the launch together do it; a replacement
        joins a loop that is already running (it got its copies in ``restore``).
        """
        env = self.ctx.env
        if not self.ring or self.copies.own or env is None or env.joining:
            return True
        try:
            self.replicate(state, committed)
        except Exception as e:
            if not is_comm_failure(e):
                raise
            self.ctx.aborted(e)
            return False
        return True

    # --- restore: carrying out the plan --------------------------------------------

    def restore(self, plan: RestorePlan, state: State | None) -> RankStatus:
        """Collective, in the new generation: every rank's shard at the plan's step, from memory.

        ``state`` is None in a replacement that has not built its model yet:
        what it receives waits for ``job.steps()`` (``JobContext.deferred``).
        """
        ctx = self.ctx
        target = plan.target
        assert target is not None and not plan.needs_checkpoint
        mine = plan.source(ctx.rank)
        works: list[dist.Work] = []
        for donor, receiver in plan.transfers():
            if donor == ctx.rank:
                works += replica.send_bytes(self.copies.replicas[target], receiver)
        payload: bytes | None = None
        if mine.kind == "replica":
            assert mine.rank is not None
            payload = replica.recv_bytes(mine.rank)
        if plan.transfers():
            settle([], works)  # every rank: a receiver that died mid-transfer strands no donor
        if mine.kind == "snapshot":
            payload = self.copies.own[target]
        if payload is not None:
            if state is not None:
                self._apply_shard(state, payload)
            else:
                data = payload
                ctx.deferred = (target, lambda st: self._apply_shard(st, data))
        self.copies.keep_only(target)
        if self.ring:
            # Every shard gets its replica back (the replacement's predecessor lost its holder).
            own = payload if payload is not None else self.copies.own.get(target)
            if own is None:
                assert state is not None
                own = sharding.shard_bytes(state, {"data_origin": ctx.data_origin})
            self.copies.own = {target: own}
            self.copies.replicas = {target: replica.exchange(own, self.successor, self.predecessor)}
        else:
            self.copies.clear()
        holder = mine.rank if mine.kind == "replica" else ctx.rank
        ctx.send(Progress(ctx.rank, ctx.generation, "shards_restored", time.time(), step=target,
                          detail={"plan": plan.describe(), "source": _SOURCE_NAMES[mine.kind],
                                  "holder": holder, "lost_steps": plan.lost_steps}))
        if plan.lost_steps and ctx.rank == 0:
            log.warning("job %s: sharded state restored at step %d (%s); %d step(s) are re-run",
                        ctx.env.job_id if ctx.env else "", target, plan.describe(), plan.lost_steps)
        # A replacement's shard waits in ctx.deferred: until steps() loads it, its own copy is the
        # source.
        return self.status(target, clean=state is not None)

    def _apply_shard(self, state: State, payload: bytes) -> None:
        with self._internal():
            extra = sharding.load_shard_bytes(state, payload)
        origin = extra.get("data_origin")
        if origin is not None:
            self.ctx.set_data_origin((int(origin[0]), int(origin[1])))

    def latest_checkpoint(self) -> tuple[PersistedState | None, Manifest | None]:
        """Collective: the latest valid sharded checkpoint (the coordinator reads every
        checksum), for the planner."""
        ctx = self.ctx
        assert ctx.env is not None
        ckpt = latest_valid_shared(ctx.env.checkpoint.checkpoint_dir).checkpoint
        manifest = ckpt.manifest if ckpt is not None else None
        if ckpt is None or manifest is None or manifest.layout.get("kind") != "sharded":
            log.error("rank %d: %s holds no valid sharded checkpoint", ctx.rank,
                      ctx.env.checkpoint.checkpoint_dir)
            return None, None
        return PersistedState(manifest.step, path=ckpt.url), manifest

    def rollback(self, plan: RestorePlan, manifest: Manifest, state: State | None) -> RankStatus:
        """Some shard comes from the checkpoint: every rank loads it, in place (a DCP load is
        collective)."""
        ctx = self.ctx
        step, path = manifest.step, plan.checkpoint_path
        assert plan.rollback_step == step
        self.copies.clear()
        ctx.send(Progress(ctx.rank, ctx.generation, "rolled_back", time.time(), step=step,
                          detail={"checkpoint": path, "lost_steps": plan.lost_steps,
                                  "reason": plan.describe()}))
        log.warning("job %s rank %d: %s; rolling back to %s (step %d, %d step(s) lost)",
                    ctx.env.job_id if ctx.env else "", ctx.rank, plan.describe(), path, step,
                    plan.lost_steps or 0)
        if state is not None:
            self.load_checkpoint(state, path, manifest)
        else:
            ctx.deferred = (step, lambda st: self.load_checkpoint(st, path, manifest))
        member = Member(ctx.rank, step, clean=state is not None, has_state=state is not None)
        return RankStatus(member, MODE_SHARDED)
