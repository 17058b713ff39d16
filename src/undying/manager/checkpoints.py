"""The job's persisted checkpoints as the manager sees them: where to resume, what was saved, how fast.

The manager reads the checkpoint directory only for two answers (the newest
valid checkpoint to start or restart from, with every newer one it skipped
and why) and learns the rest from the ranks' reports: each save or failed save,
its size and write speed (which size the dying gasp's grace period), and how
the ranks hold the state (replicated, or sharded with or without a ring).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from undying.checkpoint import Checkpoint, latest_valid
from undying.checkpoint.checks import CheckpointOfAnotherJobError, check_same_job
from undying.errors import UsageError
from undying.manager.core import JobCore
from undying.protocol.worker_wire import CheckpointSaved

__all__ = ["Checkpoints"]

log = logging.getLogger("undying.manager")


class Checkpoints:
    def __init__(self, core: JobCore) -> None:
        self.core = core
        self.dir = core.config.checkpoint_dir
        self.resumed_from: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self.last_skipped: list[tuple[str, str]] = []
        self.state_bytes = 0
        self.write_bytes_per_s = 0.0
        # How the ranks hold the state (rank 0's state_layout event): {"sharded": False} is DDP's.
        self.state_layout: dict[str, Any] = {"sharded": False}

    @property
    def sharded(self) -> bool:
        return bool(self.state_layout.get("sharded"))

    @property
    def ring(self) -> bool:
        """Sharded with ring replicas: every shard has a copy on another rank."""
        return self.state_layout.get("replicate") == "ring"

    def latest(self) -> Checkpoint | None:
        """The newest valid checkpoint; every newer one skipped is logged with why."""
        events = self.core.events
        try:
            found = latest_valid(self.dir)
        except Exception as e:  # an unreachable store is no checkpoint, said once
            events.event("checkpoint_unreadable", path=self.dir, error=f"{type(e).__name__}: {e}")
            return None
        self.last_skipped = list(found.skipped)
        for name, reason in found.skipped:
            events.event("checkpoint_skipped", name=name, reason=reason)
        return found.checkpoint

    async def find_resume_point(self) -> Checkpoint | None:
        """Where a starting job begins: the newest valid checkpoint of this job, or None (step 1)."""
        config, events = self.core.config, self.core.events
        ckpt = await asyncio.to_thread(self.latest)
        if ckpt is None:
            if self.last_skipped and not config.start_fresh:
                # Starting from step 1 silently would throw away a run whose checkpoints only need fixing.
                reasons = "; ".join(f"{name}: {reason}" for name, reason in self.last_skipped)
                error = UsageError(
                    f"every checkpoint in {self.dir} was rejected ({reasons}); fix or move them, or pass "
                    "--start-fresh to train from step 1 (the rejected checkpoints are kept)")
                events.event("checkpoints_rejected", path=self.dir,
                             rejected=[{"name": n, "reason": r} for n, r in self.last_skipped])
                events.set_job("exit_reason", str(error), flush=True)
                raise error
            return None
        try:  # another job's checkpoint: refused when --job-id named this job, else resumed and said
            other_job = check_same_job(ckpt, config.job_id, config.job_id_given)
        except CheckpointOfAnotherJobError as e:
            events.event("checkpoint_refused", name=ckpt.name, path=ckpt.url, reason=str(e))
            events.set_job("exit_reason", str(e), flush=True)
            raise
        if other_job is not None:
            log.warning("job %s: %s", config.job_id, other_job)
        skipped = [{"name": n, "reason": r} for n, r in self.last_skipped]
        of_job = ckpt.manifest.job_id if ckpt.manifest is not None else ""
        self.resumed_from = {"step": ckpt.step, "path": ckpt.url, "kind": ckpt.kind, "skipped": skipped,
                             "job_id": of_job}
        events.event("resumed", step=ckpt.step, path=ckpt.url, kind=ckpt.kind, skipped=skipped, job_id=of_job)
        events.set_job("resumed_from", self.resumed_from, flush=True)
        log.warning("job %s: resuming from checkpoint %s (step %d, %s)%s", config.job_id, ckpt.url, ckpt.step,
                    ckpt.kind, "".join(f"; skipped {d['name']}: {d['reason']}" for d in skipped))
        return ckpt

    def on_saved(self, message: CheckpointSaved) -> None:
        """A rank's report of a save: logged, measured, and a failing streak tracked (checkpoint_health)."""
        events = self.core.events
        if message.error:
            events.event("checkpoint_failed", rank=message.rank, step=message.step, kind=message.kind,
                         error=message.error, os_error=message.os_error)
            self.core.health.failed(message)
            log.error("job %s: checkpoint of step %d failed: %s", self.core.config.job_id, message.step,
                      message.error)
            return
        events.event("checkpoint_saved", rank=message.rank, step=message.step, kind=message.kind,
                     path=message.path, blocking_s=round(message.blocking_s, 6),
                     write_s=round(message.write_s, 6), bytes=message.bytes)
        if message.bytes > 0 and message.write_s > 0:
            self.state_bytes = message.bytes
            self.write_bytes_per_s = message.bytes / message.write_s
        self.last = {"step": message.step, "kind": message.kind, "path": message.path,
                     "blocking_s": message.blocking_s, "write_s": message.write_s,
                     "bytes": message.bytes, "t": message.t}
        events.set_job("last_checkpoint", self.last)
        self.core.health.saved(message)

    def on_state_reported(self, phase: str, detail: dict[str, Any]) -> None:
        """A rank's progress report about its state: its size, or how the ranks hold it."""
        if phase == "state_size":
            self.state_bytes = int(detail.get("bytes", 0))
        elif phase == "state_layout":
            self.state_layout = dict(detail)
