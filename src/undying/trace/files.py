"""Trace files' names and folders: ``<trace_dir>/<job_id>/<rank>/<UTC timestamp>.ndjson``.

E.g. ``traces/J/2/20261123T101501.123456Z.ndjson``. Names sort in time order,
so "newest" and "oldest" are a plain sort, across ranks and jobs alike. Only
files named by this pattern, inside ``<job>/<rank>/``, are trace files: the
writer's cap (``writer``) counts and deletes those and nothing else, and the
offline analysis (``analyze``) reads those and lists the rest as skipped.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from pathlib import Path

__all__ = [
    "TRACE_FILE_PATTERN",
    "TRACE_FILE_SUFFIX",
    "TRACE_FILE_TIME_FORMAT",
    "TRACES_DIRNAME",
    "FileInfo",
    "default_job_label",
    "default_trace_dir",
    "ends_with_newline",
    "is_trace_file",
    "newest_trace_file",
    "scan_trace_files",
    "trace_file_name",
    "trace_file_time",
]

TRACES_DIRNAME = "traces"
TRACE_FILE_SUFFIX = ".ndjson"
# strftime format of a trace file's name (without the suffix): UTC, microseconds.
TRACE_FILE_TIME_FORMAT = "%Y%m%dT%H%M%S.%fZ"
# The names the writer creates and, under its cap, may delete.
TRACE_FILE_PATTERN = re.compile(r"\d{8}T\d{6}\.\d{6}Z\.ndjson")


def is_trace_file(name: str) -> bool:
    """Whether a file name is one the writer creates (``20261123T101501.123456Z.ndjson``)."""
    return TRACE_FILE_PATTERN.fullmatch(name) is not None


def trace_file_name(t: float) -> str:
    """The file name for a file created at wall time ``t`` (seconds since the epoch)."""
    when = _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc)
    return when.strftime(TRACE_FILE_TIME_FORMAT) + TRACE_FILE_SUFFIX


def trace_file_time(name: str) -> float:
    """The creation time a trace file name encodes; ``ValueError`` if it is not one."""
    if not is_trace_file(name):
        raise ValueError(f"not a trace file name: {name!r}")
    stem = name[: -len(TRACE_FILE_SUFFIX)]
    when = _dt.datetime.strptime(stem, TRACE_FILE_TIME_FORMAT)
    return when.replace(tzinfo=_dt.timezone.utc).timestamp()


def default_trace_dir(job_dir: Path) -> Path:
    """Where traces go by default: ``<job dir>/traces``, next to the job's other files."""
    return Path(job_dir) / TRACES_DIRNAME


def default_job_label() -> str:
    """A job folder name for a job with no id: fixed prefix plus the UTC start time."""
    return "job-" + _dt.datetime.now(tz=_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")

class FileInfo:
    __slots__ = ("path", "size", "mtime")

    def __init__(self, path: Path, size: int, mtime: float) -> None:
        self.path = path
        self.size = size
        self.mtime = mtime


def scan_trace_files(trace_dir: Path) -> list[FileInfo]:
    """Every trace file in ``<trace_dir>/<job>/<rank>/``; vanished entries are skipped."""
    out: list[FileInfo] = []
    with os.scandir(trace_dir) as jobs:
        for job in jobs:
            if not _is_dir(job):
                continue
            for rank in _scandir(job.path):
                if not rank.name.isdigit() or not _is_dir(rank):
                    continue
                for entry in _scandir(rank.path):
                    if not is_trace_file(entry.name):
                        continue
                    try:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    out.append(FileInfo(Path(entry.path), st.st_size, st.st_mtime))
    return out


def _scandir(path: str) -> list[os.DirEntry[str]]:
    """A folder's entries, or none if it vanished or cannot be listed."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def newest_trace_file(folder: Path) -> Path | None:
    names = [e.name for e in _scandir(str(folder)) if is_trace_file(e.name)]
    return folder / max(names) if names else None


def ends_with_newline(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except OSError:
        return True
