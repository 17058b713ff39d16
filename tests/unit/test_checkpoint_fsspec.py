"""The same contract on an fsspec store (memory://): manifest last as the commit marker, DCP included."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec
import pytest
import torch

from undying.checkpoint import (
    Store,
    latest_valid,
    load_replicated,
    load_sharded,
    save_replicated,
    save_sharded,
    verify,
)
from undying.checkpoint.discovery import prune
from undying.checkpoint.manifest import MANIFEST_NAME


@pytest.fixture
def root() -> Iterator[str]:
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_memory_store_is_not_renaming() -> None:
    store = Store.open("memory://x")
    assert not store.local and not store.supports_rename
    assert store.url_of(store.join("step-000000001")) == "memory:///x/step-000000001"
    local = Store.open("file:///tmp/x")
    assert local.local and local.root == "/tmp/x"


def test_replicated_round_trip_and_discovery(root: str) -> None:
    fs = fsspec.filesystem("memory")
    for step in (1, 2, 3):
        save_replicated(root, step, {"w": torch.full((8,), float(step))}, job_id="j", keep=2)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert names == ["step-000000002", "step-000000003"]  # no temp folders on an object store
    found, skipped = latest_valid(root)
    assert found is not None and found.step == 3 and skipped == []
    assert found.url == f"{root.replace('memory://', 'memory:///')}/step-000000003"
    state, manifest = load_replicated(found)
    assert torch.equal(state["w"], torch.full((8,), 3.0)) and manifest.job_id == "j"
    # damage: a flipped byte in the newest, a missing manifest in a newer partial one
    path = f"{root}/step-000000003/state.pt"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 1
    fs.pipe_file(path, bytes(data))
    fs.pipe_file(f"{root}/step-000000004/state.pt", b"partial")
    found, skipped = latest_valid(root)
    assert found is not None and found.step == 2
    assert [n for n, _ in skipped] == ["step-000000004", "step-000000003"]
    assert skipped[0][1].startswith(f"no {MANIFEST_NAME}")
    assert "has crc32" in skipped[1][1]
    assert "has crc32" in verify(f"{root}/step-000000003")[0]
    assert prune(root, keep=1) == []  # only one valid; the broken ones are newer, kept for inspection


def test_overwrite_on_object_store_drops_the_manifest_first(root: str) -> None:
    save_replicated(root, 1, {"w": torch.ones(2)})
    save_replicated(root, 1, {"w": torch.zeros(2)})
    state, _ = load_replicated(f"{root}/step-000000001")
    assert torch.equal(state["w"], torch.zeros(2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_single_process_on_memory(root: str) -> None:
    sd = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}
    result = save_sharded(root, 10, sd, job_id="j", kind="dying-gasp")
    found, _ = latest_valid(root)
    assert found is not None and found.manifest is not None
    m = found.manifest
    assert (m.step, m.world_size, m.kind) == (10, 1, "dying-gasp")
    assert m.layout == {"kind": "sharded", "planner": "dcp"}
    assert ".metadata" in {f.path for f in m.files} and any(f.path.endswith(".distcp") for f in m.files)
    assert result.bytes == m.total_bytes
    target = {"w": torch.zeros(3, 4), "b": torch.zeros(3)}
    load_sharded(found, target)
    assert torch.equal(target["w"], sd["w"]) and torch.equal(target["b"], sd["b"])
    with pytest.raises(Exception, match="load it with load_sharded"):
        load_replicated(found)
