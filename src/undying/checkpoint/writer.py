"""Replicated checkpoints (every rank holds the same state, as under DDP) and the async writer.

One rank writes ``torch.save`` of a CPU copy of the state into ``state.pt``,
hashing the bytes as they stream out (no second read for the checksum), and
commits through ``PendingCheckpoint`` (aside, fsync, rename, manifest last).

``AsyncCheckpointer`` splits a save into the only part that must block the
training loop, a deep copy of the state into CPU memory, and the write, which
runs in a background thread on that private copy; the live tensors are never
read by the writer, so training may mutate them right after ``save`` returns.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from undying.checkpoint.manifest import Checksum, FileEntry, Hasher, Manifest
from undying.checkpoint.store import (
    Checkpoint,
    CheckpointError,
    PendingCheckpoint,
    Store,
    prune,
    verify,
)

__all__ = [
    "STATE_FILE",
    "SaveResult",
    "SaveTicket",
    "CheckpointWriteError",
    "cpu_copy",
    "save_replicated",
    "load_replicated",
    "AsyncCheckpointer",
]

log = logging.getLogger("undying.checkpoint")

STATE_FILE = "state.pt"


class CheckpointWriteError(CheckpointError):
    """A background checkpoint write failed; ``__cause__`` is the original exception."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(f"checkpoint write of step {step} failed: {type(cause).__name__}: {cause}")
        self.step = step


@dataclass(frozen=True)
class SaveResult:
    """A committed checkpoint: where, and what it cost (``blocking_s`` is the training-loop stall)."""

    step: int
    path: str
    kind: str
    blocking_s: float
    write_s: float
    bytes: int

    @property
    def write_bytes_per_s(self) -> float:
        return self.bytes / self.write_s if self.write_s > 0 else float("inf")


@dataclass(frozen=True)
class SaveTicket:
    """What ``AsyncCheckpointer.save`` returns at once: the stall it caused, or that it skipped."""

    step: int
    blocking_s: float
    waited_s: float
    skipped: bool


class _HashingWriter:
    """Passes writes through to a file while checksumming them, for torch.save."""

    def __init__(self, f: Any, algorithm: Checksum) -> None:
        self._f = f
        self.hasher = Hasher(algorithm)

    def write(self, data: bytes) -> int:
        self.hasher.update(data)
        return int(self._f.write(data))

    def flush(self) -> None:
        self._f.flush()


def cpu_copy(obj: Any, _memo: dict[int, Any] | None = None) -> Any:
    """A deep copy of a state dict with every tensor cloned into CPU memory.

    The clone is what makes async saving safe: the writer thread only ever sees
    this copy. A tensor that appears twice (tied weights) is copied once and
    stays shared, so torch.save stores it once, as it would have.
    """
    memo: dict[int, Any] = {} if _memo is None else _memo
    key = id(obj)
    if key in memo:
        return memo[key]
    out: Any
    if isinstance(obj, torch.Tensor):
        out = obj.detach().to("cpu", copy=True)
    elif isinstance(obj, dict):
        try:
            out = type(obj)()
        except TypeError:
            out = {}
        for k, v in obj.items():
            out[k] = cpu_copy(v, memo)
    elif isinstance(obj, list):
        out = [cpu_copy(v, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [cpu_copy(v, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        out = copy.deepcopy(obj, {})
    memo[key] = out
    return out


def _replicated_layout(extra: dict[str, Any] | None) -> dict[str, Any]:
    return {**(extra or {}), "kind": "replicated", "file": STATE_FILE}


def save_replicated(
    root: str | os.PathLike[str] | Store,
    step: int,
    state_dict: Any,
    *,
    job_id: str = "",
    generation: int = 0,
    world_size: int = 1,
    kind: str = "periodic",
    digest: str | None = None,
    meta: dict[str, Any] | None = None,
    layout_extra: dict[str, Any] | None = None,
    checksum: Checksum = "crc32",
    overwrite: bool = True,
    keep: int | None = None,
    blocking_s: float = 0.0,
) -> SaveResult:
    """Write ``state_dict`` (already on CPU, or it is copied) as checkpoint ``step``; call on ONE rank.

    Synchronous: returns once the manifest is committed. ``keep`` prunes older
    checkpoints afterwards. On any failure the temp folder is removed and the
    previous checkpoints are untouched.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    started = time.perf_counter()
    pending = PendingCheckpoint(store, step, overwrite=overwrite)
    try:
        with store.open_write(pending.file_path(STATE_FILE)) as f:
            w = _HashingWriter(f, checksum)
            torch.save(state_dict, w)  # type: ignore[arg-type]
        entry = FileEntry(STATE_FILE, w.hasher.size, w.hasher.hexdigest(), checksum)
        manifest = Manifest(
            step=step,
            world_size=world_size,
            layout=_replicated_layout(layout_extra),
            kind=kind,
            job_id=job_id,
            generation=generation,
            created_at=time.time(),
            files=(entry,),
            digest=digest,
            meta=dict(meta or {}),
        )
        ckpt = pending.commit(manifest)
    except OSError as e:
        pending.abort()
        raise CheckpointError(
            f"cannot write checkpoint {store.url_of(pending.final_path)} ({e.strerror or e})"
        ) from e
    except BaseException:
        pending.abort()
        raise
    write_s = time.perf_counter() - started
    if keep is not None:
        prune(store, keep)
    log.info("checkpoint %s written: %d bytes in %.3fs", ckpt.url, entry.size, write_s)
    return SaveResult(step, ckpt.url, kind, blocking_s, write_s, entry.size)


def load_replicated(
    checkpoint: Checkpoint | str | os.PathLike[str],
    *,
    check: bool = True,
    map_location: str | torch.device = "cpu",
    weights_only: bool = True,
) -> tuple[Any, Manifest]:
    """The state and manifest of a replicated checkpoint, after verifying every checksum.

    ``weights_only`` is torch.load's: keep True unless the state holds Python
    objects beyond tensors and containers (then pass False, trusting the root).
    """
    url = checkpoint.url if isinstance(checkpoint, Checkpoint) else os.fspath(checkpoint)
    if check:
        problems = verify(url)
        if problems:
            raise CheckpointError(f"checkpoint {url} is not valid: " + "; ".join(problems))
    parent, name = url.rstrip("/").rsplit("/", 1) if "://" in url else os.path.split(os.path.abspath(url))
    store = Store.open(parent)
    manifest = Manifest.from_json(store.read_bytes(store.join(name, "manifest.json")))
    if manifest.layout.get("kind") != "replicated":
        raise CheckpointError(
            f"checkpoint {url} has layout {manifest.layout.get('kind')!r}; load it with load_sharded"
        )
    with store.open_read(store.join(name, manifest.layout.get("file", STATE_FILE))) as f:
        state = torch.load(f, map_location=map_location, weights_only=weights_only)
    return state, manifest


class AsyncCheckpointer:
    """Replicated checkpoints written in a background thread; the caller blocks only for the CPU copy.

    At most one write is in flight. A ``save`` while one is writing follows
    ``if_busy``: ``"wait"`` (default) blocks until the previous write ends, so no
    checkpoint is dropped (the wait is reported as ``waited_s``, separate from
    the copy's ``blocking_s``); ``"skip"`` returns at once with ``skipped=True``
    and a log line, so training never stalls beyond the copy. A dying-gasp
    save always waits: it is the last chance.

    A failed write is logged at ERROR when it happens, kept in ``errors`` and
    ``last_error``, and raised by the next ``wait()`` as CheckpointWriteError;
    ``save`` itself does not raise for an earlier failure, so training goes on
    and the next save is the retry. Previous checkpoints are never touched by a
    failed write.

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
        checksum: Checksum = "crc32",
        layout_extra: dict[str, Any] | None = None,
        on_done: Callable[[SaveResult | None, CheckpointWriteError | None], None] | None = None,
    ) -> None:
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        self.store = root if isinstance(root, Store) else Store.open(root)
        self.job_id = job_id
        self.world_size = world_size
        self.keep = keep
        self.if_busy = if_busy
        self.checksum: Checksum = checksum
        self.layout_extra = layout_extra
        self.on_done = on_done  # called from the writer thread with the result or the error
        self.last_result: SaveResult | None = None
        self.last_error: CheckpointWriteError | None = None
        self.errors: list[CheckpointWriteError] = []
        self._thread: threading.Thread | None = None
        self._unreported: CheckpointWriteError | None = None
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        step: int,
        state_dict: Any,
        *,
        kind: str = "periodic",
        generation: int = 0,
        digest: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> SaveTicket:
        """Copy ``state_dict`` to CPU (blocking, measured) and write it in the background."""
        waited = 0.0
        if self.busy:
            if self.if_busy == "skip" and kind != "dying-gasp":
                log.info("checkpoint of step %d skipped: the previous write is still running", step)
                return SaveTicket(step, 0.0, 0.0, True)
            t0 = time.perf_counter()
            self._join()
            waited = time.perf_counter() - t0
        t0 = time.perf_counter()
        snapshot = cpu_copy(state_dict)
        blocking = time.perf_counter() - t0
        thread = threading.Thread(
            target=self._write,
            args=(step, snapshot, kind, generation, digest, meta, blocking),
            name=f"undying-ckpt-{step}",
            daemon=True,
        )
        self._thread = thread
        thread.start()
        return SaveTicket(step, blocking, waited, False)

    def _write(
        self,
        step: int,
        snapshot: Any,
        kind: str,
        generation: int,
        digest: str | None,
        meta: dict[str, Any] | None,
        blocking: float,
    ) -> None:
        try:
            result = save_replicated(
                self.store,
                step,
                snapshot,
                job_id=self.job_id,
                generation=generation,
                world_size=self.world_size,
                kind=kind,
                digest=digest,
                meta=meta,
                layout_extra=self.layout_extra,
                checksum=self.checksum,
                keep=self.keep,
                blocking_s=blocking,
            )
        except BaseException as e:  # kept and re-raised by wait(): never lost
            err = CheckpointWriteError(step, e)
            err.__cause__ = e
            log.error("%s", err)
            with self._lock:
                self.last_error = err
                self._unreported = err
                self.errors.append(err)
            self._notify(None, err)
            return
        with self._lock:
            self.last_result = result
        self._notify(result, None)

    def _notify(self, result: SaveResult | None, error: CheckpointWriteError | None) -> None:
        if self.on_done is None:
            return
        try:
            self.on_done(result, error)
        except Exception:  # a report must never break the writer
            log.exception("checkpoint on_done callback failed")

    def _join(self, timeout: float | None = None) -> bool:
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the write in flight; raise CheckpointWriteError if a write failed since the last wait.

        Raises TimeoutError when ``timeout`` passes first (the write goes on).
        """
        if not self._join(timeout):
            raise TimeoutError(f"checkpoint write still running after {timeout}s")
        with self._lock:
            err, self._unreported = self._unreported, None
        if err is not None:
            raise err
        return self.last_result

    def close(self, timeout: float | None = None) -> SaveResult | None:
        """``wait`` under another name, for ``with`` blocks and shutdown paths."""
        return self.wait(timeout)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.wait()  # a failed write surfaces here
        else:
            self._join()  # do not mask the exception already in flight
