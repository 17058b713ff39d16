"""How this process starts: where its state comes from before its first step, and how it joins
the job.

``Job`` calls in here once, as it is built. A launch's rank resumes from the
checkpoint ``undying run --resume`` names (read now, loaded when the script's
State exists); a replacement takes its state from the members as it joins
the running generation (``worker.rejoin``). Which is the one planner's word
(``checkpoint.planner.plan_start``). Outside ``undying run`` the process
trains on its own state, without fault tolerance (``unmanaged_context``).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading

import torch.distributed as dist

from undying.checkpoint.planner import StatePlan, plan_start
from undying.protocol.codec import Message
from undying.worker.checkpoints import Checkpoints
from undying.worker.context import JobContext
from undying.worker.env import WorkerEnv
from undying.worker.faults import FaultSwitch
from undying.worker.rejoin import Rejoin
from undying.worker.shards import Shards
from undying.worker.threads import StoppedAtExit
from undying.worker.tracing import WorkerTracing

__all__ = ["resume_at_start", "join_at_start", "unmanaged_context"]

log = logging.getLogger("undying.worker")


def resume_at_start(env: WorkerEnv | None, checkpoints: Checkpoints, shards: Shards) -> StatePlan:
    """The one planner: a replacement's state comes from the members, a launch's from its
    checkpoint.

    An unmanaged script's comes from itself. A checkpoint is read now; its
    state waits for the script's State (``Checkpoints.load_waiting``).
    """
    if env is None:
        return plan_start(joining=False, checkpoint=None)
    found = (checkpoints.resume_point(env.resume_from) if env.resume_from and not env.joining
             else None)
    start = plan_start(joining=env.joining, checkpoint=found[0] if found is not None else None)
    if start.source.kind == "checkpoint":
        assert found is not None
        checkpoints.resume(start, found[1], shards)
    return start


def join_at_start(env: WorkerEnv, rejoin: Rejoin) -> None:
    """Join the job's current generation: as a replacement, in a group the script built, or a
    new one."""
    if env.joining:
        _prewarm_imports()
        # A script that built its own group joined this generation already.
        rejoin.join_as_replacement(adopt=dist.is_initialized())
    elif dist.is_initialized():
        rejoin.adopt_user_group()
    else:
        rejoin.join(env.generation)


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


def unmanaged_context() -> JobContext:
    """Outside ``undying run``: plain torchrun or a single process, no fault tolerance."""
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1

    def nowhere(message: Message) -> None:
        pass

    return JobContext(None, rank, world_size, int(os.environ.get("LOCAL_RANK", "0")), 0, nowhere,
                      FaultSwitch(rank, nowhere, {}), WorkerTracing(None, rank, nowhere))
