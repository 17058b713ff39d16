"""Invariant mode (--virtual-ranks): the same seeded job gives the same losses, bit for bit, on any number of ranks.

The job (``undying/demo/invariant_train.py``) is defined by 4 virtual ranks,
each with its own slice of the data and its own dropout masks. Run on 1, 2, 3
(which does not divide 4) and 4 physical ranks, every step's loss (the mean
over the virtual ranks) and the final model and optimizer state are the same.
Then a rank is SIGKILLed and replaced, and a host is lost and the job shrinks
onto the survivors: the losses are still those of the run that never changed.
Without the fixed-order reduction the 1-rank and 2-rank runs differ in their
last bits from the first step on (the unit test of ``fold`` shows the order
matters for these sums), so these comparisons can fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.netns import Hosts, make_hosts  # noqa: F401 - the fixture
from tests.oracle import crash
from undying.cli.demo import FaultPlan, run_job
from undying.demo.cluster import Cluster
from undying.demo.oracle import RunRecord, compare_runs, load_run
from undying.manager.events import read_job

SCRIPT = Path(__file__).resolve().parents[2] / "src" / "undying" / "demo" / "invariant_train.py"
VIRTUAL = ["--virtual-ranks", "4"]
# 256 samples over 4 virtual ranks in batches of 8: 8 steps.
SCRIPT_ARGS = ["--epochs", "1", "--samples", "256"]


def _run(job_dir: Path, ranks: int, faults: list[FaultPlan] | None = None,
         script_args: list[str] = SCRIPT_ARGS) -> RunRecord:
    rc = run_job(job_dir, script_args, ranks=ranks, faults=faults or [], timeout_s=180, script=SCRIPT,
                 extra_run_args=["--spares", "0", *VIRTUAL])
    log = (job_dir.parent / f"{job_dir.name}.log").read_text(errors="replace")[-3000:]
    assert rc == 0, f"the run on {ranks} ranks exited {rc}\n{log}"
    return load_run(job_dir / "events.db")


def _one_digest(run: RunRecord) -> RunRecord:
    """The run with its ranks' final-state fingerprints as one (they must agree), to compare across rank counts."""
    assert len(set(run.digests.values())) == 1, run.digests
    return dataclasses.replace(run, digests={0: next(iter(run.digests.values()))})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    """The fault-free run on 2 physical ranks."""
    return _run(tmp_path_factory.mktemp("invariant") / "ranks-2", 2)


@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_the_losses_do_not_depend_on_the_number_of_ranks(reference: RunRecord, ranks: int, tmp_path: Path) -> None:
    run = _run(tmp_path / f"ranks-{ranks}", ranks)
    comparison = compare_runs(_one_digest(reference), _one_digest(run))
    assert comparison.identical, comparison.reasons
    assert comparison.steps == 8 and sorted(run.losses) == list(range(1, 9))


def test_a_killed_rank_replaced_in_invariant_mode_changes_nothing(reference: RunRecord, tmp_path: Path) -> None:
    """Rank 1 (virtual ranks 2 and 3) is SIGKILLed in step 4's backward and replaced: the losses are the fault-free run's."""
    run = _run(tmp_path / "crash", 2, [crash(rank=1, at_step=4, phase="backward")])
    comparison = compare_runs(reference, run)
    assert comparison.identical, comparison.reasons
    assert comparison.lost_steps == 0
    incidents = [i for i in run.incidents if i["kind"] == "crash"]
    assert incidents and incidents[0]["rank"] == 1 and incidents[0]["status"] == "recovered", run.incidents


# The job that shrinks: 32 steps of ~0.1 s on 2 nodes of 2 ranks; node 1's host dies at step 10.
SHRINK_ARGS = ["--epochs", "1", "--samples", "1024"]
RUN_ARGS = ["--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", "60", *VIRTUAL]


def test_a_shrink_in_invariant_mode_gives_the_losses_of_the_job_that_never_shrank(
        make_hosts: Callable[[int], Hosts], tmp_path: Path) -> None:  # noqa: F811
    """--nnodes 1:2, 4 virtual ranks on 2 nodes of 2 ranks: node 1's host is lost and nobody replaces it; the
    job goes on with 2 ranks (2 virtual ranks each). Every loss equals the fault-free run's on 2 ranks on one
    host, which never changed, bit for bit (the default mode would equal only a job saved and resumed on 2)."""
    reference = _run(tmp_path / "unchanged", 2, script_args=SHRINK_ARGS)
    hosts = make_hosts(3)
    cluster = Cluster(hosts, tmp_path, "shrink", [*SHRINK_ARGS, "--step-seconds", "0.1"], min_nodes=1,
                      run_args=[*RUN_ARGS, "--node-wait", "3"], script=SCRIPT)
    try:
        cluster.start()
        cluster.wait_for_step(10)
        hosts.kill_host(2)
        assert cluster.wait(150) == 0, cluster.logs()
    finally:
        cluster.close()
    job = read_job(cluster.job_dir / "events.db")
    regroups = [i for i in job["incidents"] if i["action"] == "regroup"]
    assert regroups and all(i["status"] == "recovered" for i in regroups), job["incidents"]
    detail = regroups[0]["detail"]["regroup"]
    assert (detail["from_world_size"], detail["world_size"]) == (4, 2), detail
    assert job["job"]["world_size"] == 2
    run = load_run(cluster.job_dir / "events.db")
    comparison = compare_runs(_one_digest(reference), _one_digest(run))
    assert comparison.identical, (comparison.reasons, cluster.logs())
    assert not run.rerun_steps
