"""A failed async save is reported and retried while training goes on; the last good checkpoint stays.

The storage failure is real: the checkpoint folder's parent is swapped for a
regular file (every write under it fails with ENOTDIR, even for root), and
swapped back to let a retry succeed. Only the full-disk case uses a fake file
object, since a full disk cannot be made here cheaply.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from undying.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    CheckpointWriteError,
    SaveResult,
    Store,
    latest_valid,
    load_replicated,
    save_replicated,
    verify,
)
from undying.checkpoint.discovery import prune
from undying.checkpoint.manifest import MANIFEST_NAME
from undying.checkpoint.room import os_error_of


class Breakable:
    """``<tmp>/parent/ckpts``; ``break_()`` moves ``parent`` aside and puts a file in its place."""

    def __init__(self, tmp: Path) -> None:
        self.parent = tmp / "parent"
        self.aside = tmp / "parent.aside"
        self.root = self.parent / "ckpts"
        self.root.mkdir(parents=True)

    def break_(self) -> None:
        self.parent.rename(self.aside)
        self.parent.write_text("a file where the checkpoint folder's parent should be")

    def repair(self) -> None:
        self.parent.unlink()
        self.aside.rename(self.parent)

    def names_aside(self) -> list[str]:
        return sorted(os.listdir(self.aside / "ckpts"))


class Reports:
    """Collects on_done calls; ``first_error`` is set on the first failure (from the writer thread)."""

    def __init__(self, on_first_error: Any = None) -> None:
        self.results: list[SaveResult] = []
        self.errors: list[CheckpointWriteError] = []
        self.first_error = threading.Event()
        self._hook = on_first_error

    def __call__(self, result: SaveResult | None, error: CheckpointWriteError | None) -> None:
        if result is not None:
            self.results.append(result)
        if error is not None:
            self.errors.append(error)
            if not self.first_error.is_set():
                if self._hook is not None:
                    self._hook()
                self.first_error.set()


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256, 64), float(step)), "step": step}


def test_failed_save_is_reported_retried_and_succeeds_once_storage_is_back(tmp_path: Path) -> None:
    disk = Breakable(tmp_path)
    seen_aside: list[list[str]] = []

    def repair() -> None:  # runs in the writer thread after the first failure, before the retry
        seen_aside.append(disk.names_aside())
        seen_aside.append(verify(disk.aside / "ckpts" / "step-000000001"))
        disk.repair()

    reports = Reports(on_first_error=repair)
    ckpt = AsyncCheckpointer(disk.root, job_id="j", keep=1, retry_delay_s=0.05, on_done=reports)
    ckpt.save(1, state(1))
    assert ckpt.wait(timeout=30) is not None
    disk.break_()
    live = state(2)
    ticket = ckpt.save(2, live)
    assert not ticket.skipped and ticket.blocking_s < 5  # training goes on
    live["w"].add_(100.0)  # and mutates its state: the retry writes the snapshot of step 2
    result = ckpt.wait(timeout=30)  # no raise: the save succeeded in the end
    assert result is not None and result.step == 2
    [err] = reports.errors
    assert (err.step, err.attempt, err.attempts, err.retry_in) == (2, 1, 3, 0.05)
    assert "checkpoint write of step 2 failed (attempt 1 of 3; retrying in 0.05s" in str(err)
    assert "Not a directory" in str(err) and isinstance(os_error_of(err), NotADirectoryError)
    assert ckpt.errors == [err] and ckpt.last_error is err
    # While the save failed, the previous checkpoint sat untouched and valid, and nothing else appeared.
    assert seen_aside == [["step-000000001"], []]
    assert [r.step for r in reports.results] == [1, 2]
    found, skipped = latest_valid(disk.root)
    assert found is not None and found.step == 2 and skipped == []
    loaded, _ = load_replicated(found)
    assert torch.equal(loaded["w"], torch.full((256, 64), 2.0))
    assert sorted(os.listdir(disk.root)) == ["step-000000002"]  # keep=1 pruned only after success


def test_attempts_are_bounded_and_the_last_failure_is_raised_once(tmp_path: Path) -> None:
    disk = Breakable(tmp_path)
    ckpt = AsyncCheckpointer(disk.root, max_attempts=3, retry_delay_s=0.02, keep=1)
    ckpt.save(1, state(1))
    ckpt.wait(timeout=30)
    disk.break_()
    t0 = time.monotonic()
    ckpt.save(2, state(2))
    with pytest.raises(CheckpointWriteError, match=r"step 2 failed \(attempt 3 of 3; giving up\)") as info:
        ckpt.wait(timeout=30)
    assert time.monotonic() - t0 >= 0.02 + 0.04  # backoff: 0.02 s, then doubled
    assert [(e.attempt, e.retry_in) for e in ckpt.errors] == [(1, 0.02), (2, 0.04), (3, None)]
    assert info.value is ckpt.errors[-1]
    assert ckpt.wait(timeout=30) is not None  # reported once
    assert disk.names_aside() == ["step-000000001"]  # keep=1 never pruned the last good one
    disk.repair()
    found, _ = latest_valid(disk.root)
    assert found is not None and found.step == 1


def test_a_newer_save_supersedes_a_pending_retry(tmp_path: Path) -> None:
    disk = Breakable(tmp_path)
    reports = Reports()
    # skip policy (the worker's): a pending retry is not "busy writing", so the new save is not skipped.
    ckpt = AsyncCheckpointer(disk.root, if_busy="skip", retry_delay_s=60, on_done=reports)
    disk.break_()
    ckpt.save(2, state(2))
    assert reports.first_error.wait(30)
    deadline = time.monotonic() + 10
    while not ckpt.retry_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ckpt.retry_pending and ckpt.busy
    disk.repair()
    ticket = ckpt.save(3, state(3))
    assert not ticket.skipped and ticket.waited_s < 10  # not the 60 s backoff
    result = ckpt.wait(timeout=30)  # the superseded failure of step 2 is not raised
    assert result is not None and result.step == 3
    assert [e.step for e in ckpt.errors] == [2]
    assert sorted(os.listdir(disk.root)) == ["step-000000003"]


def test_wait_without_retries_drops_the_pending_one(tmp_path: Path) -> None:
    disk = Breakable(tmp_path)
    reports = Reports()
    ckpt = AsyncCheckpointer(disk.root, retry_delay_s=60, on_done=reports)
    disk.break_()
    ckpt.save(4, state(4))
    assert reports.first_error.wait(30)
    t0 = time.monotonic()
    with pytest.raises(CheckpointWriteError, match="step 4 failed"):
        ckpt.wait(timeout=30, retries=False)  # e.g. a dying gasp about to write a newer state
    assert time.monotonic() - t0 < 10
    assert not ckpt.busy
    disk.repair()


def test_a_state_that_cannot_be_written_is_not_retried(tmp_path: Path) -> None:
    ckpt = AsyncCheckpointer(tmp_path, retry_delay_s=0.01)
    ckpt.save(1, {"bad": lambda: None})
    with pytest.raises(CheckpointWriteError, match=r"attempt 1 of 3; not retried: not a storage error"):
        ckpt.wait(timeout=30)
    assert len(ckpt.errors) == 1


class FullDisk(Store):
    """A local store whose files fail with ENOSPC after ``room`` bytes (a full disk, faked)."""

    def __init__(self, root: str, room: int) -> None:
        super().__init__(root)
        self.room = room
        self.full = True

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        with super().open_write(path) as f:
            if not self.full:
                yield f
                return
            written = 0
            real_write = f.write

            def write(data: Any) -> int:
                nonlocal written
                written += len(data)
                if written > self.room:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                return real_write(data)

            f.write = write  # type: ignore[method-assign]
            yield f


def test_full_disk_names_the_os_error_and_keeps_the_previous(tmp_path: Path) -> None:
    store = FullDisk(str(tmp_path), room=1 << 16)
    store.full = False
    save_replicated(store, 1, state(1))
    store.full = True
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        save_replicated(store, 2, state(2))
    assert "step-000000002" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["step-000000001"]  # the temp folder is gone too
    reports = Reports(on_first_error=lambda: setattr(store, "full", False))  # space freed meanwhile
    ckpt = AsyncCheckpointer(store, retry_delay_s=0.01, keep=1, on_done=reports)
    ckpt.save(2, state(2))
    result = ckpt.wait(timeout=30)
    assert result is not None and result.step == 2 and len(reports.errors) == 1
    assert "No space left on device" in str(reports.errors[0])


def test_retention_never_prunes_the_last_valid_for_a_broken_newer_one(tmp_path: Path) -> None:
    for s in (1, 2):
        save_replicated(tmp_path, s, state(s))
    # What failed newer saves can leave: a folder without manifest (killed before the commit) and a
    # committed one whose file was damaged afterwards (same size, one byte flipped).
    (tmp_path / "step-000000003").mkdir()
    save_replicated(tmp_path, 4, state(4))
    data = bytearray((tmp_path / "step-000000004" / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "step-000000004" / "state.pt").write_bytes(bytes(data))
    prune(tmp_path, keep=1)
    names = sorted(os.listdir(tmp_path))
    assert "step-000000002" in names and "step-000000001" not in names
    found, skipped = latest_valid(tmp_path)
    assert found is not None and found.step == 2
    assert [name for name, _ in skipped] == ["step-000000004", "step-000000003"]
    assert (tmp_path / "step-000000002" / MANIFEST_NAME).exists()


def test_retry_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        AsyncCheckpointer(tmp_path, max_attempts=0)
    with pytest.raises(ValueError, match="delays"):
        AsyncCheckpointer(tmp_path, retry_delay_s=-1)
    ckpt = AsyncCheckpointer(tmp_path, retry_delay_s=1.0, retry_delay_max_s=3.0)
    assert [ckpt.retry_delay(a) for a in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 3.0]
