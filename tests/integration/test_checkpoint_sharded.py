"""A sharded checkpoint saved by 4 real processes loads on 2 with identical tensors (resharding).

The model is sharded with FSDP2 ``fully_shard`` (it runs on CPU with gloo in
this torch), so every parameter is a DTensor whose rows are split across the
ranks: 4-way at save, 2-way at load. DCP's ``.metadata`` maps the saved 4-way
chunks onto the 2-way slices each loading rank owns.

Every rank is its own ``python -c`` process (start_new_session) with a bounded
wait; on any failure or timeout the processes are killed by PID.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from undying.checkpoint import MANIFEST_NAME, latest_valid, verify

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0


def build_model(world: int, seed: int) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(mode: str, root: str, out: str) -> None:
    """One rank: save (4 ranks, trained one step) or load (2 ranks, different init) and report."""
    import torch
    import torch.distributed as dist

    from undying.checkpoint import latest_valid_shared, load_sharded, save_sharded

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    model = build_model(world, seed=0 if mode == "save" else 1234)
    report: dict[str, object] = {"rank": rank, "world": world}
    if mode == "save":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(3, 8)).sum().backward()
        opt.step()
        sd = {"model": model.state_dict(), "extra": torch.arange(5.0), "step": 7}
        report["local_shapes"] = {k: list(v.to_local().shape) for k, v in sd["model"].items()}
        result = save_sharded(root, 7, sd, job_id="resharding", generation=1, kind="periodic", digest="d")
        report["path"], report["bytes"] = result.path, result.bytes
        full = {k: v.full_tensor() for k, v in sd["model"].items()}
        if rank == 0:
            torch.save({"model": full, "extra": sd["extra"]}, os.path.join(out, "reference.pt"))
    else:
        found = latest_valid_shared(root, job_id="resharding")
        assert found.checkpoint is not None, found.skipped
        sd = {"model": model.state_dict(), "extra": torch.zeros(5), "step": 0}
        manifest = load_sharded(found.checkpoint, sd)
        report["manifest_world_size"] = manifest.world_size
        report["step"] = sd["step"]
        report["local_shapes"] = {k: list(v.to_local().shape) for k, v in sd["model"].items()}
        full = {k: v.full_tensor() for k, v in sd["model"].items()}
        ref = torch.load(os.path.join(out, "reference.pt"))
        report["identical"] = all(torch.equal(full[k], ref["model"][k]) for k in ref["model"]) and torch.equal(
            sd["extra"], ref["extra"]
        )
    with open(os.path.join(out, f"{mode}-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(mode: str, world: int, root: Path, out: Path) -> list[dict[str, object]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    code = f"from tests.integration.test_checkpoint_sharded import worker; worker({mode!r}, {str(root)!r}, {str(out)!r})"
    procs = []
    try:
        for rank in range(world):
            log = open(out / f"{mode}-{rank}.log", "wb")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(rank)}, cwd=REPO,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
        deadline = time.monotonic() + DEADLINE_S
        for proc, _ in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            log.close()
    for rank, (proc, _) in enumerate(procs):
        if proc.returncode != 0:
            pytest.fail(f"{mode} rank {rank} exited {proc.returncode}:\n{(out / f'{mode}-{rank}.log').read_text()[-3000:]}")
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(world)]


def test_save_on_4_ranks_load_on_2(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    saved = run_ranks("save", 4, root, out)
    assert {r["path"] for r in saved} == {str(root / "step-000000007")}  # every rank got the outcome
    assert saved[0]["local_shapes"] == {"0.weight": [3, 8], "0.bias": [3], "2.weight": [1, 12], "2.bias": [1]}

    found, skipped = latest_valid(root)
    assert found is not None and found.manifest is not None and skipped == []
    m = found.manifest
    assert (m.step, m.world_size, m.job_id, m.generation, m.digest) == (7, 4, "resharding", 1, "d")
    assert m.layout == {"kind": "sharded", "planner": "dcp"}
    names = sorted(f.path for f in m.files)
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert sorted(os.listdir(found.path)) == sorted([*names, MANIFEST_NAME])
    assert [n for n in os.listdir(root) if n.startswith(".tmp")] == []
    assert verify(found.path) == []

    loaded = run_ranks("load", 2, root, out)
    assert all(r["identical"] for r in loaded), loaded
    assert all(r["manifest_world_size"] == 4 and r["step"] == 7 for r in loaded)
    assert loaded[0]["local_shapes"] == {"0.weight": [6, 8], "0.bias": [6], "2.weight": [2, 12], "2.bias": [2]}
