"""The atomic commit: how a checkpoint's files become visible all at once, or not at all.

The protocol differs by what the storage can do (``Store.supports_rename``):

- **local folder** (a path or ``file://``): files are written into a
  ``.tmp-step-*`` folder beside the final one and fsynced, the folder is
  renamed into place (atomic on POSIX), then ``manifest.json`` is written aside,
  fsynced and renamed in, last. A crash at any point leaves either nothing under
  a ``step-*`` name, or a ``step-*`` folder without a manifest, which discovery
  skips as partial.
- **fsspec URL** (``memory://``, ``s3://``, ...): object stores have no atomic
  folder rename, so the files are written straight into ``step-*/`` and the
  manifest is written last, in one PUT: the manifest is the commit marker.

Both writers (``replicated``, ``sharded``) commit through ``PendingCheckpoint``
and report a ``SaveResult``; the manifest is signed here (``signed``) with the
job's key where this process holds one, so no writer can forget to. A
checkpoint already at the step that this process did not sign (another job's,
a stranger's) is never replaced: it is set aside whole first (``aside``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from dataclasses import dataclass

from undying.checkpoint.aside import set_aside
from undying.checkpoint.discovery import Checkpoint, inspect
from undying.checkpoint.mac import current_key, mac_of
from undying.checkpoint.manifest import (
    MANIFEST_NAME,
    Checksum,
    FileEntry,
    Manifest,
    checksum_stream,
    step_dirname,
)
from undying.checkpoint.store import TMP_PREFIX, CheckpointError, CheckpointExistsError, Store

__all__ = ["SaveResult", "PendingCheckpoint", "default_checksum", "signed"]


@dataclass(frozen=True)
class SaveResult:
    """A committed checkpoint: where, and what it cost (``blocking_s`` is the training-loop
    stall)."""

    step: int
    path: str
    kind: str
    blocking_s: float
    write_s: float
    bytes: int

    @property
    def write_bytes_per_s(self) -> float:
        return self.bytes / self.write_s if self.write_s > 0 else float("inf")


def default_checksum() -> Checksum:
    """SHA-256 where this process signs its checkpoints (a MAC over a CRC would vouch for nothing),
    else CRC32."""
    return "sha256" if current_key() is not None else "crc32"


def signed(manifest: Manifest) -> Manifest:
    """``manifest`` with the job's MAC (``checkpoint.mac``), or as it is where this process holds no
    key."""
    key = current_key()
    if key is None:
        return manifest
    unsigned = dataclasses.replace(manifest, mac=None)
    return dataclasses.replace(manifest, mac=mac_of(unsigned.to_dict(), key))



def _set_aside_unless_owned(store: Store, name: str) -> bool:
    """A checkpoint already at ``name`` that this process did not sign is moved to ``rejected/``
    (True); one it signed, or a partial write, is left for the caller to replace (False)."""
    found = inspect(store, name, checksums=False)
    if found.owned:
        return False
    why = "; ".join(found.problems) or "not signed by this job's key"
    set_aside(store, name, f"a new checkpoint of step {found.step} takes its place; it was {why}")
    return True


class PendingCheckpoint:
    """A checkpoint being written: put files under ``work_path``, then ``commit`` (or ``abort``).

    Local: ``work_path`` is a fresh ``.tmp-step-*`` folder; ``commit`` renames it
    into place and writes the manifest last. fsspec: ``work_path`` is the final
    folder (cleared first when overwriting: its manifest is deleted before
    anything else so it is never half-valid); ``commit`` writes the manifest.
    """

    def __init__(self, store: Store, step: int, *, overwrite: bool = True) -> None:
        self.store = store
        self.step = step
        self.name = step_dirname(step)
        self.final_path = store.join(self.name)
        self.overwrite = overwrite
        self.committed = False
        if not overwrite and store.exists(store.join(self.name, MANIFEST_NAME)):
            raise CheckpointExistsError(
                f"checkpoint {store.url_of(self.final_path)} already exists; pass overwrite=True "
                "to replace it"
            )
        try:
            store.makedirs(store.root)
            if store.supports_rename:
                token = f"{os.getpid()}-{secrets.token_hex(3)}"
                self.work_path = store.join(f"{TMP_PREFIX}{step:09d}-{token}")
                store.makedirs(self.work_path)
            else:
                self.work_path = self.final_path
                if store.exists(self.final_path) and not _set_aside_unless_owned(store, self.name):
                    store.remove(store.join(self.name, MANIFEST_NAME))
                    store.remove(self.final_path)
                store.makedirs(self.work_path)
        except OSError as e:
            raise CheckpointError(
                f"cannot write checkpoints under {store.url_of(store.root)} ({e.strerror or e})"
            ) from e

    @property
    def work_url(self) -> str:
        return self.store.url_of(self.work_path)

    def file_path(self, relpath: str) -> str:
        return self.store.join(self.work_path, *relpath.split("/"))

    def entries(
        self, known: dict[str, FileEntry] | None = None, algorithm: Checksum = "crc32"
    ) -> list[FileEntry]:
        """A FileEntry for every file written; those in ``known`` (hashed while written) are not
        re-read."""
        known = known or {}
        out = []
        for rel in self.store.files_under(self.work_path):
            if rel in known:
                out.append(known[rel])
                continue
            with self.store.open_read(self.file_path(rel)) as f:
                size, digest = checksum_stream(f, algorithm)
            out.append(FileEntry(rel, size, digest, algorithm))
        return out

    def commit(self, manifest: Manifest) -> Checkpoint:
        """Make the checkpoint visible: rename into place (local), then write the manifest last."""
        store = self.store
        listed = {f.path for f in manifest.files}
        on_disk = set(store.files_under(self.work_path))
        if listed != on_disk:
            raise CheckpointError(
                f"manifest of {self.name} does not list exactly the files written: "
                f"missing {sorted(on_disk - listed)}, extra {sorted(listed - on_disk)}"
            )
        replaced: str | None = None
        moved = False
        try:
            if store.supports_rename:
                if store.exists(self.final_path):
                    if not self.overwrite:
                        raise CheckpointExistsError(
                            f"checkpoint {self.final_path} appeared while writing")
                    if not _set_aside_unless_owned(store, self.name):
                        # Ours: moved aside (not deleted) until the new one is committed.
                        replaced = store.join(
                            f"{TMP_PREFIX}{self.step:09d}-replaced-{secrets.token_hex(3)}")
                        store.rename(self.final_path, replaced)
                store.rename(self.work_path, self.final_path)
                moved = True
            store.write_atomic(store.join(self.name, MANIFEST_NAME),
                               signed(manifest).to_json().encode())
        except BaseException:
            # Undo what can be undone; a process killed here leaves a step-* folder without
            # a manifest, which discovery skips as partial and prune removes later.
            with contextlib.suppress(OSError):
                if moved or not store.supports_rename:
                    store.remove(self.final_path)
                if replaced is not None and store.exists(replaced):
                    store.rename(replaced, self.final_path)
            raise
        if replaced is not None:
            store.remove(replaced)
        self.committed = True
        return Checkpoint(self.name, self.step, self.final_path,
                          store.url_of(self.final_path), manifest)

    def abort(self) -> None:
        """Remove what was written; a committed checkpoint is never touched."""
        if not self.committed:
            with contextlib.suppress(OSError):
                self.store.remove(self.work_path)

