"""Atomic commit, latest-valid discovery that skips broken checkpoints with a reason, retention."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from undying.checkpoint import (
    CheckpointError,
    Store,
    latest_valid,
    load_replicated,
    save_replicated,
    scan,
    verify,
)
from undying.checkpoint.discovery import prune
from undying.checkpoint.manifest import MANIFEST_NAME
from undying.checkpoint.store import TMP_PREFIX, CheckpointExistsError


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=g), "step": step}


def save(root: Path, step: int, **kw: object) -> str:
    return save_replicated(root, step, state(step), job_id="job", **kw).path  # type: ignore[arg-type]


def test_layout_and_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    path = save(root, 120, world_size=4, digest="abc", kind="dying-gasp", generation=2)
    assert path == str(root / "step-000000120")
    assert sorted(os.listdir(path)) == [MANIFEST_NAME, "state.pt"]
    assert not [n for n in os.listdir(root) if n.startswith(TMP_PREFIX)]
    loaded, manifest = load_replicated(path)
    assert torch.equal(loaded["w"], state(120)["w"]) and loaded["step"] == 120
    assert (manifest.step, manifest.world_size, manifest.kind, manifest.digest, manifest.generation) == (
        120, 4, "dying-gasp", "abc", 2,
    )  # fmt: skip
    assert manifest.layout == {"kind": "replicated", "file": "state.pt"}
    assert [f.path for f in manifest.files] == ["state.pt"]
    assert manifest.files[0].size == os.path.getsize(root / "step-000000120" / "state.pt")
    assert verify(path) == []


def test_commit_order_files_then_rename_then_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    rename, write_atomic = Store.rename, Store.write_atomic

    def spy_rename(self: Store, src: str, dst: str) -> None:
        # every file is already complete in the temp folder when it is renamed into place
        assert os.path.getsize(os.path.join(src, "state.pt")) > 0
        events.append(("rename", os.path.basename(dst)))
        rename(self, src, dst)

    def spy_write(self: Store, path: str, data: bytes) -> None:
        events.append(("write_atomic", os.path.basename(path)))
        write_atomic(self, path, data)

    monkeypatch.setattr(Store, "rename", spy_rename)
    monkeypatch.setattr(Store, "write_atomic", spy_write)
    save(tmp_path, 7)
    assert events == [("rename", "step-000000007"), ("write_atomic", MANIFEST_NAME)]


def test_crash_before_the_manifest_leaves_a_partial_checkpoint_that_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(tmp_path, 10)

    def die(self: Store, path: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Store, "write_atomic", die)
    with pytest.raises(CheckpointError, match="No space left"):
        save(tmp_path, 20)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step-000000010"]  # the failed save cleaned up after itself
    # A process killed at that point instead leaves the renamed folder without a manifest:
    save(tmp_path, 20)
    (tmp_path / "step-000000020" / MANIFEST_NAME).unlink()
    found, skipped = latest_valid(tmp_path)
    assert found is not None and found.step == 10
    assert skipped == [("step-000000020", "no manifest.json: a partial checkpoint (the write did not finish)")]


def test_failed_manifest_on_overwrite_restores_the_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save(tmp_path, 10)
    before = (tmp_path / "step-000000010" / "state.pt").read_bytes()

    def die(self: Store, path: str, data: bytes) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(Store, "write_atomic", die)
    with pytest.raises(CheckpointError, match="I/O error"):
        save_replicated(tmp_path, 10, {"w": torch.zeros(2)})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["step-000000010"]
    assert (tmp_path / "step-000000010" / "state.pt").read_bytes() == before
    assert verify(tmp_path / "step-000000010") == []


def test_failed_write_removes_its_temp_folder_and_keeps_the_previous(tmp_path: Path) -> None:
    save(tmp_path, 10)
    with pytest.raises(Exception, match="Can't pickle|cannot pickle|pickle"):
        save_replicated(tmp_path, 20, {"bad": lambda: 0})
    assert sorted(os.listdir(tmp_path)) == ["step-000000010"]
    assert verify(tmp_path / "step-000000010") == []


def test_overwrite_same_step(tmp_path: Path) -> None:
    save(tmp_path, 5)
    save_replicated(tmp_path, 5, {"w": torch.zeros(3)})
    loaded, _ = load_replicated(tmp_path / "step-000000005")
    assert torch.equal(loaded["w"], torch.zeros(3))
    assert sorted(os.listdir(tmp_path)) == ["step-000000005"]
    with pytest.raises(CheckpointExistsError, match="already exists"):
        save_replicated(tmp_path, 5, {"w": torch.ones(3)}, overwrite=False)


def test_unwritable_root_names_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match=str(blocker)):
        save_replicated(blocker / "ckpt", 1, state(1))


# -- discovery: each kind of damage is skipped, with its reason ------------------------------


@pytest.fixture
def two(tmp_path: Path) -> Path:
    save(tmp_path, 110)
    save(tmp_path, 120)
    return tmp_path


def newest_file(root: Path) -> Path:
    return root / "step-000000120" / "state.pt"


def test_truncated_file_is_skipped(two: Path, caplog: pytest.LogCaptureFixture) -> None:
    size = newest_file(two).stat().st_size
    with open(newest_file(two), "r+b") as f:
        f.truncate(10)
    with caplog.at_level(logging.WARNING, logger="undying.checkpoint"):
        found, skipped = latest_valid(two)
    assert found is not None and found.step == 110
    assert skipped == [("step-000000120", f"file state.pt has size 10, manifest says {size}")]
    assert "skipped checkpoint" in caplog.text and "has size 10" in caplog.text


def test_flipped_byte_is_skipped(two: Path) -> None:
    data = bytearray(newest_file(two).read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest_file(two).write_bytes(bytes(data))
    found, skipped = latest_valid(two)
    assert found is not None and found.step == 110
    ((name, reason),) = skipped
    assert name == "step-000000120"
    assert reason.startswith("file state.pt has crc32 ") and "manifest says" in reason


def test_deleted_manifest_is_skipped(two: Path) -> None:
    (two / "step-000000120" / MANIFEST_NAME).unlink()
    found, skipped = latest_valid(two)
    assert found is not None and found.step == 110
    assert skipped == [("step-000000120", "no manifest.json: a partial checkpoint (the write did not finish)")]


def test_deleted_file_and_garbled_manifest(two: Path) -> None:
    newest_file(two).unlink()
    (two / "step-000000110" / MANIFEST_NAME).write_text("{garbage")
    found, skipped = latest_valid(two)
    assert found is None
    assert skipped[0] == ("step-000000120", "file state.pt is missing")
    assert skipped[1][0] == "step-000000110" and "manifest.json is corrupt: manifest is not valid JSON" in skipped[1][1]


def test_sha256_detects_corruption(tmp_path: Path) -> None:
    save(tmp_path, 1, checksum="sha256")
    f = tmp_path / "step-000000001" / "state.pt"
    data = bytearray(f.read_bytes())
    data[-30] ^= 1
    f.write_bytes(bytes(data))
    (problem,) = verify(tmp_path / "step-000000001")
    assert "has sha256" in problem


def test_other_job_is_skipped_and_load_refuses_corrupt(two: Path) -> None:
    found, skipped = latest_valid(two, job_id="other")
    assert found is None and "belongs to job 'job', not 'other'" in skipped[0][1]
    with open(newest_file(two), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="has size 100"):
        load_replicated(two / "step-000000120")


def test_verify_bad_paths(tmp_path: Path) -> None:
    assert "not a checkpoint folder" in verify(tmp_path)[0]
    assert "does not exist" in verify(tmp_path / "step-000000001")[0]


def test_empty_or_missing_root(tmp_path: Path) -> None:
    assert latest_valid(tmp_path / "none") == (None, [])
    assert scan(tmp_path / "none") == []


# -- retention ------------------------------------------------------------------------------


def test_prune_keeps_the_newest_valid_and_only_touches_its_own_names(tmp_path: Path) -> None:
    for s in (10, 20, 30, 40):
        save(tmp_path, s)
    (tmp_path / "step-000000020" / "state.pt").unlink()  # broken, older than the kept ones
    (tmp_path / "step-000000050").mkdir()  # newer and partial: maybe a commit in progress
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-other").mkdir()
    old_tmp = tmp_path / f"{TMP_PREFIX}000000025-1-abc"  # abandoned before step 40 committed
    old_tmp.mkdir()
    os.utime(old_tmp, (time.time() - 100, time.time() - 100))
    live_tmp = tmp_path / f"{TMP_PREFIX}000000060-2-def"  # a write in progress
    live_tmp.mkdir()
    removed = prune(tmp_path, keep=2)
    assert sorted(removed) == sorted(["step-000000010", "step-000000020", old_tmp.name])
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["step-000000030", "step-000000040", "step-000000050", "notes.txt", "step-other", live_tmp.name]
    )
    os.utime(live_tmp, (time.time() - 7200, time.time() - 7200))
    assert prune(tmp_path, keep=2) == [live_tmp.name]  # stale for over an hour
    with pytest.raises(ValueError):
        prune(tmp_path, keep=0)


def test_save_with_keep_prunes(tmp_path: Path) -> None:
    for s in range(5):
        save(tmp_path, s, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000000003", "step-000000004"]
