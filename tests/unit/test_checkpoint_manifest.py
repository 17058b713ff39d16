"""The manifest: a lossless JSON round trip, and a refusal naming the field for anything malformed."""

from __future__ import annotations

import json

import pytest

from undying.checkpoint.manifest import (
    SCHEMA_VERSION,
    FileEntry,
    Manifest,
    ManifestError,
    parse_step_dirname,
    step_dirname,
)


def make(**over: object) -> Manifest:
    fields: dict[str, object] = dict(
        step=120,
        world_size=4,
        layout={"kind": "sharded", "planner": "dcp", "mesh": [4]},
        kind="dying-gasp",
        job_id="job-a",
        generation=3,
        created_at=1700000000.25,
        files=(FileEntry("__0_0.distcp", 4096, "0badf00d"), FileEntry(".metadata", 10, "ab" * 32, "sha256")),
        digest="d1g35t",
        meta={"loss": 1.5},
    )
    fields.update(over)
    return Manifest(**fields)  # type: ignore[arg-type]


def test_round_trip_is_lossless() -> None:
    m = make()
    text = m.to_json()
    back = Manifest.from_json(text)
    assert back == m
    data = json.loads(text)
    assert data["schema"] == SCHEMA_VERSION
    assert data["files"][0] == {"path": "__0_0.distcp", "size": 4096, "crc32": "0badf00d"}
    assert data["files"][1]["sha256"] == "ab" * 32
    assert back.total_bytes == 4106


def test_optional_digest_and_meta() -> None:
    m = make(digest=None, meta={})
    data = json.loads(m.to_json())
    del data["meta"]
    assert Manifest.from_dict(data) == m


def test_manifest_is_frozen() -> None:
    with pytest.raises(AttributeError):
        make().step = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda d: d.pop("step"), "no 'step'"),
        (lambda d: d.update(step="7"), "'step' has the wrong type"),
        (lambda d: d.update(kind="nightly"), "kind must be one of"),
        (lambda d: d.update(schema=SCHEMA_VERSION + 1), "newer than this undying"),
        (lambda d: d["files"][0].pop("crc32"), "has no checksum"),
        (lambda d: d["files"][0].update(size=-1), "bad size"),
        (lambda d: d["files"][0].update(path="../escape"), "bad path"),
        (lambda d: d.update(layout={}), "layout needs a 'kind'"),
        (lambda d: d.update(world_size=True), "world_size"),
    ],
)
def test_malformed_manifests_name_the_field(mutate: object, words: str) -> None:
    data = json.loads(make().to_json())
    mutate(data)  # type: ignore[operator]
    with pytest.raises(ManifestError, match=words):
        Manifest.from_dict(data)


def test_not_json() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(b'{"step": 1,')


def test_step_names_sort_like_steps() -> None:
    assert step_dirname(120) == "step-000000120"
    assert parse_step_dirname("step-000000120") == 120
    assert parse_step_dirname(".tmp-step-000000120-1-abc") is None
    assert parse_step_dirname("step-12") is None
    names = [step_dirname(s) for s in (5, 100, 20, 1_000_000_000)]
    assert sorted(names) == [step_dirname(s) for s in (5, 20, 100, 1_000_000_000)]
    with pytest.raises(ValueError):
        step_dirname(-1)
