"""Trace record files: newline-delimited JSON, per rank, named by creation time.

Layout: ``<trace_dir>/<job_id>/<rank>/<UTC timestamp>.ndjson``, e.g.
``traces/J/2/20261123T101501.123456Z.ndjson`` (the names and folders are
``files``). Names sort in time order, so "newest" and "oldest" are a plain sort.

The training thread only ever appends a dict to a bounded in-memory queue:
tracing must never stall or crash training, so ``write`` does no I/O, takes no
lock and never raises. A daemon thread encodes and appends the records. Every
failure on that side (queue full, disk full, permission denied, the folder
replaced by a file) drops records and counts them, warns once per kind of
failure, and tries again with the next records.

The trace folder is capped (``max_dir_bytes``): past the cap the oldest 20% of
trace files under it, all jobs and ranks, are deleted. Only files this writer
names (timestamp pattern, inside ``<job>/<rank>/``) count or are deleted, so
anything a user keeps there is safe. Several ranks' writers share the folder
and enforce the cap independently; each tolerates files a peer just deleted.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from undying.errors import UsageError
from undying.trace.files import (
    ends_with_newline,
    newest_trace_file,
    scan_trace_files,
    trace_file_name,
    trace_file_time,
)

__all__ = ["TraceWriter", "CAP_CHECK_BYTES", "CAP_DELETE_FRACTION"]

log = logging.getLogger("undying.trace")


# The cap is checked when a file is opened and after this many bytes written.
CAP_CHECK_BYTES = 1_000_000
# Past the cap, this fraction of the trace files (the oldest) is deleted.
CAP_DELETE_FRACTION = 0.2
# The newest file of a rank folder modified this recently may be a live
# writer's current file (another rank's): the cap leaves it alone.
_LIVE_FILE_S = 600.0
# How often the writer thread wakes to drain the queue; ``flush`` wakes it at once.
_POLL_S = 0.1
# At most this many bytes are encoded before they are written out.
_CHUNK_BYTES = 1_000_000


class TraceWriter:
    """Appends one rank's trace records to its folder from a background thread.

    ``write`` is for the training thread (and any other): never blocks on I/O,
    never raises. ``written`` and ``dropped`` count records; ``dropped``
    includes records refused because the queue was full, records lost to a
    failed disk write or encoding, and records written after ``close``.
    """

    def __init__(
        self,
        trace_dir: Path,
        job_id: str,
        rank: int,
        *,
        max_file_bytes: int = 10_000_000,
        max_dir_bytes: int = 1_000_000_000,
        queue_limit: int = 100_000,
    ) -> None:
        if not job_id or job_id in (".", "..") or any(c in job_id for c in "/\\\0"):
            raise UsageError(
                f"job id {job_id!r} cannot name a trace folder: use letters, digits, '-', '_', '.'"
            )
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        for name, value in (
            ("max_file_bytes", max_file_bytes),
            ("max_dir_bytes", max_dir_bytes),
            ("queue_limit", queue_limit),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.trace_dir = Path(trace_dir)
        self.job_id = job_id
        self.rank = rank
        self.rank_dir = self.trace_dir / job_id / str(rank)
        self.max_file_bytes = max_file_bytes
        self.max_dir_bytes = max_dir_bytes
        self.queue_limit = queue_limit

        # deque append/popleft/len are atomic in CPython: no lock on the hot path.
        self._queue: collections.deque[Any] = collections.deque()
        self._wake = threading.Event()
        self._closed = False
        self._stopping = False
        # Separate counters per thread that increments them, so no update is lost.
        self._dropped_caller = 0  # queue full or closed (caller threads)
        self._dropped_writer = 0  # encoding or disk failures (writer thread)
        self._written = 0
        self._warned: set[str] = set()
        self._reported_full = 0

        # Writer-thread state.
        self._fd: int | None = None
        self._path: Path | None = None
        self._size = 0
        self._since_cap_check = 0

        self._thread = threading.Thread(
            target=self._run, name=f"undying-trace-writer-{rank}", daemon=True
        )
        self._thread.start()

    # -- any thread -----------------------------------------------------------

    @property
    def written(self) -> int:
        """Records appended to a file so far."""
        return self._written

    @property
    def dropped(self) -> int:
        """Records lost so far: queue full, disk or encoding failure, or after close."""
        return self._dropped_caller + self._dropped_writer

    @property
    def path(self) -> Path | None:
        """The file being appended to, once the first record was written."""
        return self._path

    def write(self, record: dict[str, Any]) -> None:
        """Queue a record; drop and count it if the queue is full. Never blocks or raises."""
        if self._closed or len(self._queue) >= self.queue_limit:
            self._dropped_caller += 1
            return
        self._queue.append(record)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record queued so far is written (or dropped); False on timeout."""
        if not self._thread.is_alive():
            return not self._queue
        done = threading.Event()
        self._queue.append(done)  # a marker: set once everything before it is out
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the thread; later records are dropped."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout_s
        flushed = self.flush(timeout_s)
        self._closed = True
        self._stopping = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not flushed or self._thread.is_alive():
            log.warning(
                "trace writer for rank %d did not finish writing within %.1f s",
                self.rank,
                timeout_s,
            )

    # -- writer thread --------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(_POLL_S)
                self._wake.clear()
                try:
                    self._drain()
                except Exception as e:  # never let the thread die: drop and go on
                    self._warn_once(f"bug:{type(e).__name__}", "trace writer failed: %r", e)
                if self._stopping and not self._queue:
                    return
        finally:
            self._close_fd()

    def _drain(self) -> None:
        """Encode and write everything queued, in chunks; release flush markers in order."""
        if self._dropped_caller > self._reported_full:
            self._reported_full = self._dropped_caller
            self._warn_once(
                "queue-full",
                "trace records dropped: more than %d queued (the disk is slower than the "
                "records come); training goes on",
                self.queue_limit,
            )
        lines: list[bytes] = []
        nbytes = 0
        while True:
            try:
                item = self._queue.popleft()
            except IndexError:
                break
            if isinstance(item, threading.Event):
                self._write_lines(lines)
                lines, nbytes = [], 0
                item.set()
                continue
            line = self._encode(item)
            if line is None:
                continue
            lines.append(line)
            nbytes += len(line)
            if nbytes >= _CHUNK_BYTES:
                self._write_lines(lines)
                lines, nbytes = [], 0
        self._write_lines(lines)

    def _encode(self, record: Any) -> bytes | None:
        try:
            text = json.dumps(record, separators=(",", ":"), default=_jsonable)
        except (TypeError, ValueError, RecursionError) as e:
            self._dropped_writer += 1
            self._warn_once(
                f"encode:{type(e).__name__}", "trace record dropped: cannot encode it: %s", e
            )
            return None
        return text.encode("utf-8") + b"\n"

    def _write_lines(self, lines: list[bytes]) -> None:
        """Append lines, starting a new file before one would pass ``max_file_bytes``."""
        i = 0
        try:
            while i < len(lines):
                if self._fd is None:
                    self._open()
                elif self._size > 0 and self._size + len(lines[i]) > self.max_file_bytes:
                    self._close_fd()
                    self._open(new=True)
                assert self._fd is not None
                room = self.max_file_bytes - self._size
                j, chunk = i + 1, len(lines[i])  # at least one line per file
                while j < len(lines) and chunk + len(lines[j]) <= room:
                    chunk += len(lines[j])
                    j += 1
                _write_all(self._fd, b"".join(lines[i:j]))
                self._size += chunk
                self._since_cap_check += chunk
                self._written += j - i
                i = j
                if self._since_cap_check >= CAP_CHECK_BYTES:
                    self._since_cap_check = 0
                    self._check_current()
                    self._enforce_cap()
        except OSError as e:
            # Lines of a partly written chunk are cut: count them dropped too.
            self._dropped_writer += len(lines) - i
            where = self._path or self.rank_dir
            self._warn_once(
                f"os:{type(e).__name__}:{e.errno}",
                "trace records dropped: cannot write %s: %s; training goes on, "
                "writing will be retried",
                where,
                e.strerror or e,
            )
            # Reopen on the next records: the folder may be back, the disk freed.
            self._close_fd()

    def _open(self, *, new: bool = False) -> None:
        """Open the current, else the newest, else a new file of this rank for appending."""
        first = self._path is None  # a reopen after a write error is not a new file
        os.makedirs(self.rank_dir, exist_ok=True)
        newest = newest_trace_file(self.rank_dir)
        candidate = None if new else (self._path or newest)
        if candidate is not None:
            try:
                size = candidate.stat().st_size
            except FileNotFoundError:
                size = None
            if size is not None and size < self.max_file_bytes:
                fd = os.open(candidate, os.O_WRONLY | os.O_APPEND)
                self._fd, self._path, self._size = fd, candidate, size
                if size > 0 and not ends_with_newline(candidate):
                    # A line cut by a crash or a full disk: end it so ours parse.
                    _write_all(fd, b"\n")
                    self._size += 1
                if first:
                    self._enforce_cap()
                return
        self._create(newest)
        self._enforce_cap()

    def _create(self, newest: Path | None) -> None:
        """Create a new file named by now, after the newest (clocks may step back)."""
        t = time.time()
        if newest is not None:
            with contextlib.suppress(ValueError):
                t = max(t, trace_file_time(newest.name) + 1e-6)
        for _ in range(100):
            path = self.rank_dir / trace_file_name(t)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                t += 1e-6
                continue
            self._fd, self._path, self._size = fd, path, 0
            return
        raise FileExistsError(f"no free trace file name in {self.rank_dir}")

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def _check_current(self) -> None:
        """Start a new file if ours was deleted under us (records to it would be lost)."""
        if self._fd is None:
            return
        try:
            gone = os.fstat(self._fd).st_nlink == 0
        except OSError:
            gone = True
        if gone:
            self._close_fd()
            self._open(new=True)

    def _enforce_cap(self) -> None:
        """Past ``max_dir_bytes``, delete the oldest 20% of trace files (never ours)."""
        try:
            files = scan_trace_files(self.trace_dir)
        except OSError as e:
            self._warn_once(f"cap:{e.errno}", "cannot check the trace folder size: %s", e)
            return
        total = sum(f.size for f in files)
        if total <= self.max_dir_bytes:
            return
        n = max(1, math.ceil(len(files) * CAP_DELETE_FRACTION))
        newest_in_folder: dict[Path, str] = {}
        for f in files:
            folder = f.path.parent
            if f.path.name > newest_in_folder.get(folder, ""):
                newest_in_folder[folder] = f.path.name
        now = time.time()
        deleted, freed = 0, 0
        for f in sorted(files, key=lambda f: (f.path.name, str(f.path))):
            if deleted >= n:
                break
            if f.path == self._path:
                continue
            if newest_in_folder[f.path.parent] == f.path.name and now - f.mtime < _LIVE_FILE_S:
                continue  # probably another rank's current file
            try:
                f.path.unlink()
            except FileNotFoundError:
                pass  # a peer's writer deleted it first
            except OSError as e:
                self._warn_once(
                    f"unlink:{e.errno}", "cannot delete old trace file %s: %s", f.path, e
                )
                continue
            deleted += 1
            freed += f.size
        if deleted:
            log.info(
                "trace folder %s passed %d bytes: deleted the %d oldest trace files (%d bytes)",
                self.trace_dir,
                self.max_dir_bytes,
                deleted,
                freed,
            )

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind in self._warned:
            return
        self._warned.add(kind)
        log.warning(msg, *args)




def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _jsonable(obj: Any) -> Any:
    """JSON for values json cannot encode: numpy/torch scalars, paths, sets, anything else as
    text."""
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=repr)
    return str(obj)
