"""Replicated checkpoints: every rank holds the same state (as under DDP), so one rank writes it
whole.

The format is one ``torch.save`` file, ``state.pt``, beside the manifest.
Its bytes are hashed as they stream out (``_HashingWriter``: no second read
for the checksum, the hashing on a helper thread while the write runs, and
the kernel asked to start writing each chunk at once), and the write commits
through ``commit.PendingCheckpoint`` (aside, fsync, rename, manifest last).
A load verifies every checksum before torch reads a byte, with
``weights_only=True`` unless the caller trusts the root.

Synchronous on purpose: ``writer.AsyncCheckpointer`` runs ``save_replicated``
on its own thread; the dying gasp and the tests call it directly.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from undying.checkpoint.checks import tensor_specs
from undying.checkpoint.commit import PendingCheckpoint, SaveResult, default_checksum
from undying.checkpoint.discovery import Checkpoint, prune, verify
from undying.checkpoint.manifest import Checksum, FileEntry, Hasher, Manifest
from undying.checkpoint.room import os_error_of
from undying.checkpoint.store import CheckpointError, Store, start_writeback

__all__ = ["STATE_FILE", "save_replicated", "load_replicated"]

log = logging.getLogger("undying.checkpoint")

STATE_FILE = "state.pt"


class _HashingWriter:
    """Passes writes through to a file while checksumming them, for torch.save.

    The checksum of a large write is computed in a helper thread while the
    write itself runs (zlib and hashlib release the GIL on large buffers, the
    write syscall too), so with a core free it costs no wall time; each write
    waits for its own checksum before returning, so the buffer torch.save
    passed is never read after it reclaims it, and updates stay in order.
    With ``writeback`` (a local file), each large write also starts the
    kernel writing it to disk (``start_writeback``), so disk and CPU overlap.
    """

    PARALLEL_MIN = 1 << 20

    def __init__(self, f: Any, algorithm: Checksum, *, writeback: bool = False) -> None:
        self._f = f
        self.hasher = Hasher(algorithm)
        self._writeback = writeback
        self._kicked = 0  # bytes already handed to start_writeback

    def write(self, data: Any) -> int:
        if len(data) < self.PARALLEL_MIN:
            self.hasher.update(data)
            return int(self._f.write(data))
        hashing = _hash_pool().submit(self.hasher.update, data)
        try:
            written = self._f.write(data)
        finally:
            hashing.result()
        if self._writeback:
            self._f.flush()  # what BufferedWriter still holds must reach the kernel first
            end = self.hasher.size
            if start_writeback(self._f.fileno(), self._kicked, end - self._kicked):
                self._kicked = end
            else:
                self._writeback = False  # not supported here: fsync alone it is
        return int(written)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        """Nothing is left running: every write waited for its checksum (the file is the
        caller's)."""


_HASH_POOL: ThreadPoolExecutor | None = None
_HASH_POOL_LOCK = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """Checksum helpers shared by every write of this process, started once (a thread per save costs
    ms)."""
    global _HASH_POOL
    with _HASH_POOL_LOCK:
        if _HASH_POOL is None:
            _HASH_POOL = ThreadPoolExecutor(2, thread_name_prefix="undying-ckpt-hash")
        return _HASH_POOL


_CRC_TOGGLE = threading.Lock()


def _torch_save(obj: Any, w: _HashingWriter) -> None:
    """``torch.save(obj, w)`` without torch's own per-record CRC32 when torch allows it.

    Every byte is already checksummed once on its way out (the manifest's
    whole-file checksum, verified before any load); torch's zip records would
    checksum it a second time on the writer thread's CPU, which a training
    loop on the same cores pays for. The switch is global in torch and read
    only when the zip writer is made, so it is off for microseconds, under a
    lock. torch.load does not need the record CRCs. On a torch without these
    internals this is plain ``torch.save``.
    """
    parts = _torch_internals()
    if parts is None:
        torch.save(obj, w)  # type: ignore[arg-type]
        return
    opener, save_records, get_crc, set_crc = parts
    with _CRC_TOGGLE:
        before = get_crc()
        set_crc(False)
        try:
            zip_writer = opener(w)
        finally:
            set_crc(before)
    with zip_writer as z:
        save_records(obj, z, pickle, torch.serialization.DEFAULT_PROTOCOL, False)


def _torch_internals() -> tuple[Any, Any, Any, Any] | None:
    """torch.save's zip writer, record writer and CRC switch, or None where this torch lacks one."""
    ser: Any = torch.serialization
    parts = tuple(
        getattr(ser, name, None)
        for name in ("_open_zipfile_writer_buffer", "_save", "get_crc32_options",
                     "set_crc32_options")
    )
    return None if any(p is None for p in parts) else (parts[0], parts[1], parts[2], parts[3])


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
    checksum: Checksum | None = None,
    overwrite: bool = True,
    keep: int | None = None,
    blocking_s: float = 0.0,
) -> SaveResult:
    """Write ``state_dict`` (already on CPU, or it is copied) as checkpoint ``step``; call on ONE
    rank.

    Synchronous: returns once the manifest is committed. ``keep`` prunes older
    checkpoints afterwards. On any failure the temp folder is removed and the
    previous checkpoints are untouched.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    started = time.perf_counter()
    pending = PendingCheckpoint(store, step, overwrite=overwrite)
    try:
        with store.open_write(pending.file_path(STATE_FILE)) as f:
            checksum = checksum or default_checksum()
            w = _HashingWriter(f, checksum, writeback=store.local)
            try:
                _torch_save(state_dict, w)
                w.flush()
            finally:
                w.close()
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
            tensors=tensor_specs(state_dict),
        )
        ckpt = pending.commit(manifest)
    except BaseException as e:
        pending.abort()
        os_error = os_error_of(e)
        if os_error is not None:
            # torch.save reports a failed write as a RuntimeError about stream positions; say what
            # the OS said.
            raise CheckpointError(
                f"cannot write checkpoint {store.url_of(pending.final_path)} "
                f"({os_error.strerror or os_error})"
            ) from e
        raise
    write_s = time.perf_counter() - started
    if keep is not None:
        try:
            prune(store, keep)
        except OSError as e:
            # The checkpoint is committed; retention tries again after the next save
            log.warning("pruning %s after step %d failed: %s", store.url_of(store.root), step, e)
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
    parent, name = (url.rstrip("/").rsplit("/", 1) if "://" in url
                    else os.path.split(os.path.abspath(url)))
    store = Store.open(parent)
    manifest = Manifest.from_json(store.read_bytes(store.join(name, "manifest.json")))
    if manifest.layout.get("kind") != "replicated":
        raise CheckpointError(
            f"checkpoint {url} has layout {manifest.layout.get('kind')!r}; load it with "
            "load_sharded"
        )
    with store.open_read(store.join(name, manifest.layout.get("file", STATE_FILE))) as f:
        state = torch.load(f, map_location=map_location, weights_only=weights_only)
    return state, manifest

