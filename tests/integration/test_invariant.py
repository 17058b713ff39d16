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
from undying.demo.cluster import Cluster, wait_for
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


# The jobs that shrink and grow: 64 steps of ~0.1 s on up to 2 nodes of 2 ranks.
SHRINK_ARGS = ["--epochs", "1", "--samples", "2048"]
RUN_ARGS = ["--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", "60", *VIRTUAL]


@pytest.fixture(scope="module")
def unchanged(tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    """The elastic tests' reference: their job on 2 ranks of one host, fault-free, never regrouped."""
    return _one_digest(_run(tmp_path_factory.mktemp("invariant") / "unchanged", 2, script_args=SHRINK_ARGS))


def _assert_regroups(cluster: Cluster, unchanged: RunRecord, sizes: list[tuple[int, int]]) -> None:
    """The job regrouped through ``sizes`` (from, to world size), each recovered, and every loss is the unchanged run's."""
    job = read_job(cluster.job_dir / "events.db")
    regroups = [i for i in job["incidents"] if i["action"] == "regroup"]
    assert all(i["status"] == "recovered" for i in regroups), job["incidents"]
    seen: list[tuple[int, int]] = []
    for incident in regroups:  # one incident per lost rank, each naming the one regroup
        size = (incident["detail"]["regroup"]["from_world_size"], incident["detail"]["regroup"]["world_size"])
        if not seen or seen[-1] != size:
            seen.append(size)
    assert seen == sizes, job["incidents"]
    run = load_run(cluster.job_dir / "events.db")
    comparison = compare_runs(unchanged, _one_digest(run))
    assert comparison.identical, (comparison.reasons, cluster.logs())
    assert comparison.steps == 64 and not run.rerun_steps


def test_a_grow_in_invariant_mode_gives_the_losses_of_the_job_that_never_grew(
        make_hosts: Callable[[int], Hosts], tmp_path: Path, unchanged: RunRecord) -> None:  # noqa: F811
    """--nnodes 1:2: node 0 starts alone (2 ranks, 2 virtual ranks each); node 1 joins and the job regroups on
    4 ranks (1 virtual rank each). Every loss equals the unchanged 2-rank run's, bit for bit."""
    hosts = make_hosts(3)
    cluster = Cluster(hosts, tmp_path, "grow", [*SHRINK_ARGS, "--step-seconds", "0.1"], min_nodes=1,
                      run_args=[*RUN_ARGS, "--node-wait", "2"], script=SCRIPT)
    try:
        cluster.start_manager()
        cluster.start_agent(0, 1)
        status = cluster.wait_for_step(8)
        assert status["world_size"] == 2, status
        cluster.start_agent(1, 2)
        assert cluster.wait(150) == 0, cluster.logs()
    finally:
        cluster.close()
    _assert_regroups(cluster, unchanged, [(2, 4)])


def test_a_shrink_then_a_grow_in_invariant_mode_change_no_loss(
        make_hosts: Callable[[int], Hosts], tmp_path: Path, unchanged: RunRecord) -> None:  # noqa: F811
    """4 ranks on 2 nodes; node 1's host is lost (4 -> 2 ranks), then a new host joins as node 1 (2 -> 4):
    every loss equals the unchanged 2-rank run's, bit for bit."""
    hosts = make_hosts(3)
    cluster = Cluster(hosts, tmp_path, "shrinkgrow", [*SHRINK_ARGS, "--step-seconds", "0.1"], min_nodes=1,
                      run_args=[*RUN_ARGS, "--node-wait", "3"], script=SCRIPT)
    try:
        cluster.start()
        cluster.wait_for_step(8)
        hosts.kill_host(2)
        wait_for(lambda: (s := cluster.status())["world_size"] == 2 and s["state"] == "running" and s, 60,
                 "the job to run on 2 ranks")
        cluster.start_agent(1, hosts.add_host())
        assert cluster.wait(150) == 0, cluster.logs()
    finally:
        cluster.close()
    _assert_regroups(cluster, unchanged, [(4, 2), (2, 4)])


def test_a_rank_killed_after_a_shrink_in_invariant_mode_changes_no_loss(
        make_hosts: Callable[[int], Hosts], tmp_path: Path, unchanged: RunRecord) -> None:  # noqa: F811
    """--nnodes 1:2, 4 virtual ranks on 2 nodes of 2 ranks: node 1's host is lost and nobody replaces it; the
    job goes on with 2 ranks (2 virtual ranks each); then rank 1 (now virtual ranks 2 and 3) is SIGKILLed in a
    backward pass and replaced. Every loss equals the fault-free run's on 2 ranks on one host, which never
    changed, bit for bit (the default mode equals only a job saved and resumed on 2). This is also the
    shrink's own test: the shrink alone is the first half of this run, compared step by step."""
    hosts = make_hosts(3)
    cluster = Cluster(hosts, tmp_path, "shrinkcrash", [*SHRINK_ARGS, "--step-seconds", "0.1"], min_nodes=1,
                      run_args=[*RUN_ARGS, "--node-wait", "3"], script=SCRIPT)
    try:
        cluster.start()
        cluster.wait_for_step(8)
        hosts.kill_host(2)
        status = wait_for(lambda: (s := cluster.status())["world_size"] == 2 and s["state"] == "running" and s, 60,
                          "the job to run on 2 ranks")
        cluster.inject({"kind": "crash", "rank": 1, "phase": "backward", "at_step": status["step"] + 3})
        assert cluster.wait(150) == 0, cluster.logs()
    finally:
        cluster.close()
    _assert_regroups(cluster, unchanged, [(4, 2)])
    crashes = [i for i in read_job(cluster.job_dir / "events.db")["incidents"] if i["kind"] == "crash"]
    assert [(i["rank"], i["status"]) for i in crashes] == [(1, "recovered")], crashes
