"""Sharded state: checkpoints that reshard, and ring replicas that make a lost rank cost no disk.

The storage layer first: a sharded checkpoint saved by 4 real processes loads
on 2 with identical tensors. The model is sharded with FSDP2 ``fully_shard``
(it runs on CPU with gloo in this torch), so every parameter is a DTensor
whose rows are split across the ranks: 4-way at save, 2-way at load. DCP's
``.metadata`` maps the saved 4-way chunks onto the 2-way slices each loading
rank owns. Every rank is its own ``python -c`` process (start_new_session)
with a bounded wait; on any failure or timeout the processes are killed by PID.

Then whole jobs under ``undying run`` (examples/undying_fsdp.py and the demo's
DDP script): preempted on 4 ranks and resumed on 2, the state loaded proven
equal to the checkpoint by a digest of the full, gathered tensors; a rank
SIGKILLed under ``--replicate ring`` (env ``UNDYING_REPLICATE=ring``), whose
losses must equal the fault-free run's bit for bit (the oracle); and the same
loss without a replica in memory, which rolls back to a checkpoint and counts
the steps it re-runs.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from undying.checkpoint import latest_valid, verify
from undying.checkpoint.manifest import MANIFEST_NAME

if TYPE_CHECKING:  # (not imported at run time: the forked ranks import this module)
    from tests.oracle import Oracle

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


# The ranks of one phase: one process imports torch and this module, then forks each rank (as
# undying's zygote forks its workers: no thread has started, so a fork is safe), each with its own
# log and RANK. One import of torch (and of torch._dynamo, which FSDP's hooks import) a phase
# instead of one a rank: this test's processes took 16.8 s of CPU, now 9.3.
_FORKED_RANKS = """
import json, os, sys, traceback
mode, root, out, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import torch, torch.distributed, torch.distributed.checkpoint, torch.distributed.fsdp
import torch.distributed.device_mesh, torch.distributed.tensor, torch._dynamo  # (FSDP's hooks import it)
import undying.checkpoint
from tests.integration.test_checkpoint_sharded import worker
from undying.worker.boot import end_process
ranks = {}
for rank in range(world):
    pid = os.fork()
    if pid == 0:
        log = os.open(os.path.join(out, f"{mode}-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ["RANK"] = str(rank)
        try:
            worker(mode, root, out)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        # Ended as an undying worker ends (undying.worker.boot.end_process), not by the interpreter's
        # teardown: gloo's threads, torn down there, aborted a save rank ("terminate called without an
        # active exception").
        end_process()
    ranks[pid] = rank
codes = {}
while len(codes) < world:
    pid, status = os.wait()
    codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
print(json.dumps(codes))
"""


def run_ranks(mode: str, world: int, root: Path, out: Path) -> list[dict[str, object]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _FORKED_RANKS, mode, str(root), str(out), str(world)], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the forked ranks are in its process group
    if timed_out:
        proc.communicate(timeout=10)
        pytest.fail(f"{mode}: the ranks did not end within {DEADLINE_S:.0f} s")
    assert proc.returncode == 0, f"{mode}: the ranks' parent exited {proc.returncode}:\n{stderr[-3000:]}"
    codes = {int(rank): code for rank, code in json.loads(stdout.splitlines()[-1]).items()}
    for rank in range(world):
        if codes[rank] != 0:
            pytest.fail(f"{mode} rank {rank} exited {codes[rank]}:\n{(out / f'{mode}-{rank}.log').read_text()[-3000:]}")
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


# --- whole jobs under `undying run` ------------------------------------------------

FSDP_SCRIPT = REPO / "examples" / "undying_fsdp.py"
# 512 samples, batch 16: 8 steps an epoch on 4 ranks, 16 on 2.
FSDP_ARGS = ["--samples", "512", "--epochs", "2"]
DDP_ARGS = ["--samples", "512", "--epochs", "1"]
RUN_ARGS = ["--spares", "0"]
JOB_TIMEOUT_S = 120.0


@pytest.fixture(autouse=True)
def _job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher's manager and the harness's API calls share the job's token through the environment.
    monkeypatch.setenv("UNDYING_TOKEN", "sharded-state-test-token")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("UNDYING_REPLICATE", raising=False)
    monkeypatch.delenv("UNDYING_REPLICATE_EVERY", raising=False)


def events(job_dir: Path, kind: str) -> list[dict[str, Any]]:
    from undying.jobfiles.events import connect_readonly

    db = connect_readonly(job_dir / "events.db")
    try:
        return [{"rank": rank, **json.loads(data)} for rank, data in db.execute(
            "SELECT rank, data FROM events WHERE kind = ? ORDER BY id", (kind,))]
    finally:
        db.close()


def committed_steps(job_dir: Path) -> dict[int, list[int]]:
    from undying.jobfiles.events import read_job

    steps: dict[int, list[int]] = {}
    for commit in read_job(job_dir / "events.db")["steps"]:
        steps.setdefault(commit["rank"], []).append(commit["step"])
    return {rank: sorted(s) for rank, s in steps.items()}


def newest_step(job_dir: Path) -> int:
    from undying.jobfiles.events import LogReader

    try:
        reader = LogReader(job_dir / "events.db")
    except Exception:  # not created yet
        return 0
    try:
        return reader.newest_step()
    except LogReader.Error:
        return 0
    finally:
        reader.close()


def checkpoint_committed(job_dir: Path, step: int | None) -> bool:
    """The checkpoint of ``step`` is visible: its manifest, written last, is in place (None: no wait)."""
    from undying.checkpoint.manifest import MANIFEST_NAME

    return step is None or (job_dir / "checkpoints" / f"step-{step:09d}" / MANIFEST_NAME).exists()


def run(job_dir: Path, script: Path, args: list[str], ranks: int, run_args: list[str] | None = None,
        crash: tuple[int, int, str] | None = None, arm_after_checkpoint: int | None = None) -> None:
    """``undying run`` to its end; ``crash`` (rank, step, phase) is armed once the job commits a step.

    Arming waits for a commit because an agent drops a fault armed before the rank's process exists;
    with ``arm_after_checkpoint``, also for that step's checkpoint to be committed (a periodic one is
    written in the background, and a crash while it is written loses it, by design).
    """
    from undying.cli.client import api_post
    from undying.jobfiles.jobdir import JobDir

    argv = [sys.executable, "-m", "undying", "run", "-n", str(ranks), "--port", "0", "--job-dir", str(job_dir),
            "--job-id", job_dir.name, "--stop-grace", "3", *RUN_ARGS, *(run_args or []), str(script), *args]
    log_path = job_dir.parent / f"{job_dir.name}.log"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if crash is not None:
                rank, step, phase = crash
                while newest_step(job_dir) < 1 or not checkpoint_committed(job_dir, arm_after_checkpoint):
                    assert process.poll() is None, f"the job exited ({process.returncode}) before its first step"
                    assert time.monotonic() < deadline, "the job committed no step (or checkpoint) in time"
                    time.sleep(0.05)
                info = JobDir(job_dir).read_manager()
                assert info is not None
                api_post(info["url"], "/api/inject", {"kind": "crash", "rank": rank, "at_step": step, "phase": phase})
                assert newest_step(job_dir) < step, "the job passed the fault's step before it was armed"
            rc = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
    assert rc == 0, f"undying run exited {rc}:\n{log_path.read_text(errors='replace')[-3000:]}"


def preempt(job_dir: Path, script: Path, args: list[str], ranks: int, at_step: int) -> None:
    """Run until ``at_step``, SIGTERM the launcher: the dying gasp, exit 75."""
    from undying.cli.demo import run_preempted
    from undying.config import EXIT_PREEMPTED

    rc, _ = run_preempted(job_dir, [*args, "--step-seconds", "0.15"], at_step=at_step, ranks=ranks,
                          timeout_s=JOB_TIMEOUT_S, extra_run_args=[*RUN_ARGS, "--save-every", "4"], script=script)
    log = (job_dir.parent / f"{job_dir.name}.preempted.log").read_text(errors="replace")[-3000:]
    assert rc == EXIT_PREEMPTED, f"the preempted run exited {rc}:\n{log}"


def checkpoint_digest(path: str, tmp_path: Path) -> str:
    """The digest of every tensor a checkpoint holds, read back whole in this process (no job)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from undying.checkpoint import load_replicated
    from undying.worker.sharding import full_digest

    if (Path(path) / ".metadata").exists():
        whole = tmp_path / "whole.pt"
        dcp_to_torch_save(path, whole)
        return full_digest(torch.load(whole, weights_only=False))
    payload, _ = load_replicated(path, weights_only=False)
    return full_digest(payload)


@pytest.mark.parametrize(("script", "args", "layout"), [(FSDP_SCRIPT, FSDP_ARGS, "sharded"),
                                                        (None, DDP_ARGS, "replicated")], ids=["fsdp", "ddp"])
def test_a_job_preempted_on_4_ranks_resumes_on_2_with_the_state_it_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: Path | None, args: list[str], layout: str
) -> None:
    from undying.checkpoint import latest_valid
    from undying.demo import TRAIN_SCRIPT

    script = script or TRAIN_SCRIPT
    job_dir = tmp_path / "job"
    preempt(job_dir, script, args, 4, at_step=5)
    found, _ = latest_valid(job_dir / "checkpoints")
    assert found is not None and found.manifest is not None
    saved = found.manifest
    assert (saved.kind, saved.world_size, saved.layout["kind"]) == ("dying-gasp", 4, layout)
    assert 5 <= saved.step < 8  # mid-epoch: the data position has to be mapped, not just reset
    assert saved.meta["data"] == {"position": saved.step, "steps_per_epoch": 8, "world_size": 4}
    if layout == "sharded":
        assert sorted(f.path for f in saved.files) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    expected_digest = checkpoint_digest(found.path, tmp_path)

    monkeypatch.setenv("UNDYING_RESUME_DIGEST", "1")
    run(job_dir, script, args, 2, ["--save-every", "4"])
    restored = [e for e in events(job_dir, "state_restored") if e.get("checkpoint") == found.url]
    assert sorted(e["rank"] for e in restored) == [0, 1]
    for e in restored:
        assert e["step"] == saved.step and e["saved_world_size"] == 4
        assert e["digest"] == expected_digest, "the state loaded on 2 ranks is not the state saved on 4"
        # 4 ranks read `step` batches of 8 an epoch; 2 ranks cover as many samples in twice the batches.
        assert e["data_position"] == {"saved": saved.step, "saved_steps_per_epoch": 8, "now": 2 * saved.step,
                                      "steps_per_epoch": 16}
    epochs = 2 if layout == "sharded" else 1
    remaining = epochs * 16 - 2 * saved.step  # the rest of the data, in batches of the 2-rank job
    assert committed_steps(job_dir) == {r: list(range(saved.step + 1, saved.step + remaining + 1)) for r in (0, 1)}
    from undying.jobfiles.events import read_job

    assert read_job(job_dir / "events.db")["job"]["state"] == "succeeded"


# --- a lost rank's shard ---------------------------------------------------------

@pytest.fixture
def fsdp_baseline(oracle: Oracle) -> Any:
    """The FSDP job on 4 ranks without a fault, without replication: what every faulted run must equal.

    Once per session (a module-scoped fixture ran once per pytest-xdist worker: up to 4 times)."""
    from undying.demo.oracle import load_run

    def make(folder: Path) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("UNDYING_TOKEN", "sharded-state-test-token")
            mp.setenv("OMP_NUM_THREADS", "1")
            mp.delenv("UNDYING_REPLICATE", raising=False)
            run(folder / "job", FSDP_SCRIPT, FSDP_ARGS, 4)

    folder = oracle.shared("fsdp-baseline", (str(FSDP_SCRIPT), tuple(FSDP_ARGS)), make)
    return load_run(folder / "job" / "events.db")


@pytest.mark.parametrize(("rank", "step", "phase", "torn"), [
    # The peers fail in the step's reduce-scatter: their live state is still the committed step's.
    (2, 6, "backward", {False}),
    # After the last collective of the step: a survivor that finished its body fails replicating it,
    # so nobody commits it; it rolls back to its own snapshot and re-runs the step with the replacement.
    # A survivor may instead leave before its body ends (CI saw all three do so once): a loaded one
    # still in the reduce-scatter when the manager says the killed rank is gone leaves at once (the
    # step cannot commit without it), or the killed rank's last send to it died with it.
    (1, 9, "optimizer", {True, False}),
], ids=["backward", "optimizer"])
def test_ring_replica_restores_a_killed_rank_with_identical_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsdp_baseline: Any, rank: int, step: int, phase: str,
    torn: set[bool],
) -> None:
    from undying.demo.oracle import compare_runs, load_run

    monkeypatch.setenv("UNDYING_REPLICATE", "ring")
    job_dir = tmp_path / "job"
    # A survivor left in a collective gloo never ends (a send to the dead rank it never wakes) that holds
    # its shard's only copy is kept until gloo's own timeout ends that collective: 20 s here, not 600.
    run(job_dir, FSDP_SCRIPT, FSDP_ARGS, 4, run_args=["--collective-timeout", "20"], crash=(rank, step, phase))
    outcome = load_run(job_dir / "events.db")
    comparison = compare_runs(fsdp_baseline, outcome)
    assert comparison.identical, comparison.reasons
    (incident,) = outcome.incidents
    assert (incident["rank"], incident["action"]) == (rank, "replace")
    restored = events(job_dir, "shards_restored")
    # Each survivor restores its shard from where its own report says it is: its live state, or its
    # snapshot of the committed step when its state was past it (`torn`). A survivor stuck past the
    # recovery's bound (a send queued to the dead peer, on a loaded machine) is replaced in the same
    # incident (`left_behind`): its process is new, so its shard comes from its replica like the
    # killed rank's.
    reported: dict[int, bool] = {}
    for failure in events(job_dir, "comm_failure"):
        reported.setdefault(failure["rank"], failure["torn"])
    left = {e["rank"] for e in events(job_dir, "left_behind")}
    assert set(reported.values()) <= torn, reported
    expected = {r: "replica" if r in left | {rank} else "own" if reported[r] else "live" for r in range(4)}
    assert {e["rank"]: e["source"] for e in restored} == expected, (
        restored, reported, events(job_dir, "left_behind"), events(job_dir, "decided"))
    assert {e["step"] for e in restored} == {step - 1} and {e["lost_steps"] for e in restored} == {0}
    replica_holder = (rank + 1) % 4  # one node: the next rank holds the replica
    assert [e["holder"] for e in restored if e["rank"] == rank] == [replica_holder]
    assert events(job_dir, "rolled_back") == [], "nothing was read from disk"
    assert not (job_dir / "checkpoints").exists() or not list((job_dir / "checkpoints").iterdir())


@pytest.mark.parametrize(("env", "run_args", "fault_step", "restored_at"), [
    # No replica: the lost shard exists only in the checkpoint of step 4. Its write runs in the background
    # while steps 5-7 run: --step-seconds gives it 0.3 s a step (in CI, under load, three 0.1 s steps were
    # once not enough), and the crash is armed only once it is committed.
    ({}, ["--save-every", "4"], 8, 4),
    # Replicated every 3 steps: the copies are of step 6, the survivors at 7.
    ({"UNDYING_REPLICATE": "ring", "UNDYING_REPLICATE_EVERY": "3"}, [], 8, 6),
], ids=["no-replica-checkpoint", "lagging-replica"])
def test_a_shard_with_no_current_copy_rolls_every_rank_back_and_counts_the_lost_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsdp_baseline: Any, env: dict[str, str],
    run_args: list[str], fault_step: int, restored_at: int,
) -> None:
    from undying.demo.oracle import compare_runs, load_run

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job_dir = tmp_path / "job"
    args = FSDP_ARGS if env else [*FSDP_ARGS, "--step-seconds", "0.3"]
    run(job_dir, FSDP_SCRIPT, args, 4, run_args, crash=(2, fault_step, "backward"),
        arm_after_checkpoint=None if env else restored_at)
    outcome = load_run(job_dir / "events.db")
    comparison = compare_runs(fsdp_baseline, outcome)
    lost = list(range(restored_at + 1, fault_step))
    # Not a silent difference: every loss and the final state equal the fault-free run's, and the
    # steps done twice are exactly the ones between the copy restored and the fault.
    assert outcome.rerun_steps == lost
    assert comparison.reasons == [f"completed steps were re-run: {lost}"]
    if env:
        moved = events(job_dir, "shards_restored")
        assert {(e["step"], e["lost_steps"]) for e in moved} == {(restored_at, len(lost))}
        assert events(job_dir, "rolled_back") == []
    else:
        rolled = events(job_dir, "rolled_back")
        assert sorted(e["rank"] for e in rolled) == [0, 1, 2, 3]
        assert {(e["step"], e["lost_steps"]) for e in rolled} == {(restored_at, len(lost))}
        assert {Path(e["checkpoint"]).name for e in rolled} == {f"step-{restored_at:09d}"}
