"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save on N ranks, load on M.

Every rank of ``group`` calls ``save_sharded`` with its own shard of the state
(DTensors from FSDP2 ``fully_shard`` or a hand-built DeviceMesh, or plain
tensors for replicated entries). DCP writes one file per rank plus
``.metadata`` describing the global shapes, which is what lets ``load_sharded``
on a different world size read exactly the slices each new rank owns.

The commit stays ours: a coordinating rank creates the temp folder and tells
the others, every rank checksums the ``__<rank>_*.distcp`` files it wrote
(spreading the read-back), the coordinator gathers the checksums after DCP's
own barrier, renames the folder into place and writes the manifest last, then
tells every rank the outcome so all of them return or all of them raise.

On local folders all ranks must see the same filesystem (one node, or a shared
mount); otherwise use an fsspec URL.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch.distributed as dist

from undying.checkpoint.checks import tensor_specs
from undying.checkpoint.commit import PendingCheckpoint, SaveResult, default_checksum
from undying.checkpoint.discovery import Checkpoint, Latest, latest_valid, prune, verify
from undying.checkpoint.manifest import (
    MANIFEST_NAME,
    Checksum,
    FileEntry,
    Manifest,
    checksum_stream,
)
from undying.checkpoint.store import CheckpointError, Store

__all__ = ["save_sharded", "load_sharded", "latest_valid_shared", "read_manifest"]

log = logging.getLogger("undying.checkpoint")

_Group = dist.ProcessGroup | None


def _dist(group: _Group) -> tuple[int, int, bool]:
    """(rank in group, group size, distributed?) — without a process group DCP runs
    single-process."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, False
    return dist.get_rank(group), dist.get_world_size(group), True


def _broadcast(value: Any, coordinator: int, group: _Group, distributed: bool) -> Any:
    if not distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=coordinator)
    return box[0]


def _writer(store: Store, path: str) -> Any:
    if store.local:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(path, sync_files=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # sync_files on a non-file stream makes DCP call os.sync() for the whole machine: off.
    return FsspecWriter(store.url_of(path), sync_files=False)


def _reader(store: Store, path: str) -> Any:
    if store.local:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(store.url_of(path))


def _split(checkpoint: Checkpoint | str | os.PathLike[str]) -> tuple[Store, str, str]:
    url = checkpoint.url if isinstance(checkpoint, Checkpoint) else os.fspath(checkpoint)
    if "://" in url:
        parent, name = url.rstrip("/").rsplit("/", 1)
    else:
        parent, name = os.path.split(os.path.abspath(url))
    return Store.open(parent), name, url


def save_sharded(
    root: str | os.PathLike[str],
    step: int,
    state_dict: dict[str, Any],
    *,
    group: _Group = None,
    coordinator: int = 0,
    job_id: str = "",
    generation: int = 0,
    kind: str = "periodic",
    digest: str | None = None,
    meta: dict[str, Any] | None = None,
    layout_extra: dict[str, Any] | None = None,
    checksum: Checksum | None = None,
    overwrite: bool = True,
    keep: int | None = None,
) -> SaveResult:
    """Collective: every rank of ``group`` calls it with its shard; all return the same result or
    all raise.

    ``coordinator`` is a rank *within* ``group``. The manifest's ``world_size``
    is the group's size and its layout ``{"kind": "sharded", "planner": "dcp"}``
    plus ``layout_extra`` (e.g. the mesh shape, for a restore planner).
    """
    checksum = checksum or default_checksum()
    rank, world, distributed = _dist(group)
    store = Store.open(root)
    started = time.perf_counter()
    pending: PendingCheckpoint | None = None
    setup: tuple[str, str] | str
    if rank == coordinator:
        try:
            pending = PendingCheckpoint(store, step, overwrite=overwrite)
            setup = (pending.work_path, pending.work_url)
        except Exception as e:
            setup = f"{type(e).__name__}: {e}"
    else:
        setup = ""
    setup = _broadcast(setup, coordinator, group, distributed)
    if isinstance(setup, str):
        raise CheckpointError(f"sharded checkpoint of step {step} not started: {setup}")
    work_path, _ = setup
    try:
        # ~0.4 s to import: only where a sharded state is saved
        import torch.distributed.checkpoint as dcp

        dcp.save(
            state_dict,
            storage_writer=_writer(store, work_path),
            process_group=group,
            no_dist=not distributed,
        )
    except BaseException:
        if pending is not None:
            pending.abort()
        raise
    # Each rank hashes its own files (DCP names them __<group rank>_<n>.distcp), in parallel.
    mine: dict[str, FileEntry] | str
    try:
        prefix = f"__{rank}_"
        hashed: dict[str, FileEntry] = {}
        for rel in store.files_under(work_path):
            if rel.startswith(prefix):
                with store.open_read(store.join(work_path, rel)) as f:
                    size, digest_ = checksum_stream(f, checksum)
                hashed[rel] = FileEntry(rel, size, digest_, checksum)
        mine = hashed
    except OSError as e:
        mine = f"rank {rank} could not checksum its files: {e}"
    # With the checksums, every rank's tensor specs: a rank may hold keys no other rank has.
    report = (mine, tensor_specs(state_dict))
    reports: list[Any] = [None] * world
    if distributed:
        dist.gather_object(report, reports if rank == coordinator else None, group=group,
                           group_dst=coordinator)
    else:
        reports = [report]
    gathered: list[Any] = [r[0] for r in reports] if rank == coordinator else []
    specs: dict[str, Any] = {}
    if rank == coordinator:
        for _, theirs in reports:
            for name, spec in theirs.items():
                specs.setdefault(name, spec)
        specs.update(report[1])  # the coordinator's view wins where ranks disagree
    outcome: tuple[str, int] | str = ""
    if rank == coordinator:
        assert pending is not None
        try:
            errors = [g for g in gathered if isinstance(g, str)]
            if errors:
                raise CheckpointError("; ".join(errors))
            known: dict[str, FileEntry] = {}
            for g in gathered:
                known.update(g)
            entries = pending.entries(known, checksum)
            manifest = Manifest(
                step=step,
                world_size=world,
                layout={**(layout_extra or {}), "kind": "sharded", "planner": "dcp"},
                kind=kind,
                job_id=job_id,
                generation=generation,
                created_at=time.time(),
                files=tuple(entries),
                digest=digest,
                meta=dict(meta or {}),
                tensors=specs,
            )
            ckpt = pending.commit(manifest)
            if keep is not None:
                try:
                    prune(store, keep)
                except OSError as e:  # committed: retention tries again after the next save
                    log.warning("pruning %s after step %d failed: %s", store.url_of(store.root),
                                step, e)
            outcome = (ckpt.url, manifest.total_bytes)
        except Exception as e:
            pending.abort()
            outcome = f"{type(e).__name__}: {e}"
    outcome = _broadcast(outcome, coordinator, group, distributed)
    if isinstance(outcome, str):
        raise CheckpointError(f"sharded checkpoint of step {step} not committed: {outcome}")
    url, nbytes = outcome
    elapsed = time.perf_counter() - started
    if rank == coordinator:
        log.info("sharded checkpoint %s written by %d ranks: %d bytes in %.3fs", url, world,
                 nbytes, elapsed)
    return SaveResult(step, url, kind, elapsed, elapsed, nbytes)


def read_manifest(checkpoint: Checkpoint | str | os.PathLike[str]) -> Manifest:
    """The manifest of one checkpoint folder or URL (no checksums read): to choose how to load
    it."""
    store, name, url = _split(checkpoint)
    try:
        return Manifest.from_json(store.read_bytes(store.join(name, MANIFEST_NAME)))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {url} has no readable manifest ({e}); run "
                              "`undying checkpoints verify` on it") from e


def load_sharded(
    checkpoint: Checkpoint | str | os.PathLike[str],
    state_dict: dict[str, Any],
    *,
    group: _Group = None,
    coordinator: int = 0,
    check: bool = True,
) -> Manifest:
    """Collective: load a sharded checkpoint into ``state_dict`` in place, on any world size.

    ``state_dict`` must have the target's structure: DTensors/sharded tensors
    laid out as this run wants them; DCP reads each rank's slices from whatever
    files hold them. With ``check`` the coordinator verifies every checksum
    first and all ranks raise CheckpointError naming the problems, before any
    tensor is touched.
    """
    rank, _, distributed = _dist(group)
    store, name, url = _split(checkpoint)
    problems: list[str] = verify(url) if (check and rank == coordinator) else []
    problems = _broadcast(problems, coordinator, group, distributed)
    if problems:
        raise CheckpointError(f"checkpoint {url} is not valid: " + "; ".join(problems))
    manifest = Manifest.from_json(store.read_bytes(store.join(name, MANIFEST_NAME)))
    if manifest.layout.get("kind") != "sharded":
        raise CheckpointError(
            f"checkpoint {url} has layout {manifest.layout.get('kind')!r}; load it with "
            "load_replicated"
        )
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, storage_reader=_reader(store, store.join(name)), process_group=group,
             no_dist=not distributed)
    return manifest


def latest_valid_shared(
    root: str | os.PathLike[str],
    *,
    group: _Group = None,
    coordinator: int = 0,
    job_id: str | None = None,
) -> Latest:
    """Collective ``latest_valid``: the coordinator reads the checksums once, every rank gets its
    answer."""
    rank, _, distributed = _dist(group)
    found = latest_valid(root, job_id=job_id) if rank == coordinator else None
    result: Latest = _broadcast(found, coordinator, group, distributed)
    return result
