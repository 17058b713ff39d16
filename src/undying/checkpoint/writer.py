"""The async writer: a save blocks the training loop only for a CPU copy; the write runs on a
thread.

``AsyncCheckpointer`` splits a save into the only part that must block the
training loop, a deep copy of the state into CPU memory (``cpu_copy.py``), and
the write (``replicated.save_replicated``), which runs in a background thread
on that private copy; the live tensors are never read by the writer, so
training may mutate them right after ``save`` returns. What happens when a
write fails (retries on storage errors, supersession by a newer save, the
error raised once by ``wait``) is this module's other concern; the format and
the commit are not: they live in ``replicated`` and ``commit``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from undying.checkpoint.commit import SaveResult
from undying.checkpoint.cpu_copy import cpu_copy
from undying.checkpoint.manifest import Checksum
from undying.checkpoint.replicated import save_replicated
from undying.checkpoint.room import os_error_of, with_room
from undying.checkpoint.store import CheckpointError, Store

__all__ = ["CheckpointWriteError", "SaveTicket", "AsyncCheckpointer"]

log = logging.getLogger("undying.checkpoint")


class CheckpointWriteError(CheckpointError):
    """A background checkpoint write failed; ``__cause__`` is the original exception.

    ``attempt`` of ``attempts`` says which try this was; ``retry_in`` is the
    delay before the next one, None when no retry follows.
    """

    def __init__(
        self, step: int, cause: BaseException, *, attempt: int = 1, attempts: int = 1,
        retry_in: float | None = None, note: str = "",
    ) -> None:
        if retry_in is not None:
            how = f" (attempt {attempt} of {attempts}; retrying in {retry_in:g}s, training goes on)"
        elif attempts > 1 or note:
            how = f" (attempt {attempt} of {attempts}{'; ' + note if note else ''})"
        else:
            how = ""
        super().__init__(f"checkpoint write of step {step} failed{how}: "
                         f"{type(cause).__name__}: {cause}")
        self.__cause__ = cause
        self.step = step
        self.attempt = attempt
        self.attempts = attempts
        self.retry_in = retry_in


@dataclass(frozen=True)
class SaveTicket:
    """What ``AsyncCheckpointer.save`` returns at once: the stall it caused, or that it skipped."""

    step: int
    blocking_s: float
    waited_s: float
    skipped: bool


@dataclass
class _Job:
    """One save: the private snapshot and what its manifest needs, plus its retry state."""

    step: int
    snapshot: Any
    kind: str
    generation: int
    digest: str | None
    meta: dict[str, Any] | None
    blocking: float
    # Set to end the job's retries: by a newer save ("superseded") or by wait(retries=False).
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str = ""
    superseded: bool = False
    phase: Literal["writing", "backoff", "done"] = "writing"
    done: threading.Event = field(default_factory=threading.Event)


def _writer_loop(ref: weakref.ReferenceType[AsyncCheckpointer], cond: threading.Condition,
                 queue: collections.deque[_Job | None]) -> None:
    """The writer thread: runs queued saves until told to stop or its checkpointer is gone.

    It holds its checkpointer only weakly while idle, so an AsyncCheckpointer
    that is dropped without ``close()`` does not keep a thread alive forever.
    """
    while True:
        with cond:
            while not queue:
                if ref() is None:
                    return
                cond.wait(1.0)
            job = queue.popleft()
        if job is None:
            return
        owner = ref()
        if owner is None:
            job.done.set()
            return
        try:
            owner._run(job)
        finally:
            job.done.set()
        del owner


class AsyncCheckpointer:
    """Replicated checkpoints written in a background thread; the caller blocks only for the CPU
    copy.

    At most one write is in flight. A ``save`` while one is writing follows
    ``if_busy``: ``"wait"`` (default) blocks until the previous write ends, so no
    checkpoint is dropped (the wait is reported as ``waited_s``, separate from
    the copy's ``blocking_s``); ``"skip"`` returns at once with ``skipped=True``
    and a log line, so training never stalls beyond the copy. A dying-gasp
    save always waits: it is the last chance.

    A write that fails on storage (an OSError anywhere in its cause chain: an
    unwritable or vanished folder, a full disk, a network store that refused)
    is retried on the same snapshot, up to ``max_attempts`` attempts in all,
    after ``retry_delay_s``, doubling each time (at most ``retry_delay_max_s``),
    while training goes on. A ``save`` that comes while a retry is pending
    supersedes it: the newer state is worth more than the older one. A failure
    that is not a storage error (a state that cannot be pickled) is not retried.

    Every failed attempt is logged at ERROR, kept in ``errors`` and
    ``last_error``, and passed to ``on_done(None, error)`` (``error.retry_in``
    says whether a retry follows); a save that fails for good (attempts spent,
    not retryable, or its retry dropped by ``wait(retries=False)``) is raised
    once by the next ``wait()`` as CheckpointWriteError. ``save`` itself never
    raises for an earlier failure. A failed write never touches the previous
    checkpoints: it writes aside and commits by rename, and retention runs only
    after a successful commit and always keeps the latest valid checkpoint.

    The thread is a daemon: call ``close()`` (or ``wait()``) before the process
    exits, or the last write may be cut short (it would then be skipped as
    partial by discovery, never loaded).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Store,
        *,
        job_id: str = "",
        world_size: int = 1,
        keep: int | None = None,
        if_busy: Literal["wait", "skip"] = "wait",
        checksum: Checksum | None = None,
        layout_extra: dict[str, Any] | None = None,
        on_done: Callable[[SaveResult | None, CheckpointWriteError | None], None] | None = None,
        on_pruned: Callable[[int, list[str]], None] | None = None,
        max_attempts: int = 3,
        retry_delay_s: float = 1.0,
        retry_delay_max_s: float = 30.0,
    ) -> None:
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if retry_delay_s < 0 or retry_delay_max_s < 0:
            raise ValueError("retry delays must be >= 0")
        self.store = root if isinstance(root, Store) else Store.open(root)
        self.job_id = job_id
        self.world_size = world_size
        self.keep = keep
        self.if_busy = if_busy
        self.checksum: Checksum | None = checksum
        self.layout_extra = layout_extra
        self.on_done = on_done  # called from the writer thread with the result or the error
        # (step, names) when a save had to delete older checkpoints for room
        self.on_pruned = on_pruned
        self.max_attempts = max_attempts
        self.retry_delay_s = retry_delay_s
        self.retry_delay_max_s = retry_delay_max_s
        self.last_result: SaveResult | None = None
        self.last_error: CheckpointWriteError | None = None
        self.errors: list[CheckpointWriteError] = []
        self._thread: threading.Thread | None = None
        self._queue: collections.deque[_Job | None] = collections.deque()
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._unreported: CheckpointWriteError | None = None
        self._lock = threading.Lock()

        # Started now, not in the first save: starting a thread makes its caller wait for it to run
        # and then for the GIL back, a few ms of stall that a long-lived writer pays only once.
        self._start_writer()

    def _start_writer(self) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            return
        self._thread = threading.Thread(
            target=_writer_loop, args=(weakref.ref(self), self._cond, self._queue),
            name="undying-ckpt-writer", daemon=True,
        )
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A save is being written or waits for its retry."""
        job = self._job
        return job is not None and not job.done.is_set()

    @property
    def retry_pending(self) -> bool:
        """A failed save waits for its next attempt (a new ``save`` would supersede it)."""
        with self._lock:
            return self.busy and self._job is not None and self._job.phase == "backoff"

    def retry_delay(self, attempt: int) -> float:
        """Seconds before attempt ``attempt + 1``: ``retry_delay_s`` doubled per failed attempt,
        capped."""
        return float(min(self.retry_delay_max_s, self.retry_delay_s * 2 ** (attempt - 1)))

    def _cancel(self, job: _Job, reason: str, *, superseded: bool) -> None:
        """End ``job``'s retries (call under the lock); ``superseded``: a newer save replaces it."""
        if not job.cancel.is_set():
            job.cancel_reason = reason
            job.superseded = superseded
            job.cancel.set()

    def save(
        self,
        step: int,
        state_dict: Any,
        *,
        kind: str = "periodic",
        generation: int = 0,
        digest: str | None = None,
        meta: dict[str, Any] | None = None,
        last: bool = False,
    ) -> SaveTicket:
        """Copy ``state_dict`` to CPU (blocking, measured) and write it in the background.

        ``last``: the job's last step, never skipped (as a dying gasp is not): a
        skip would end the job with its newest state saved nowhere.
        """
        waited = 0.0
        must_write = last or kind == "dying-gasp"
        if self.busy:
            with self._lock:
                job = self._job
                writing = job is not None and job.phase == "writing"
                if job is not None and (not writing or self.if_busy == "wait" or must_write):
                    # A pending retry ends now; a write in progress finishes its attempt, no retry
                    # after.
                    self._cancel(job, f"superseded by the save of step {step}", superseded=True)
            if writing and self.if_busy == "skip" and not must_write:
                log.info("checkpoint of step %d skipped: the previous write is still running", step)
                return SaveTicket(step, 0.0, 0.0, True)
            t0 = time.perf_counter()
            self._join()
            waited = time.perf_counter() - t0
        t0 = time.perf_counter()
        snapshot = cpu_copy(state_dict)
        blocking = time.perf_counter() - t0
        job = _Job(step, snapshot, kind, generation, digest, meta, blocking)
        with self._lock:
            self._job = job
        self._start_writer()  # only if it was stopped by close()
        with self._cond:
            self._queue.append(job)
            self._cond.notify()
        return SaveTicket(step, blocking, waited, False)

    def _run(self, job: _Job) -> None:
        """The writer thread: attempt, and on a storage error wait and attempt again, until done."""
        attempt = 0
        while True:
            attempt += 1
            try:
                result = with_room(self.store, lambda: save_replicated(
                    self.store,
                    job.step,
                    job.snapshot,
                    job_id=self.job_id,
                    generation=job.generation,
                    world_size=self.world_size,
                    kind=job.kind,
                    digest=job.digest,
                    meta=job.meta,
                    layout_extra=self.layout_extra,
                    checksum=self.checksum,
                    keep=self.keep,
                    blocking_s=job.blocking,
                ), on_pruned=lambda names: self._pruned(job.step, names))
            except BaseException as e:  # kept, reported and re-raised by wait(): never lost
                storage = os_error_of(e) is not None
                retry = storage and attempt < self.max_attempts and not job.cancel.is_set()
                delay = self.retry_delay(attempt) if retry else None
                if retry:
                    note = ""
                elif job.cancel.is_set():
                    note = f"not retried: {job.cancel_reason}"
                elif not storage:
                    note = "not retried: not a storage error"
                else:
                    note = "giving up" if self.max_attempts > 1 else ""
                err = CheckpointWriteError(
                    job.step, e, attempt=attempt, attempts=self.max_attempts, retry_in=delay,
                    note=note,
                )
                log.error("%s", err)
                with self._lock:
                    self.last_error = err
                    self.errors.append(err)
                    job.phase = "backoff" if retry else "done"
                    if not retry and not job.superseded:
                        self._unreported = err  # failed for good, and nothing newer replaces it
                self._notify(None, err)
                if not retry:
                    self._finish(job)
                    return
                assert delay is not None
                if job.cancel.wait(delay):
                    log.warning("retry of the checkpoint of step %d dropped: %s", job.step,
                                job.cancel_reason)
                    with self._lock:
                        if not job.superseded:
                            self._unreported = err
                    self._finish(job)
                    return
                with self._lock:
                    job.phase = "writing"
                log.warning("checkpoint of step %d: attempt %d of %d", job.step, attempt + 1,
                            self.max_attempts)
                continue
            with self._lock:
                self.last_result = result
            if attempt > 1:
                log.warning("checkpoint of step %d written on attempt %d", job.step, attempt)
            self._notify(result, None)
            self._finish(job)
            return

    def _pruned(self, step: int, names: list[str]) -> None:
        if self.on_pruned is not None:
            try:
                self.on_pruned(step, names)
            except Exception:  # a report must never break the writer
                log.exception("checkpoint on_pruned callback failed")

    def _finish(self, job: _Job) -> None:
        with self._lock:
            job.phase = "done"
            job.snapshot = None  # the copy can be freed even while this object lives on

    def _notify(self, result: SaveResult | None, error: CheckpointWriteError | None) -> None:
        if self.on_done is None:
            return
        try:
            self.on_done(result, error)
        except Exception:  # a report must never break the writer
            log.exception("checkpoint on_done callback failed")

    def _join(self, timeout: float | None = None) -> bool:
        job = self._job
        if job is None:
            return True
        return job.done.wait(timeout)

    def wait(self, timeout: float | None = None, *, retries: bool = True) -> SaveResult | None:
        """Wait for the save in flight, its retries included; raise CheckpointWriteError if a save
        failed for good.

        ``retries=False`` drops a pending retry (an attempt already writing
        finishes): for a dying gasp that is about to write a newer state itself.
        Raises TimeoutError when ``timeout`` passes first (the write goes on).
        """
        if not retries:
            with self._lock:
                if self._job is not None and self._job.phase != "done":
                    self._cancel(self._job, "dropped by wait(retries=False)", superseded=False)
        if not self._join(timeout):
            raise TimeoutError(f"checkpoint write still running after {timeout}s")
        with self._lock:
            err, self._unreported = self._unreported, None
        if err is not None:
            raise err
        return self.last_result

    def close(self, timeout: float | None = None) -> SaveResult | None:
        """``wait``, then stop the writer thread (a later ``save`` starts it again)."""
        try:
            return self.wait(timeout)
        finally:
            self._stop_writer()

    def _stop_writer(self) -> None:
        """End the idle writer thread; not while a save is in flight (a timed-out wait leaves it
        be)."""
        thread = self._thread
        if thread is None or self.busy:
            return
        with self._cond:
            self._queue.append(None)
            self._cond.notify()
        thread.join()
        self._thread = None

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()  # a failed write surfaces here
            return
        # Do not mask the exception in flight, nor hold it up for backoffs: drop a pending retry.
        with self._lock:
            if self._job is not None and self._job.phase != "done":
                self._cancel(self._job, "dropped: the with block raised", superseded=False)
        self._join()
        self._stop_writer()

