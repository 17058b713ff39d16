"""Bad input, clear errors: unusable locations and checkpoints of another job or model, refused by name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from undying.checkpoint import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointLocationError,
    IncompatibleCheckpointError,
    Manifest,
    Store,
    check_compatible,
    check_writable,
    latest_valid,
    load_replicated,
    save_replicated,
    tensor_shapes,
    tensor_specs,
)
from undying.errors import UsageError


def model_state(hidden: int = 8, layers: int = 2, *, trained: bool = True) -> dict[str, object]:
    """A State-like dict: model, optimizer (per-parameter state only once trained), extras."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.Adam(model.parameters())
    if trained:
        model(torch.randn(2, hidden)).sum().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None, "extras": {}}


# -- check_writable -------------------------------------------------------------


def test_writable_folder_is_created_and_left_clean(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    store = check_writable(target)
    assert isinstance(store, Store) and store.local and store.root == str(target)
    assert target.is_dir() and os.listdir(target) == []  # the probe is gone
    assert check_writable(f"file://{target}").root == str(target)
    assert check_writable("memory://undying-check/ckpts").protocol == "memory"


def test_a_file_in_the_way_is_named(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointLocationError, match=r"checkpoint location .*/f: is a file, not a folder"):
        check_writable(tmp_path / "f")
    with pytest.raises(CheckpointLocationError, match=rf"is inside {tmp_path}/f, which is a file"):
        check_writable(tmp_path / "f" / "ckpts")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_a_read_only_folder_is_named(tmp_path: Path) -> None:  # pragma: no cover - CI runs as root
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(CheckpointLocationError, match="is not writable"):
            check_writable(ro)
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("://bucket/x", "has no protocol"),
        ("s3:/bucket/ckpts", "s3:// URL with a slash missing; write it as s3://bucket/ckpts"),
        ("gs:bucket/ckpts", "write it as gs://bucket/ckpts"),
        ("s3://", "names no bucket or path"),
        ("nosuchproto://bucket/x", "nosuchproto"),
    ],
)
def test_malformed_or_unknown_urls_are_named(url: str, says: str) -> None:
    with pytest.raises(CheckpointLocationError) as info:
        check_writable(url)
    text = str(info.value)
    assert says in text and text.startswith("checkpoint location") and "\n" not in text
    assert isinstance(info.value, UsageError) and isinstance(info.value, CheckpointError)


def test_a_colon_in_a_folder_name_is_not_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    check_writable("run:3")  # not a storage scheme: a plain relative folder
    assert (tmp_path / "run:3").is_dir()


def test_uninstalled_protocol_says_what_to_install() -> None:
    pytest.importorskip("fsspec")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(CheckpointLocationError, match="s3fs"):
            check_writable("s3://bucket/ckpts")
    else:  # pragma: no cover - s3fs installed: nothing reachable to probe here
        pytest.skip("s3fs is installed")


# -- manifest records the tensors ------------------------------------------------


def test_saves_record_tensor_names_and_shapes(tmp_path: Path) -> None:
    sd = model_state()
    result = save_replicated(tmp_path, 1, sd, job_id="j")
    _, manifest = load_replicated(result.path)
    assert manifest.tensors == tensor_specs(sd)
    assert manifest.tensors is not None
    assert manifest.tensors["model/0.weight"] == {"shape": [8, 8], "dtype": "float32"}
    assert manifest.tensors["optimizer/state/0/exp_avg"]["shape"] == [8, 8]
    assert tensor_shapes(sd)["model/2.bias"] == (8,)


def test_old_manifests_without_tensors_still_load(tmp_path: Path) -> None:
    result = save_replicated(tmp_path, 1, {"w": torch.ones(2)}, job_id="j")
    path = Path(result.path) / MANIFEST_NAME
    data = json.loads(path.read_text())
    del data["tensors"]  # what undying wrote before it recorded them
    path.write_text(json.dumps(data))
    found, skipped = latest_valid(tmp_path)
    assert found is not None and found.manifest is not None and not skipped
    assert found.manifest.tensors is None
    assert "tensors" not in found.manifest.to_dict()
    check_compatible(found, job_id="j", state_shapes={"w": (3,)})  # nothing to compare: accepted


def test_bad_tensor_entries_are_refused() -> None:
    base = json.loads(
        Manifest(1, 1, {"kind": "replicated"}, "periodic", "j", 0, 0.0, (), tensors={"w": {"shape": [2], "dtype": "float32"}}).to_json()
    )
    assert Manifest.from_dict(base).tensors == {"w": {"shape": [2], "dtype": "float32"}}
    for bad, says in (
        ([1], "'tensors' must be an object"),
        ({"w": {"shape": [-1], "dtype": "f"}}, "bad shape"),
        ({"w": {"shape": [2]}}, "bad dtype"),
        ({"w": 3}, "must map a name to an object"),
    ):
        with pytest.raises(ValueError, match=says):
            Manifest.from_dict({**base, "tensors": bad})


# -- check_compatible -------------------------------------------------------------


def test_same_model_is_compatible_fresh_optimizer_included(tmp_path: Path) -> None:
    save_replicated(tmp_path, 5, model_state(), job_id="j", world_size=4)
    found, _ = latest_valid(tmp_path)
    assert found is not None
    # A fresh process: same model, an optimizer without per-parameter state yet, another world size.
    check_compatible(found, job_id="j", world_size=2, state_shapes=tensor_shapes(model_state(trained=False)))
    check_compatible(found, job_id="j", state_shapes=tensor_shapes(model_state()))
    check_compatible(found)  # nothing asked, nothing checked
    saved_by_tool = save_replicated(tmp_path, 6, model_state(), job_id="")  # no job id: accepted
    _, manifest = load_replicated(saved_by_tool.path)
    check_compatible(manifest, job_id="j")


def test_checkpoint_of_another_job_is_named(tmp_path: Path) -> None:
    save_replicated(tmp_path, 5, model_state(), job_id="job-a")
    found, _ = latest_valid(tmp_path)
    assert found is not None
    with pytest.raises(IncompatibleCheckpointError) as info:
        check_compatible(found, job_id="job-b")
    text = str(info.value)
    assert found.url in text and "belongs to job 'job-a', not 'job-b'" in text and "--job-id job-a" in text
    assert isinstance(info.value, UsageError)


def test_different_shapes_name_the_first_mismatch(tmp_path: Path) -> None:
    save_replicated(tmp_path, 5, model_state(hidden=8), job_id="j")
    found, _ = latest_valid(tmp_path)
    assert found is not None
    with pytest.raises(IncompatibleCheckpointError) as info:
        check_compatible(found, job_id="j", state_shapes=tensor_shapes(model_state(hidden=16, trained=False)))
    text = str(info.value)
    assert found.url in text
    assert "model/0.weight has shape [8, 8] there, [16, 16] here (and 3 more mismatches)" in text
    assert "\n" not in text


def test_different_parameter_names_are_named(tmp_path: Path) -> None:
    save_replicated(tmp_path, 5, model_state(layers=2), job_id="j")
    found, _ = latest_valid(tmp_path)
    assert found is not None
    with pytest.raises(IncompatibleCheckpointError, match=r"it has model/2.bias \(shape \[8\]\), this model does not \(and 1 more mismatch\)"):
        check_compatible(found, state_shapes=tensor_shapes(model_state(layers=1, trained=False)))
    with pytest.raises(IncompatibleCheckpointError, match=r"model/4.weight \(shape \[8, 8\]\) is not in it"):
        check_compatible(found, state_shapes=tensor_shapes(model_state(layers=3, trained=False)))


def test_manifest_alone_is_named_by_path_and_layout_world_size() -> None:
    m = Manifest(3, 4, {"kind": "per-rank"}, "periodic", "j", 0, 0.0, ())
    with pytest.raises(IncompatibleCheckpointError, match=r"checkpoint /x/step-3 was written by 4 ranks with layout 'per-rank'"):
        check_compatible(m, path="/x/step-3", world_size=2)
    check_compatible(m, world_size=4)
    check_compatible(Manifest(3, 4, {"kind": "replicated"}, "periodic", "j", 0, 0.0, ()), world_size=2)
