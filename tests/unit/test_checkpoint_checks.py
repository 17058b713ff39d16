"""Bad input, clear errors: unusable locations and checkpoints of another job or model, refused by name.

And the job check on resume (``check_same_job``): another job's checkpoint is refused when the user
named the job, resumed (and said so) when the id is the random default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from undying.checkpoint import (
    CheckpointError,
    Manifest,
    Store,
    latest_valid,
    load_replicated,
    save_replicated,
    scan,
)
from undying.checkpoint.checks import (
    CheckpointLocationError,
    CheckpointOfAnotherJobError,
    IncompatibleCheckpointError,
    check_compatible,
    check_same_job,
    check_writable,
    tensor_shapes,
    tensor_specs,
)
from undying.checkpoint.manifest import MANIFEST_NAME, ManifestError
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


# -- check_same_job: the job check on resume ----------------------------------------


def test_this_jobs_own_checkpoint_resumes_with_nothing_to_say(tmp_path: Path) -> None:
    save_replicated(tmp_path, 5, model_state(), job_id="job-a")
    found, _ = latest_valid(tmp_path)
    assert found is not None
    assert check_same_job(found, "job-a", job_id_given=True) is None
    assert check_same_job(found, "job-a", job_id_given=False) is None


def test_another_jobs_checkpoint_is_refused_when_the_job_id_was_given(tmp_path: Path) -> None:
    save_replicated(tmp_path, 5, model_state(), job_id="job-a")
    found, _ = latest_valid(tmp_path)
    assert found is not None
    with pytest.raises(CheckpointOfAnotherJobError) as info:
        check_same_job(found, "job-b", job_id_given=True)
    text = str(info.value)
    assert text == (
        f"checkpoint {found.url} (step 5) belongs to job 'job-a', not to this job 'job-b'; "
        "pass --job-id job-a to resume it, or another --checkpoint-dir to start fresh"
    )
    # Bad input: the CLI prints it as one line and exits 2; callers that catch the older class still do.
    assert isinstance(info.value, IncompatibleCheckpointError) and isinstance(info.value, UsageError)


def test_without_a_job_id_another_jobs_checkpoint_is_resumed_and_said(tmp_path: Path) -> None:
    """The id is random per launch then: the same command run again must resume, and the log says whose."""
    save_replicated(tmp_path, 7, model_state(), job_id="job-a")
    found, _ = latest_valid(tmp_path)
    assert found is not None
    note = check_same_job(found, "job-20261123-101500-3f2a1b", job_id_given=False)
    assert note == (
        f"resuming job job-a's checkpoint at step 7 ({found.url}) as job job-20261123-101500-3f2a1b "
        "(no --job-id given)"
    )


def test_a_manifest_alone_is_named_by_its_path() -> None:
    m = Manifest(9, 2, {"kind": "replicated"}, "dying-gasp", "job-a", 0, 0.0, ())
    with pytest.raises(CheckpointOfAnotherJobError, match=r"^checkpoint /ck/step-000000009 \(step 9\) belongs"):
        check_same_job(m, "job-b", True, path="/ck/step-000000009")
    with pytest.raises(CheckpointOfAnotherJobError, match=r"^checkpoint of step 9 \(step 9\) belongs to job 'job-a'"):
        check_same_job(m, "job-b", True)
    assert check_same_job(m, "job-b", False, path="/ck/step-000000009") == (
        "resuming job job-a's checkpoint at step 9 (/ck/step-000000009) as job job-b (no --job-id given)"
    )


def test_a_checkpoint_that_records_no_job_is_resumed_by_any(tmp_path: Path) -> None:
    save_replicated(tmp_path, 3, model_state(), job_id="")  # written outside a job
    found, _ = latest_valid(tmp_path)
    assert found is not None
    assert check_same_job(found, "job-b", job_id_given=True) is None


@pytest.mark.parametrize("stored", ["absent", None])
def test_old_manifests_without_a_job_id_still_load_and_resume(tmp_path: Path, stored: str | None) -> None:
    result = save_replicated(tmp_path, 4, {"w": torch.ones(2)}, job_id="job-a")
    path = Path(result.path) / MANIFEST_NAME
    data = json.loads(path.read_text())
    if stored == "absent":
        del data["job_id"]  # what a manifest that never recorded it looks like
    else:
        data["job_id"] = stored
    path.write_text(json.dumps(data))
    found, skipped = latest_valid(tmp_path)
    assert found is not None and found.manifest is not None and not skipped
    assert found.manifest.job_id == ""
    assert check_same_job(found, "job-b", job_id_given=True) is None
    payload, manifest = load_replicated(found.path)
    assert torch.equal(payload["w"], torch.ones(2)) and manifest.job_id == ""


def test_a_job_id_that_is_not_a_string_is_refused_by_name(tmp_path: Path) -> None:
    data = json.loads(Manifest(1, 1, {"kind": "replicated"}, "periodic", "j", 0, 0.0, ()).to_json())
    with pytest.raises(ManifestError, match=r"manifest 'job_id' must be a string, got 7"):
        Manifest.from_dict({**data, "job_id": 7})


def test_a_checkpoint_without_a_readable_manifest_is_refused(tmp_path: Path) -> None:
    result = save_replicated(tmp_path, 2, {"w": torch.ones(2)}, job_id="job-a")
    (Path(result.path) / MANIFEST_NAME).unlink()
    (broken,) = scan(tmp_path)
    assert broken.manifest is None
    with pytest.raises(IncompatibleCheckpointError, match="has no readable manifest"):
        check_same_job(broken, "job-a", job_id_given=False)
