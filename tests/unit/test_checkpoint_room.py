"""undying.checkpoint.room: what a save that finds no room deletes, and what it never deletes (#14 finding 6)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from undying.checkpoint import save_replicated, scan
from undying.checkpoint.room import describe_os_error, is_out_of_space, make_room, with_room
from undying.checkpoint.store import CheckpointError, Store


def _save(root: Path, step: int) -> None:
    save_replicated(root, step, {"w": torch.full((64,), float(step))}, job_id="j")


def _full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def test_make_room_keeps_only_the_newest_valid_checkpoint_and_never_a_newer_broken_one_in_its_place(
    tmp_path: Path,
) -> None:
    for step in (4, 8, 12):
        _save(tmp_path, step)
    # A newer folder whose file was flipped: sizes match, the checksum does not. It is not "the newest valid".
    _save(tmp_path, 16)
    state = tmp_path / "step-000000016" / "state.pt"
    data = bytearray(state.read_bytes())
    data[-20] ^= 0xFF
    state.write_bytes(bytes(data))
    removed = make_room(Store.open(tmp_path))
    assert removed == ["step-000000004", "step-000000008"]
    assert [(c.step, c.valid) for c in scan(tmp_path)] == [(12, True), (16, False)]


def test_with_room_prunes_then_saves_once_more_only_for_a_lack_of_room(tmp_path: Path) -> None:
    for step in (4, 8):
        _save(tmp_path, step)
    calls: list[int] = []
    pruned: list[list[str]] = []

    def save_full_once() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise CheckpointError("cannot write") from _full()
        return "written"

    assert with_room(Store.open(tmp_path), save_full_once, on_pruned=pruned.append) == "written"
    assert len(calls) == 2 and pruned == [["step-000000004"]]

    def save_denied() -> str:
        raise CheckpointError("cannot write") from PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(CheckpointError):
        with_room(Store.open(tmp_path), save_denied)
    assert [c.step for c in scan(tmp_path)] == [8], "a failure that is not about room deleted a checkpoint"


def test_with_room_does_not_retry_when_nothing_could_be_deleted(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    calls: list[int] = []

    def always_full() -> None:
        calls.append(1)
        raise CheckpointError("cannot write") from _full()

    with pytest.raises(CheckpointError):
        with_room(Store.open(tmp_path), always_full)
    assert calls == [1] and [c.step for c in scan(tmp_path)] == [4]


def test_the_os_error_is_named_as_an_operator_greps_for_it() -> None:
    chained = CheckpointError("cannot write")
    chained.__cause__ = RuntimeError("stream position")
    chained.__cause__.__context__ = _full()
    assert is_out_of_space(chained)
    assert describe_os_error(chained) == "ENOSPC: No space left on device"
    assert describe_os_error(OSError(errno.EDQUOT, "Disk quota exceeded")) == "EDQUOT: Disk quota exceeded"
    assert describe_os_error(ValueError("no OS in this")) == ""
    assert not is_out_of_space(PermissionError(errno.EACCES, "Permission denied"))
