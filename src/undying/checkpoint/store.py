"""Where checkpoints live: a local folder or any fsspec URL, behind one small file API.

Layout under a root::

    <root>/step-000000120/            a checkpoint: its files and manifest.json
    <root>/.tmp-step-000000130-...    a write in progress (local folders only)

Everything above this module (the commit, discovery, retention, the writers)
speaks to storage only through ``Store``, so one code path serves a local
folder and an object store; what differs between them is said here once:
only a local folder renames atomically (``supports_rename``), and only there
are files fsynced and their folder with them. Names under the root that this
package writes are ``step-*`` (``manifest.step_dirname``), ``TMP_PREFIX``,
the owner lock ``undying.lock`` (``lock``) and ``rejected/`` (``aside``: it
only ever adds there); nothing else under a root is ever touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import posixpath
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from undying.errors import UndyingError

__all__ = [
    "TMP_PREFIX",
    "CheckpointError",
    "CheckpointExistsError",
    "Store",
    "start_writeback",
]

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
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to disk now, without
    waiting.

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
            raise CheckpointError(
                f"checkpoint root {text} is a URL but fsspec is not installed") from e
        try:
            fs, path = fsspec.core.url_to_fs(text)
        except (ImportError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint root {text}: no storage for {protocol}:// ({e})") from e
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
        return sorted(posixpath.basename(p.rstrip("/"))
                      for p in self.fs.ls(self.root, detail=False))

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

