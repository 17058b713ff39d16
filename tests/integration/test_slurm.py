"""undying under a real Slurm cluster (slurmctld + one slurmd per node, each node a network
namespace): `srun undying run` with no other flag, and what is refused.

The cluster is tests/slurm_cluster.py; it skips, with the reason, where the machine cannot run
one (not root, no namespaces, no slurm-wlm/munge).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.oracle import Oracle
from tests.slurm_cluster import SlurmCluster, slurm_unavailable_reason
from undying.demo import TRAIN_SCRIPT
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.events import read_job

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(slurm_unavailable_reason() is not None,
                                 reason=str(slurm_unavailable_reason()))]

# 64 steps of ~0.1 s on 2 nodes x 2 ranks: a crash at step 12 lands mid-run.
SCRIPT_ARGS = ["--epochs", "2", "--samples", "1024", "--step-seconds", "0.1"]
UNDYING = [sys.executable, "-m", "undying"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    made = SlurmCluster(tmp_path / "slurm", nodes=2)
    try:
        yield made
    finally:
        made.close()


def _env(cluster: SlurmCluster) -> dict[str, str]:
    """The test session's env without its shared token: the job makes and shares its own."""
    env = cluster.env()
    env.pop("UNDYING_TOKEN", None)
    return env


def _wait_for(what: str, condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.2)
    raise TimeoutError(f"no {what} after {timeout}s")


def test_srun_undying_run_needs_no_other_flag_and_survives_a_rank_crash(
        cluster: SlurmCluster, tmp_path: Path, oracle: Oracle) -> None:
    work = tmp_path / "work"
    work.mkdir()
    srun = cluster.popen(
        ["srun", "-N2", "--ntasks-per-node=1", *UNDYING, "run", "-n", "2", str(TRAIN_SCRIPT),
         *SCRIPT_ARGS], cwd=work, env=_env(cluster),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        job_dir = work / "undying-jobs" / "slurm-1"
        _wait_for("job dir", lambda: (job_dir / "token").exists(), 60)
        inject = cluster.run([*UNDYING, "inject", "crash", "--rank", "3", "--at-step", "12",
                              "--job-dir", str(job_dir)], check=False, cwd=work, env=_env(cluster))
        assert inject.returncode == 0, inject.stdout + inject.stderr
        out, _ = srun.communicate(timeout=240)
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait(10)
    text = out.decode(errors="replace")
    assert srun.returncode == 0, text[-4000:]
    # What the launchers read from Slurm, in their first lines.
    assert "Slurm job 1, node 0 of 2 (n0), manager on n0 (here)" in text, text[-4000:]
    assert "Slurm job 1, node 1 of 2 (n1), manager on n0;" in text, text[-4000:]
    # The job dir is the documented default, private to the user.
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    baseline = oracle.baseline(SCRIPT_ARGS, ranks=4)
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(baseline, run)
    assert comparison.identical, (comparison.reasons, text[-4000:])
    assert comparison.lost_steps == 0 and not run.rerun_steps
    job = read_job(job_dir / "events.db")
    crashed = [i for i in job["incidents"] if i.get("kind") == "crash"]
    assert [i["rank"] for i in crashed] == [3], json.dumps(job["incidents"])[:2000]


def _batch(cluster: SlurmCluster, folder: Path, body: str, *, nodes: int = 1) -> str:
    """Submit ``body`` as a batch script, wait for its end, return its output."""
    script = folder / "job.sh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    out = folder / "job.out"
    r = cluster.run(["sbatch", "--parsable", "-N", str(nodes), "--ntasks-per-node=2", "-o",
                     str(out), str(script)],
                    cwd=folder, env=_env(cluster))
    job = r.stdout.strip().split(";")[0]
    _wait_for(f"end of batch job {job}", lambda: cluster.squeue(job) == "" and out.exists(), 90)
    return out.read_text(errors="replace")


def test_outside_a_step_or_with_several_tasks_a_node_it_is_refused_saying_what_to_write(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    run = f"{' '.join(UNDYING)} run -n 1 {TRAIN_SCRIPT} --epochs 1 --samples 64"
    text = _batch(cluster, tmp_path, f"{run}; echo exit=$?\n"
                  f"srun -N1 --ntasks-per-node=2 {run}; echo exit=$?")
    lines = text.splitlines()
    shell = [line for line in lines if "not in an srun step" in line]
    assert shell and "srun --ntasks-per-node=1 undying run" in shell[0], text
    assert "--standalone" in shell[0], text
    tasks = [line for line in lines if "tasks on a node" in line]
    assert tasks and "-n RANKS_PER_NODE" in tasks[0], text
    assert lines.count("exit=2") == 2, text
    assert not (tmp_path / "undying-jobs").exists(), os.listdir(tmp_path)
