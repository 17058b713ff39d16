"""A job never overwrites nor prunes a checkpoint its own key did not sign (#25, items 10 and 11).

Two keys, one folder, as two jobs on one ``--checkpoint-dir`` had it: each
saved at the same steps as the other and pruned the rest. Here a job signs
with its key, saves at the other's steps with ``keep`` pruning after every
save, and the other's checkpoints stay whole: the colliding ones set aside
under ``rejected/``, the rest where they were. On a local folder and on an
fsspec store (no rename there: the move is a copy and a delete).
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest
import torch

from undying.checkpoint import latest_valid, save_replicated, scan
from undying.checkpoint.aside import REJECTED_DIR
from undying.checkpoint.discovery import prune
from undying.checkpoint.mac import key_from_token, using_key
from undying.checkpoint.store import Store

OURS, THEIRS = key_from_token("ours"), key_from_token("theirs")


def _fingerprint(store: Store, folder: str) -> dict[str, str]:
    return {rel: hashlib.sha256(store.read_bytes(store.join(folder, *rel.split("/")))).hexdigest()
            for rel in store.files_under(folder)}


@pytest.mark.parametrize("where", ["local", "memory"])
def test_another_keys_checkpoints_are_never_overwritten_nor_pruned(tmp_path: Path, where: str) -> None:
    root = str(tmp_path / "ckpts") if where == "local" else f"memory://own-{uuid.uuid4().hex[:8]}"
    store = Store.open(root)
    with using_key(THEIRS):
        for step in (2, 4, 6):
            save_replicated(store, step, {"w": torch.full((4,), float(step))}, job_id="theirs")
    theirs = {c.name: _fingerprint(store, c.path) for c in scan(store)}

    with using_key(OURS):
        for step in (1, 2, 3, 4):  # 2 and 4 collide with theirs; keep=1 prunes after every save
            save_replicated(store, step, {"w": torch.zeros(4)}, job_id="ours", keep=1)
        found = {c.name: c for c in scan(store)}
        assert found["step-000000006"].problems and not found["step-000000006"].owned  # theirs: left alone
        assert found["step-000000004"].valid and found["step-000000004"].owned  # ours, the newest
        assert set(found) == {"step-000000004", "step-000000006"}, "keep=1 pruned only its own"
        assert latest_valid(store).checkpoint is not None
        assert prune(store, 1) == []  # nothing of theirs is ever a candidate
    assert _fingerprint(store, store.join("step-000000006")) == theirs["step-000000006"]

    moved: dict[str, dict[str, str]] = {}
    for batch in _subfolders(store, REJECTED_DIR):  # rejected/<time>/step-*: one batch per collision here
        for folder in _subfolders(store, f"{REJECTED_DIR}/{batch}"):
            moved[folder] = _fingerprint(store, store.join(REJECTED_DIR, batch, folder))
            with using_key(THEIRS):  # still their checkpoint, valid under their key where it lies
                assert all(c.valid for c in scan(Store.open(store.url_of(store.join(REJECTED_DIR, batch)))))
    assert sorted(moved) == ["step-000000002", "step-000000004"]
    for name, files in moved.items():
        assert files == theirs[name], f"{name} was changed on its way aside"


def _subfolders(store: Store, rel: str) -> list[str]:
    """The names of the folders at ``rel`` under the root."""
    folder = store.join(*rel.split("/"))
    if store.local:
        return sorted(p.name for p in Path(folder).iterdir())
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(folder, detail=False))


def test_a_checkpoint_of_this_key_is_still_replaced_and_pruned(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "ckpts")
    with using_key(OURS):
        for step in (1, 2, 2, 3):
            save_replicated(store, step, {"w": torch.full((2,), float(step))}, job_id="ours", keep=2)
        assert [c.name for c in scan(store)] == ["step-000000002", "step-000000003"]
    assert not (tmp_path / "ckpts" / REJECTED_DIR).exists()
