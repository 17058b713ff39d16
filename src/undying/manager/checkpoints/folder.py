"""The job's persisted checkpoints as the manager sees them: where to resume,
what was saved, how fast.

The manager reads the checkpoint directory only for two answers (the newest
valid checkpoint to start or restart from, with every newer one it skipped
and why) and learns the rest from the ranks' reports: each save or failed save,
its size and write speed (which size the dying gasp's grace period), and how
the ranks hold the state (replicated, or sharded with or without a ring).

It also owns the checkpoint dir for the job's life (``checkpoint.lock``): a
second job on it is refused in one line, and a job that loses it (its lock
taken by another) fails before it saves again. Under ``--start-fresh`` the
rejected checkpoints are set aside whole (``checkpoint.aside``), and a
resume that re-runs steps the last launch's log shows committed says so,
and why (``relaunch_rerun``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from undying.checkpoint import Checkpoint, Store, latest_valid
from undying.checkpoint.aside import REJECTED_DIR, batch_name, set_aside
from undying.checkpoint.checks import CheckpointOfAnotherJobError, check_same_job
from undying.checkpoint.lock import hold
from undying.errors import UsageError
from undying.jobfiles.events import LogReader
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.reruns import relaunch_rerun, rerun_words
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
        self.owned = False
        self._reowning: asyncio.Task[None] | None = None

    def own(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hold the checkpoint dir for the job's life, or raise DirInUseError
        (one line) naming its owner.

        Released with the job dir's (``JobDir.clear_manager``) when the job is over, else when this
        process ends. Losing it later (another process holds its lock: a stranger replaced
        the file, or a URL lease ran out while this process was stopped) fails
        the job: its next save could land beside another job's.
        """
        def lost(reason: str) -> None:  # (on the lock's keeper thread: the rest runs on the loop)
            loop.call_soon_threadsafe(self._lost, reason)

        hold(self.dir, job_id=self.core.config.job_id, on_lost=lost,
             advice="wait for it to end, or pass another --checkpoint-dir")
        self.owned = True

    async def take_dir(self) -> None:
        """``own`` off the loop (a URL lease takes a moment); a refusal is logged here,
        on the loop, and raised."""
        try:
            await asyncio.to_thread(self.own, asyncio.get_running_loop())
        except UsageError as e:
            self.core.events.event("checkpoint_dir_in_use", path=self.dir, reason=str(e))
            self.core.events.set_job("exit_reason", str(e), flush=True)
            raise

    def reown(self) -> None:
        """A restarted manager takes its checkpoint dir back, in the background: the lease of its
        predecessor on another host may take up to a minute to go stale, and the agents reconnect
        meanwhile. Another job holding the folder now fails this one, with the reason."""
        async def take() -> None:
            try:
                await self.take_dir()
            except UsageError as e:
                self.core.fail(str(e))

        self._reowning = asyncio.get_running_loop().create_task(take())

    def _lost(self, reason: str) -> None:
        self.core.events.event("checkpoint_dir_lost", path=self.dir, reason=reason)
        self.core.fail(f"checkpoint dir {self.dir} lost: {reason}; the job stops before it writes "
                       "beside another job's checkpoints")

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
        """Where a starting job begins: the newest valid checkpoint of this job,
        or None (step 1)."""
        config, events = self.core.config, self.core.events
        await self.take_dir()
        ckpt = await asyncio.to_thread(self.latest)
        last = await asyncio.to_thread(self._last_launch)
        if ckpt is None:
            if self.last_skipped and not config.start_fresh:
                # Starting from step 1 silently would throw away a run whose checkpoints only need
                # fixing.
                reasons = "; ".join(f"{name}: {reason}" for name, reason in self.last_skipped)
                error = UsageError(
                    f"every checkpoint in {self.dir} was rejected ({reasons}); fix or move them, "
                    "or pass --start-fresh to train from step 1 (it moves them, whole, to "
                    "rejected/ there)")
                events.event("checkpoints_rejected", path=self.dir,
                             rejected=[{"name": n, "reason": r} for n, r in self.last_skipped])
                events.set_job("exit_reason", str(error), flush=True)
                raise error
            if self.last_skipped:
                where, moved = await asyncio.to_thread(self._set_aside_rejected)
                if moved:
                    events.event("checkpoints_set_aside", path=where, names=moved)
                    log.warning("job %s: --start-fresh: the %d rejected checkpoint(s) moved to %s, "
                                "whole; nothing of this job touches them again", config.job_id,
                                len(moved), where)
            rerun = self._rerun(0, last)
            if rerun is not None:
                log.warning("job %s: starting at step 1: %s", config.job_id, rerun_words(rerun))
            return None
        # another job's checkpoint: refused when --job-id named this job, else resumed and said
        try:
            other_job = check_same_job(ckpt, config.job_id, config.job_id_given)
        except CheckpointOfAnotherJobError as e:
            events.event("checkpoint_refused", name=ckpt.name, path=ckpt.url, reason=str(e))
            events.set_job("exit_reason", str(e), flush=True)
            raise
        if other_job is not None:
            log.warning("job %s: %s", config.job_id, other_job)
        skipped = [{"name": n, "reason": r} for n, r in self.last_skipped]
        of_job = ckpt.manifest.job_id if ckpt.manifest is not None else ""
        rerun = self._rerun(ckpt.step, last)
        self.resumed_from = {"step": ckpt.step, "path": ckpt.url, "kind": ckpt.kind,
                             "skipped": skipped, "job_id": of_job, "rerun": rerun}
        events.event("resumed", step=ckpt.step, path=ckpt.url, kind=ckpt.kind, skipped=skipped,
                     job_id=of_job, rerun=rerun)
        events.set_job("resumed_from", self.resumed_from, flush=True)
        log.warning("job %s: resuming from checkpoint %s (step %d, %s)%s%s", config.job_id,
                    ckpt.url, ckpt.step,
                    ckpt.kind, "".join(f"; skipped {d['name']}: {d['reason']}" for d in skipped),
                    f"; {rerun_words(rerun)}" if rerun else "")
        return ckpt

    def _last_launch(self) -> tuple[int, int] | None:
        """The newest step the last launch in this job dir committed,
        and the newest it saved; None: no log."""
        logs = JobDir(Path(self.core.config.job_dir)).earlier_logs()
        if not logs:
            return None
        try:
            with LogReader(logs[-1]) as reader:
                committed = reader.newest_step()
                saved = max((int(e.data.get("step", 0))
                             for e in reader.events("checkpoint_saved")), default=0)
        # a damaged old log costs this one line, not the run
        except (OSError, UsageError, LogReader.Error) as e:
            log.warning("job %s: the last launch's log %s cannot be read (%s)",
                        self.core.config.job_id, logs[-1], e)
            return None
        return committed, saved

    def _rerun(self, resume_step: int, last: tuple[int, int] | None) -> dict[str, Any] | None:
        """What this launch re-runs that the last one committed (recorded as the job's
        ``relaunch_rerun``)."""
        if last is None:
            return None
        skipped = [n for n, _ in self.last_skipped]
        rerun = relaunch_rerun(resume_step, last[0], last[1], skipped, self.dir)
        if rerun is not None:
            self.core.events.event("relaunch_rerun", **rerun)
            self.core.events.set_job("relaunch_rerun", rerun, flush=True)
        return rerun

    def _set_aside_rejected(self) -> tuple[str, list[str]]:
        """``--start-fresh``: every rejected checkpoint moves to ``rejected/<time>/``, whole, before
        step 1; where, and the names moved."""
        store = Store.open(self.dir)
        batch = batch_name()
        moved: list[str] = []
        for name, reason in self.last_skipped:
            try:
                set_aside(store, name, reason, batch=batch)
                moved.append(name)
            # left where it is: still never overwritten nor pruned (not signed by this job)
            except OSError as e:
                log.warning("job %s: %s could not be set aside (%s); it stays where it is",
                            self.core.config.job_id, name, e)
        return store.url_of(store.join(REJECTED_DIR, batch)), moved

    def on_saved(self, message: CheckpointSaved) -> None:
        """A rank's report of a save: logged, measured, and a failing streak tracked
        (checkpoint_health)."""
        events = self.core.events
        if message.error:
            events.event("checkpoint_failed", rank=message.rank, step=message.step,
                         kind=message.kind, error=message.error, os_error=message.os_error)
            self.core.health.failed(message)
            log.error("job %s: checkpoint of step %d failed: %s", self.core.config.job_id,
                      message.step, message.error)
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
