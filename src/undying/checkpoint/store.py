"""Where checkpoints live: a local folder or any fsspec URL, the atomic commit, discovery, retention.

Layout under a root::

    <root>/step-000000120/            a checkpoint: its files and manifest.json
    <root>/.tmp-step-000000130-...    a write in progress (local folders only)

The commit protocol differs by what the storage can do:

- **local folder** (a path or ``file://``): files are written into a
  ``.tmp-step-*`` folder beside the final one and fsynced, the folder is
  renamed into place (atomic on POSIX), then ``manifest.json`` is written aside,
  fsynced and renamed in, last. A crash at any point leaves either nothing under
  a ``step-*`` name, or a ``step-*`` folder without a manifest, which discovery
  skips as partial.
- **fsspec URL** (``memory://``, ``s3://``, ...): object stores have no atomic
  folder rename, so the files are written straight into ``step-*/`` and the
  manifest is written last, in one PUT: the manifest is the commit marker.

Discovery never trusts a folder name: a checkpoint is valid only when its
manifest parses and every listed file exists with the listed size and checksum.
Retention only ever deletes names this module writes (``step-*`` and
``.tmp-step-*``), so pointing ``--root`` at the wrong folder cannot destroy data.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import logging
import os
import posixpath
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

from undying.checkpoint.mac import current_key, mac_of, mac_problem
from undying.checkpoint.manifest import (
    MANIFEST_NAME,
    Checksum,
    FileEntry,
    Manifest,
    ManifestError,
    checksum_stream,
    parse_step_dirname,
    step_dirname,
)
from undying.errors import UndyingError

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "Store",
    "Checkpoint",
    "Latest",
    "PendingCheckpoint",
    "scan",
    "verify",
    "latest_valid",
    "prune",
    "TMP_PREFIX",
    "start_writeback",
]

log = logging.getLogger("undying.checkpoint")

TMP_PREFIX = ".tmp-step-"


class CheckpointError(UndyingError):
    """A checkpoint could not be written or read; the message names the file and the problem."""


class CheckpointExistsError(CheckpointError):
    """A checkpoint at this step is already committed and overwriting was not asked for."""


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_sync_file_range: Any = None


def _load_sync_file_range() -> Any:
    global _sync_file_range
    if _sync_file_range is None:
        fn: Any = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                fn = libc.sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = False
        _sync_file_range = fn
    return _sync_file_range


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to disk now, without waiting.

    Below the dirty-page limits Linux would hold a checkpoint's pages in
    memory until the final fsync and only then write them, so the disk would
    sit idle while the state is serialized and checksummed, and the CPU idle
    while the fsync waits. Started per chunk as it is written, the disk works
    alongside the CPU and the fsync only waits for the tail. A no-op (False)
    where ``sync_file_range`` does not exist; durability still comes from fsync.
    """
    fn = _load_sync_file_range()
    if not fn or nbytes <= 0:
        return False
    return bool(fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0)


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX needs the folder fsynced too)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the rename is still atomic
    finally:
        os.close(fd)


class Store:
    """A checkpoint root. ``Store.open`` picks local-folder or fsspec semantics from the root.

    Paths handed around are strings in the store's own namespace: absolute OS
    paths for a local store, protocol-stripped fsspec paths otherwise
    (``url_of`` turns them back into URLs for torch.distributed.checkpoint).
    """

    def __init__(self, root: str, *, fs: Any = None, protocol: str = "") -> None:
        self.root = root
        self.fs = fs
        self.protocol = protocol

    @property
    def local(self) -> bool:
        return self.fs is None

    @property
    def supports_rename(self) -> bool:
        """Only a local folder renames atomically; object stores copy-and-delete."""
        return self.local

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> Store:
        text = os.fspath(root)
        if "://" not in text:
            return cls(str(Path(text).absolute()))
        protocol = text.split("://", 1)[0]
        if protocol == "file":
            return cls(str(Path(text[len("file://") :]).absolute()))
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is a dependency
            raise CheckpointError(f"checkpoint root {text} is a URL but fsspec is not installed") from e
        try:
            fs, path = fsspec.core.url_to_fs(text)
        except (ImportError, ValueError) as e:
            raise CheckpointError(f"checkpoint root {text}: no storage for {protocol}:// ({e})") from e
        return cls(path.rstrip("/") or "/", fs=fs, protocol=protocol)

    def __repr__(self) -> str:
        return f"Store({self.url_of(self.root)!r})"

    # -- names ---------------------------------------------------------------

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts) if self.local else posixpath.join(self.root, *parts)

    def url_of(self, path: str) -> str:
        """What a user would type for ``path``: an OS path, or the full URL."""
        if self.local:
            return path
        return f"{self.protocol}://{path.lstrip('/') if self.protocol != 'memory' else path}"

    # -- reading -------------------------------------------------------------

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if self.local else bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path) if self.local else bool(self.fs.isdir(path))

    def names(self) -> list[str]:
        """Entries directly under the root, or [] when the root does not exist yet."""
        if self.local:
            try:
                return sorted(os.listdir(self.root))
            except FileNotFoundError:
                return []
        if not self.fs.exists(self.root):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))

    def files_under(self, folder: str) -> list[str]:
        """Every file below ``folder``, as '/'-separated paths relative to it."""
        if self.local:
            out = []
            for dirpath, _, filenames in os.walk(folder):
                for name in filenames:
                    rel = os.path.relpath(os.path.join(dirpath, name), folder)
                    out.append(rel.replace(os.sep, "/"))
            return sorted(out)
        prefix = folder.rstrip("/") + "/"
        return sorted(p[len(prefix) :] for p in self.fs.find(folder) if p.startswith(prefix))

    def size(self, path: str) -> int:
        return os.path.getsize(path) if self.local else int(self.fs.size(path))

    def mtime(self, path: str) -> float | None:
        """Last modification in unix seconds, None where the store does not say."""
        if self.local:
            try:
                return os.path.getmtime(path)
            except OSError:
                return None
        try:
            info = self.fs.info(path)
        except (OSError, ValueError):
            return None
        for key in ("mtime", "LastModified", "last_modified", "created"):
            value = info.get(key)
            if isinstance(value, int | float):
                return float(value)
            if hasattr(value, "timestamp"):
                return float(value.timestamp())
        return None

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb") if self.local else self.fs.open(path, "rb")  # noqa: SIM115

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    # -- writing -------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        if self.local:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        """A file opened for writing; on a local store it is fsynced before close."""
        if self.local:
            with open(path, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        else:
            with self.fs.open(path, "wb") as f:
                yield f

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write a small file so a reader sees all of it or none: aside + fsync + rename locally."""
        if self.local:
            tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(Path(path).parent)
        else:
            self.fs.pipe_file(path, data)

    def rename(self, src: str, dst: str) -> None:
        if not self.local:
            raise CheckpointError(f"{self.url_of(src)}: this store cannot rename atomically")
        os.rename(src, dst)
        _fsync_dir(Path(dst).parent)

    def remove(self, path: str) -> None:
        """Delete a file or folder tree; a missing one is not an error (retention may race)."""
        if self.local:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        elif self.fs.exists(path):
            self.fs.rm(path, recursive=True)


def default_checksum() -> Checksum:
    """SHA-256 where this process signs its checkpoints (a MAC over a CRC would vouch for nothing), else CRC32."""
    return "sha256" if current_key() is not None else "crc32"


def signed(manifest: Manifest) -> Manifest:
    """``manifest`` with the job's MAC (``checkpoint.mac``), or as it is where this process holds no key."""
    key = current_key()
    if key is None:
        return manifest
    return dataclasses.replace(manifest, mac=mac_of(dataclasses.replace(manifest, mac=None).to_dict(), key))


# -- discovery ------------------------------------------------------------------


@dataclass
class Checkpoint:
    """One ``step-*`` folder as found on storage, with what is wrong with it (if anything)."""

    name: str
    step: int
    path: str
    url: str
    manifest: Manifest | None
    problems: list[str] = field(default_factory=list)
    mtime: float | None = None

    @property
    def valid(self) -> bool:
        return self.manifest is not None and not self.problems

    @property
    def kind(self) -> str | None:
        return self.manifest.kind if self.manifest else None

    @property
    def size(self) -> int | None:
        return self.manifest.total_bytes if self.manifest else None


class Latest(NamedTuple):
    """What ``latest_valid`` found: the checkpoint (or None) and every newer one it skipped, with why."""

    checkpoint: Checkpoint | None
    skipped: list[tuple[str, str]]


def _check(store: Store, name: str, *, checksums: bool) -> Checkpoint:
    folder = store.join(name)
    step = parse_step_dirname(name)
    assert step is not None, name
    ckpt = Checkpoint(name, step, folder, store.url_of(folder), None, mtime=store.mtime(folder))
    manifest_path = store.join(name, MANIFEST_NAME)
    try:
        raw = store.read_bytes(manifest_path)
    except FileNotFoundError:
        ckpt.problems.append(f"no {MANIFEST_NAME}: a partial checkpoint (the write did not finish)")
        return ckpt
    except OSError as e:
        ckpt.problems.append(f"{MANIFEST_NAME} cannot be read ({e})")
        return ckpt
    try:
        manifest = Manifest.from_json(raw)
    except ManifestError as e:
        ckpt.problems.append(f"{MANIFEST_NAME} is corrupt: {e}")
        return ckpt
    ckpt.manifest = manifest
    key = current_key()
    if key is not None:
        # Before any file is trusted (or read): a checkpoint the job did not sign is not the job's.
        problem = mac_problem(json.loads(raw), key)
        if problem is not None:
            ckpt.problems.append(problem)
            return ckpt
    if manifest.step != step:
        ckpt.problems.append(f"{MANIFEST_NAME} says step {manifest.step}, the folder is {name}")
    for entry in manifest.files:
        ckpt.problems.extend(_check_file(store, folder, entry, checksums=checksums))
    return ckpt


def _check_file(store: Store, folder: str, entry: FileEntry, *, checksums: bool) -> list[str]:
    path = store.join(folder, *entry.path.split("/"))
    try:
        size = store.size(path)
    except (FileNotFoundError, OSError):
        return [f"file {entry.path} is missing"]
    if size != entry.size:
        return [f"file {entry.path} has size {size}, manifest says {entry.size}"]
    if not checksums:
        return []
    try:
        with store.open_read(path) as f:
            _, digest = checksum_stream(f, entry.algorithm)
    except OSError as e:
        return [f"file {entry.path} cannot be read ({e})"]
    if digest != entry.checksum:
        return [f"file {entry.path} has {entry.algorithm} {digest}, manifest says {entry.checksum}"]
    return []


def scan(root: str | os.PathLike[str] | Store, *, checksums: bool = True) -> list[Checkpoint]:
    """Every ``step-*`` folder under ``root``, oldest first, each checked (checksums optional)."""
    store = root if isinstance(root, Store) else Store.open(root)
    names = [n for n in store.names() if parse_step_dirname(n) is not None]
    names.sort(key=lambda n: parse_step_dirname(n) or 0)
    return [_check(store, n, checksums=checksums) for n in names]


def verify(path: str | os.PathLike[str]) -> list[str]:
    """Problems of the one checkpoint at ``path`` (a ``step-*`` folder or its URL); [] when valid."""
    text = os.fspath(path).rstrip("/")
    if "://" in text:
        parent, name = text.rsplit("/", 1)
    else:
        p = Path(text).absolute()
        parent, name = str(p.parent), p.name
    if parse_step_dirname(name) is None:
        return [f"{text} is not a checkpoint folder (its name must be step-NNNNNNNNN)"]
    store = Store.open(parent)
    if not store.isdir(store.join(name)):
        return [f"checkpoint {text} does not exist"]
    return _check(store, name, checksums=True).problems


def latest_valid(
    root: str | os.PathLike[str] | Store,
    *,
    job_id: str | None = None,
    kinds: tuple[str, ...] | None = None,
) -> Latest:
    """The newest checkpoint that is whole and uncorrupted, and the newer ones skipped (name, reason).

    Checks newest first and stops at the first valid one, so only the files of
    the checkpoint it returns (and of broken newer ones) are read. ``job_id``
    skips checkpoints of another job; ``kinds`` restricts to periodic or
    dying-gasp. Every skip is also logged at WARNING.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    names = [n for n in store.names() if parse_step_dirname(n) is not None]
    names.sort(key=lambda n: parse_step_dirname(n) or 0, reverse=True)
    skipped: list[tuple[str, str]] = []
    for name in names:
        ckpt = _check(store, name, checksums=True)
        reason = "; ".join(ckpt.problems)
        if not reason and ckpt.manifest is not None:
            if job_id is not None and ckpt.manifest.job_id != job_id:
                reason = f"belongs to job {ckpt.manifest.job_id!r}, not {job_id!r}"
            elif kinds is not None and ckpt.manifest.kind not in kinds:
                continue  # not a problem, just not asked for
        if reason:
            log.warning("skipped checkpoint %s: %s", store.url_of(ckpt.path), reason)
            skipped.append((name, reason))
            continue
        return Latest(ckpt, skipped)
    return Latest(None, skipped)


def prune(
    root: str | os.PathLike[str] | Store,
    keep: int,
    *,
    tmp_max_age_s: float = 3600.0,
    now: float | None = None,
) -> list[str]:
    """Delete all but the ``keep`` newest valid checkpoints and leftover temp folders; the names removed.

    Validity here is manifest + file sizes, plus checksums of the newest
    checkpoints until one passes: the latest valid checkpoint (as
    ``latest_valid`` sees it) is always kept, even beyond ``keep``. Broken ``step-*`` folders older
    than the oldest kept checkpoint go too: they can never be the latest valid
    one. Newer broken folders stay for inspection (or are a commit in progress).
    A ``.tmp-step-*`` folder is a leftover when a newer-or-equal step has been
    committed since it was last touched (only one write per root is in flight),
    or when it has not been touched for ``tmp_max_age_s``. Nothing else under
    the root is ever touched.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    store = root if isinstance(root, Store) else Store.open(root)
    now = time.time() if now is None else now
    found = scan(store, checksums=False)
    valid = [c for c in found if c.valid]
    kept = valid[-keep:]
    # Sizes can match while a byte flipped: never let retention delete the checkpoint that
    # latest_valid would return. Checksum the kept ones newest first (normally the one just
    # written passes at once) and keep the newest that passes even when it is older than N.
    for c in reversed(valid):
        if _check(store, c.name, checksums=True).valid:
            if c not in kept:
                log.warning("keeping %s beyond keep=%d: every newer checkpoint fails its checksums", c.name, keep)
                kept = [c, *kept]
            break
    kept_names = {c.name for c in kept}
    removed: list[str] = []
    oldest_kept = min((c.step for c in kept), default=None)
    for c in found:
        if c.name in kept_names:
            continue
        if c.valid or (oldest_kept is not None and c.step < oldest_kept):
            store.remove(c.path)
            removed.append(c.name)
    newest = valid[-1] if valid else None
    for name in store.names():
        if not name.startswith(TMP_PREFIX):
            continue
        path = store.join(name)
        mtime = store.mtime(path)
        if mtime is None:
            continue
        digits = name[len(TMP_PREFIX) :].split("-", 1)[0]
        step = int(digits) if digits.isdigit() else None
        superseded = (
            newest is not None
            and newest.manifest is not None
            and step is not None
            and step <= newest.step
            and mtime < newest.manifest.created_at
        )
        if superseded or now - mtime > tmp_max_age_s:
            store.remove(path)
            removed.append(name)
    for name in removed:
        log.info("pruned %s", store.url_of(store.join(name)))
    return removed


# -- the commit -----------------------------------------------------------------


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
                f"checkpoint {store.url_of(self.final_path)} already exists; pass overwrite=True to replace it"
            )
        try:
            store.makedirs(store.root)
            if store.supports_rename:
                token = f"{os.getpid()}-{secrets.token_hex(3)}"
                self.work_path = store.join(f"{TMP_PREFIX}{step:09d}-{token}")
                store.makedirs(self.work_path)
            else:
                self.work_path = self.final_path
                if store.exists(self.final_path):
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

    def entries(self, known: dict[str, FileEntry] | None = None, algorithm: Checksum = "crc32") -> list[FileEntry]:
        """A FileEntry for every file written; those in ``known`` (hashed while written) are not re-read."""
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
                        raise CheckpointExistsError(f"checkpoint {self.final_path} appeared while writing")
                    # Move the old one aside (not delete) until the new one is committed.
                    replaced = store.join(f"{TMP_PREFIX}{self.step:09d}-replaced-{secrets.token_hex(3)}")
                    store.rename(self.final_path, replaced)
                store.rename(self.work_path, self.final_path)
                moved = True
            store.write_atomic(store.join(self.name, MANIFEST_NAME), signed(manifest).to_json().encode())
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
        return Checkpoint(self.name, self.step, self.final_path, store.url_of(self.final_path), manifest)

    def abort(self) -> None:
        """Remove what was written; a committed checkpoint is never touched."""
        if not self.committed:
            with contextlib.suppress(OSError):
                self.store.remove(self.work_path)
