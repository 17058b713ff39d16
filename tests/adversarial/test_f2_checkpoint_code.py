"""Finding 2, "Checkpoints that run code": a tampered checkpoint never runs code and never loads.

Before: a checkpoint was loaded with ``weights_only=False`` when the safe load
failed, peers' and replicas' payloads always were, and the manifest's CRC32 was
recomputed by anyone who could write the folder: a tampered checkpoint ran code
on every rank. Now every load is ``weights_only=True`` and a job's manifests
carry an HMAC-SHA256 under a key derived from its token (docs/security.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.jobs import start_job
from tests.oracle import Oracle
from undying.checkpoint import (
    CheckpointError,
    latest_valid,
    load_replicated,
    save_replicated,
    verify,
)
from undying.checkpoint.mac import key_from_token, using_key
from undying.checkpoint.safe_load import load_state_bytes
from undying.demo.oracle import load_run
from undying.errors import RecoveryError

RANKS = 2


class _RunsCode:
    """Unpickling this runs ``touch MARKER``: what an attacker puts in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _rewrite_state(folder: Path, payload: object, *, keep_mac: bool) -> None:
    """Replace ``state.pt`` and recompute every plain digest in the manifest, as an attacker with write access can."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    (folder / "state.pt").write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] == "state.pt":
            entry["size"] = len(data)
            entry.pop("crc32", None)
            entry["sha256"] = hashlib.sha256(data).hexdigest()
    if not keep_mac:
        manifest.pop("mac", None)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("keep_mac", [True, False], ids=["stale-mac", "mac-stripped"])
def test_a_checkpoint_that_unpickles_into_code_never_runs_it(
    oracle: Oracle, tmp_path: Path, reap: list[int], keep_mac: bool
) -> None:
    """The newest checkpoint's payload is replaced by one that runs a command when unpickled, every digest
    recomputed: the resume skips it with the reason (log and `undying checkpoints`), resumes from the one before,
    and its losses are the fault-free run's; the command never ran."""
    marker = tmp_path / "code-ran"
    ckpts = tmp_path / "ckpts"
    common = ["--spares", "0", "--checkpoint-dir", str(ckpts), "--save-every", "8", "--job-id", "victim"]
    first = start_job(tmp_path / "a", ["--epochs", "1"], ranks=RANKS, reap=reap, run_args=common)
    assert first.wait(timeout=120) == 0, (tmp_path / "a.log").read_text()[-3000:]
    *older, newest = sorted(ckpts.glob("step-*"))
    assert newest.name == "step-000000032" and older, sorted(ckpts.glob("step-*"))
    fallback = int(older[-1].name.removeprefix("step-"))
    state, _ = load_replicated(newest, check=False)
    state["extras"] = {"evil": {"payload": _RunsCode(marker)}}
    _rewrite_state(newest, state, keep_mac=keep_mac)
    reason = "MAC does not match" if keep_mac else "has no MAC"

    # `undying checkpoints` says which one is rejected and why (its retention is the resumed job's to run).
    listing = subprocess.run(
        [sys.executable, "-m", "undying", "checkpoints", "verify", "--root", str(ckpts), "--json"],
        capture_output=True, text=True, timeout=60, check=False)
    rows = {Path(r["path"]).name: r for r in json.loads(listing.stdout)["checkpoints"]}
    assert listing.returncode == 1 and json.loads(listing.stdout)["mac_checked"], listing.stdout
    assert not rows[newest.name]["valid"] and reason in rows[newest.name]["problems"][0]
    assert all(row["valid"] for name, row in rows.items() if name != newest.name)
    assert not marker.exists()

    resumed = start_job(tmp_path / "b", ["--epochs", "2"], ranks=RANKS, reap=reap, run_args=common)
    assert resumed.wait(timeout=120) == 0, (tmp_path / "b.log").read_text()[-3000:]
    assert not marker.exists(), "unpickling the tampered checkpoint ran its code"
    log = (tmp_path / "b.log").read_text()
    assert f"skipped checkpoint {newest}" in log and reason in log, log[-3000:]

    # Resumed from the newest checkpoint the job signed: every loss after it is the fault-free run's.
    run = load_run(tmp_path / "b" / "events.db")
    reference = oracle.baseline(["--epochs", "2"], RANKS)
    assert min(run.losses) == fallback + 1, (fallback, sorted(run.losses)[:3])
    assert {s: run.losses[s] for s in run.losses} == {s: reference.losses[s] for s in run.losses}
    assert max(run.losses) == 64 and not run.inconsistent_steps



def test_a_tensor_changed_in_place_with_its_digests_recomputed_fails_the_mac(tmp_path: Path) -> None:
    """A weight changed in the file and every digest recomputed: only the MAC can tell, and it does."""
    key = key_from_token("the job's token")
    with using_key(key):
        save_replicated(tmp_path, 5, {"w": torch.zeros(8)}, job_id="j")
        save_replicated(tmp_path, 10, {"w": torch.ones(8)}, job_id="j")
    folder = tmp_path / "step-000000010"
    with using_key(key):
        assert verify(folder) == []
    state, _ = load_replicated(folder, check=False)
    state["w"][3] = 1e6  # one weight, poisoned
    _rewrite_state(folder, state, keep_mac=True)

    with using_key(key):
        (problem,) = verify(folder)
        assert "MAC does not match" in problem
        with pytest.raises(CheckpointError, match="MAC does not match"):
            load_replicated(folder)
        latest = latest_valid(tmp_path)
        assert latest.checkpoint is not None and latest.checkpoint.step == 5
        assert [name for name, _ in latest.skipped] == ["step-000000010"]
    # Another job's token is another key: its MAC does not pass either.
    with using_key(key_from_token("someone else's token")):
        assert "MAC does not match" in verify(tmp_path / "step-000000005")[0]


def test_a_peer_or_replica_payload_that_unpickles_into_code_is_refused(tmp_path: Path) -> None:
    """The bytes a replacement receives from a peer (or a replica's shard) are loaded with weights_only=True."""
    marker = tmp_path / "code-ran"
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "extras": {"x": _RunsCode(marker)}}, buffer)
    with pytest.raises(RecoveryError, match="refuses to unpickle"):
        load_state_bytes(buffer.getvalue(), source="rank 1")
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "extras": {"n": 3}}, plain)
    assert load_state_bytes(plain.getvalue(), source="rank 1")["extras"] == {"n": 3}


_SCRIPT = '''
import torch
import undying


class Counter:  # a plain Python object: weights_only=True will not rebuild it
    def __init__(self) -> None:
        self.n = 0


job = undying.init()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
stats = {"counter": Counter()}
state = undying.State(model=model, optimizer=optimizer, stats=stats)
ddp = job.ddp(model)
for step in job.steps(state, total=5):
    with step:
        loss = ddp(torch.ones(2, 4)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step.log(loss=loss.item())
'''


def test_a_state_that_cannot_be_loaded_safely_fails_at_the_first_save_by_name(tmp_path: Path, reap: list[int]) -> None:
    """A user's state holding an object weights_only refuses: the job fails at step 1 naming the object and the fix,
    instead of at its first recovery."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    job = start_job(tmp_path / "job", [], ranks=RANKS, reap=reap, script=script, run_args=["--spares", "0"])
    rc = job.wait(timeout=120)
    log = (tmp_path / "job.log").read_text()
    assert rc != 0, log[-3000:]
    assert "extras/stats/counter is a __main__.Counter" in log, log[-3000:]
    assert "add_safe_globals" in log and "weights_only=True" in log
    run = load_run(tmp_path / "job" / "events.db")
    assert max(run.losses, default=0) <= 1, "the job went on past its first step"
