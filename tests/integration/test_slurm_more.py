"""More of undying under a real Slurm cluster: an elastic job that loses a node and has no spare.

The cluster is tests/slurm_cluster.py; it skips, with the reason, where the machine cannot run
one (not root, no namespaces, no slurm-wlm/munge). The time limit is emulated in
test_slurm.py with ``scancel --signal=TERM`` (docs/slurm.md says why); a stopped manager and a
stranger's token are unit tests (tests/unit/test_slurm_node.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.oracle import Oracle
from tests.slurm_cluster import SlurmCluster, slurm_unavailable_reason, wait_for
from undying.demo import TRAIN_SCRIPT
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.events import read_job

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(slurm_unavailable_reason() is not None,
                                 reason=str(slurm_unavailable_reason()))]

UNDYING = [sys.executable, "-m", "undying"]
# 64 steps of ~0.1 s on 2 nodes x 1 rank: node 1 is lost at step 10 or a little later.
SCRIPT_ARGS = ["--epochs", "2", "--samples", "1024", "--step-seconds", "0.1"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path / "slurm", nodes=2) as made:
        yield made


def test_an_elastic_job_without_a_spare_node_regroups_on_the_nodes_it_has(
        cluster: SlurmCluster, tmp_path: Path, oracle: Oracle) -> None:
    """`sbatch --no-kill`, `srun undying run --nnodes 1:2` on a 2-node step: the user's range
    wins over the step's node count. Node n1 (its slurmd and every process on it) is lost and
    there is no spare: past --node-wait the job regroups on n0 alone and ends succeeded, every
    loss the one a job saved on 2 ranks at the regroup's step and resumed on 1 logs."""
    work = tmp_path / "work"
    work.mkdir()
    run = " ".join([*UNDYING, "run", "-n", "1", "--nnodes", "1:2", "--node-wait", "3",
                    "--heartbeat-timeout", "3", "--spares", "0", str(TRAIN_SCRIPT), *SCRIPT_ARGS])
    job = cluster.submit(work, f"""#!/bin/bash
#SBATCH -N2 --ntasks-per-node=1 --no-kill -o {work}/slurm-%j.out
srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 {run}
echo srun-exit=$?
""")
    job_dir = work / "undying-jobs" / f"slurm-{job}"
    out = work / f"slurm-{job}.out"
    wait_for("step 10", lambda: SlurmCluster.logged_step(job_dir) >= 10, 120)
    cluster.kill_node(1)
    wait_for("the job's end", lambda: "srun-exit=" in (out.read_text() if out.exists() else ""),
              180)
    text = out.read_text(errors="replace")
    assert "node 0 of 2 (n0), manager on n0 (here)" in text, text[-5000:]
    assert "(a warm standby)" not in text, text[-5000:]
    job_record = read_job(job_dir / "events.db")
    regroups = [i for i in job_record["incidents"] if i["action"] == "regroup"]
    assert regroups and all(i["status"] == "recovered" for i in regroups), (
        job_record["incidents"], text[-5000:])
    assert all(i["detail"]["lost_steps"] == 0 for i in regroups), regroups
    regroup = dict(regroups[0]["detail"]["regroup"])
    assert (regroup["from_world_size"], regroup["world_size"]) == (2, 1), regroup
    assert regroup["nodes"] == [0] and regroup["from_nodes"] == [0, 1], regroup
    assert regroup["checkpoint_kind"] == "regroup", regroup  # the survivors' state
    run_record = load_run(job_dir / "events.db")
    assert run_record.state == "succeeded", (run_record.state, text[-5000:])
    reference = oracle.regrouped(SCRIPT_ARGS, ranks=2, then=1,
                                 at_step=regroup["checkpoint_step"])
    comparison = compare_runs(reference, run_record)
    assert comparison.identical and not run_record.rerun_steps, (comparison.reasons,
                                                                  text[-5000:])
    assert job_record["job"]["world_size"] == 1 and job_record["job"]["nodes"] == [0]
