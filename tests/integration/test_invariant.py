"""Invariant mode (--virtual-ranks): the same seeded job gives the same losses, bit for bit, on any number of ranks.

The job (``undying/demo/invariant_train.py``) is defined by 4 virtual ranks,
each with its own slice of the data and its own dropout masks. Run on 1, 2, 3
(which does not divide 4) and 4 physical ranks, every step's loss (the mean
over the virtual ranks) and the final model and optimizer state are the same.
Then ranks are SIGKILLed and replaced, hosts are lost (the job shrinks onto
the survivors) and join (it grows), and ranks are SIGKILLed in the middle of
those regroups: the losses are still those of the run that never changed, and
no step completes twice. Without the fixed-order reduction the 1-rank and
2-rank runs differ in their last bits from the first step on (the unit test of
``fold`` shows the order matters for these sums), so these comparisons can fail.

The suite's time is tight, so each run checks all it can: the 3-rank run is
also the one a rank is killed in; the shrink's run also has a rank killed
during its regroup and another one after it; the grow's run has a rank killed
during its regroup; the clean shrink then grow is ``undying demo --fault
shrink`` itself. The fault-free references are the oracle's, made once and
shared by the pytest-xdist workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Hosts, make_hosts, our_namespaces, requires_netns  # noqa: F401 - the fixture
from tests.oracle import Oracle, crash
from undying.cli.demo import FaultPlan, run_job
from undying.demo.cluster import Cluster, wait_for
from undying.demo.oracle import RunRecord, compare_runs, load_run
from undying.jobfiles.events import LogReader, read_job

SCRIPT = Path(__file__).resolve().parents[2] / "src" / "undying" / "demo" / "invariant_train.py"
VIRTUAL = ["--virtual-ranks", "4"]
# 256 samples over 4 virtual ranks in batches of 8: 8 steps (a step costs ~0.2 s of a loaded machine's
# time on 1 rank, which runs all 4 virtual ranks: 8 steps are what these runs need).
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


@pytest.fixture
def reference(oracle: Oracle) -> RunRecord:
    """The fault-free run on 2 physical ranks (made once per session, shared by the xdist workers)."""
    return _one_digest(oracle.baseline(SCRIPT_ARGS, 2, script=SCRIPT, run_args=VIRTUAL))


@pytest.mark.parametrize("ranks", [1, 4])
def test_the_losses_do_not_depend_on_the_number_of_ranks(reference: RunRecord, ranks: int, tmp_path: Path) -> None:
    run = _run(tmp_path / f"ranks-{ranks}", ranks)
    comparison = compare_runs(reference, _one_digest(run))
    assert comparison.identical, comparison.reasons
    assert comparison.steps == 8 and sorted(run.losses) == list(range(1, 9))


def test_on_3_ranks_and_with_a_rank_killed_and_replaced_the_losses_are_the_same(
        reference: RunRecord, tmp_path: Path) -> None:
    """3 ranks, which do not divide 4 virtual ranks (0 1 | 2 | 3), and rank 1 (virtual rank 2) is SIGKILLed in
    step 4's backward and replaced: every loss and the final state are the fault-free 2-rank run's."""
    run = _run(tmp_path / "ranks-3-crash", 3, [crash(rank=1, at_step=4, phase="backward")])
    comparison = compare_runs(reference, _one_digest(run))
    assert comparison.identical, comparison.reasons
    assert comparison.steps == 8 and sorted(run.losses) == list(range(1, 9))
    assert comparison.lost_steps == 0 and not run.rerun_steps
    incidents = [i for i in run.incidents if i["kind"] == "crash"]
    assert incidents and incidents[0]["rank"] == 1 and incidents[0]["status"] == "recovered", run.incidents


# The jobs that shrink and grow: 64 steps of at least 0.1 s (time for a change to land mid-run) on up to
# 2 nodes of 2 ranks. Their reference runs at full speed (the oracle drops --step-seconds: same losses).
SHRINK_ARGS = ["--epochs", "1", "--samples", "2048", "--step-seconds", "0.1"]
STEPS = 64
RUN_ARGS = ["--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", "60", *VIRTUAL]


@pytest.fixture
def unchanged(oracle: Oracle) -> RunRecord:
    """The elastic tests' reference: their job on 2 ranks of one host, fault-free, never regrouped."""
    return _one_digest(oracle.baseline(SHRINK_ARGS, 2, script=SCRIPT, run_args=VIRTUAL))


def _assert_regroups(job_dir: Path, unchanged: RunRecord, sizes: list[tuple[int, int]],
                     logs: Callable[[], str] = str) -> dict[str, Any]:
    """The job regrouped through ``sizes`` (from, to world size), each recovered, every loss is the unchanged run's
    and no step completed twice. Returns the job's record."""
    job = read_job(job_dir / "events.db")
    regroups = [i for i in job["incidents"] if i["action"] == "regroup"]
    assert all(i["status"] == "recovered" for i in regroups), job["incidents"]
    seen: list[tuple[int, int]] = []
    for incident in regroups:  # one incident per lost rank (or fault during it), each naming the one regroup
        size = (incident["detail"]["regroup"]["from_world_size"], incident["detail"]["regroup"]["world_size"])
        if not seen or seen[-1] != size:
            seen.append(size)
    assert seen == sizes, job["incidents"]
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(unchanged, _one_digest(run))
    assert comparison.identical, (comparison.reasons, logs())
    assert comparison.steps == STEPS and not run.rerun_steps
    return job


def _fired(job_dir: Path) -> list[tuple[int, str]]:
    """The injected faults that went off, as (rank, phase), in order."""
    with LogReader(job_dir / "events.db") as reader:
        return [(int(e.rank or 0), str(e.data["phase"])) for e in reader.events("fault_injected")]


def _crashes(job: dict[str, Any]) -> list[tuple[int, str, bool]]:
    """The job's crash incidents as (rank, status, during a regroup)."""
    return sorted((i["rank"], i["status"], "during the regroup" in (i.get("error") or ""))
                  for i in job["incidents"] if i["kind"] == "crash")


def test_a_grow_with_a_rank_killed_during_its_regroup_changes_no_loss(
        make_hosts: Callable[[int], Hosts], tmp_path: Path, unchanged: RunRecord) -> None:  # noqa: F811
    """--nnodes 1:2: node 0 starts alone (2 ranks, 2 virtual ranks each); node 1 joins and the job regroups on
    4 ranks (1 virtual rank each). Rank 1 is SIGKILLed inside that regroup (armed at its named point: after the
    members restored the state, before it is saved). Every loss equals the unchanged 2-rank run's, bit for bit,
    and no step runs twice."""
    hosts = make_hosts(3)
    cluster = Cluster(hosts, tmp_path, "grow", SHRINK_ARGS, min_nodes=1,
                      run_args=[*RUN_ARGS, "--node-wait", "2"], script=SCRIPT)
    try:
        cluster.start_manager()
        cluster.start_agent(0, 1)
        status = cluster.wait_for_step(8)
        assert status["world_size"] == 2, status
        # Armed before node 1 exists, so the regroup its joining starts cannot begin first.
        cluster.inject({"kind": "crash", "rank": 1, "phase": "regroup", "at_step": 1})
        cluster.start_agent(1, 2)
        assert cluster.wait(150) == 0, cluster.logs()
    finally:
        cluster.close()
    job = _assert_regroups(cluster.job_dir, unchanged, [(2, 4)], cluster.logs)
    assert _fired(cluster.job_dir) == [(1, "regroup")]
    assert _crashes(job) == [(1, "recovered", True)], job["incidents"]
    regroup = next(i for i in job["incidents"] if i["kind"] == "node-joined")["detail"]["regroup"]
    # The saver (rank 0) saved; its confirmation failed with rank 1 gone, and it left all the same: one attempt.
    assert regroup["attempts"] == 1 and regroup["checkpoint_kind"] == "regroup", regroup
    assert regroup["faults"] == ["rank 1 killed by SIGKILL"], regroup
    assert any(i["kind"] == "node-joined" and i["status"] == "recovered" for i in job["incidents"]), job["incidents"]
    assert job["job"]["world_size"] == 4


def test_a_shrink_with_a_rank_killed_during_its_regroup_and_another_after_it_changes_no_loss(
        make_hosts: Callable[[int], Hosts], tmp_path: Path, unchanged: RunRecord) -> None:  # noqa: F811
    """--nnodes 1:2, 4 virtual ranks on 2 nodes of 2 ranks: node 1's host is lost and nobody replaces it. While
    ranks 0 and 1 regroup, rank 0, the one that saves, is SIGKILLed before its save: rank 1 meets alone, saves,
    and the job goes on with 2 ranks (2 virtual ranks each). Then rank 1 (now virtual ranks 2 and 3) is SIGKILLed
    in a backward pass and replaced. Every loss equals the fault-free run's on 2 ranks on one host, which never
    changed, bit for bit (the default mode equals only a job saved and resumed on 2), and no step runs twice."""
    hosts = make_hosts(3)
    cluster = Cluster(hosts, tmp_path, "shrinkcrash", SHRINK_ARGS, min_nodes=1,
                      run_args=[*RUN_ARGS, "--node-wait", "3"], script=SCRIPT)
    try:
        cluster.start()
        cluster.wait_for_step(8)
        cluster.inject({"kind": "crash", "rank": 0, "phase": "regroup", "at_step": 1})
        hosts.kill_host(2)
        status = wait_for(lambda: (s := cluster.status())["world_size"] == 2 and s["state"] == "running" and s, 60,
                          "the job to run on 2 ranks")
        cluster.inject({"kind": "crash", "rank": 1, "phase": "backward", "at_step": status["step"] + 3})
        assert cluster.wait(150) == 0, cluster.logs()
    finally:
        cluster.close()
    job = _assert_regroups(cluster.job_dir, unchanged, [(4, 2)], cluster.logs)
    assert _fired(cluster.job_dir) == [(0, "regroup"), (1, "backward")]
    assert _crashes(job) == [(0, "recovered", True), (1, "recovered", False)], job["incidents"]
    regroup = next(i for i in job["incidents"] if i["kind"] == "node-loss")["detail"]["regroup"]
    assert regroup["attempts"] == 2 and regroup["checkpoint_kind"] == "regroup", regroup
    assert any("rank 0 killed by SIGKILL" in f for f in regroup["faults"]), regroup
    # Node 0's worker zygote outlives the regroup (its members leave, the job comes back at once): it is let go
    # only once the job ended, so the regrouped ranks were forked warm, not started as fresh interpreters.
    node0 = cluster.log("node0").splitlines()
    last_start = max(i for i, line in enumerate(node0) if " is pid " in line)
    assert not any("the worker zygote goes" in line for line in node0[:last_start]), "\n".join(node0)


DEMO_TIMEOUT_S = 240  # the demo bounds its own runs; this only stops a stuck demo


@requires_netns
def test_demo_shrink_then_grow_in_invariant_mode_keeps_every_loss(tmp_path: Path, unchanged: RunRecord) -> None:
    """``undying demo --fault shrink --json``: 4 ranks on 2 nodes, node 1's host lost (4 -> 2 ranks), then a new
    host joins as node 1 (2 -> 4). Its one JSON object says identical and nothing lost; its kept job also equals
    the unchanged 2-rank run, bit for bit, with both regroups recovered and no step run twice."""
    argv = [sys.executable, "-m", "undying", "demo", "--fault", "shrink", "--json", "--epochs", "1", "--keep"]
    demo = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        out, err = demo.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(demo.pid, signal.SIGTERM)  # the demo removes its hosts and their processes on SIGTERM
        try:
            demo.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(demo.pid, signal.SIGKILL)  # (a later harness sweeps the hosts of a dead owner)
            demo.communicate(timeout=10)
        raise AssertionError(f"undying demo --fault shrink did not end within {DEMO_TIMEOUT_S}s") from None
    assert not our_namespaces(demo.pid), "the demo left its test hosts behind"
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line on stdout, got: {out!r}\nstderr:\n{err}"
    result = json.loads(lines[0])
    context = f"{json.dumps(result, indent=1)}\nstderr:\n{err[-6000:]}"
    assert demo.returncode == 0, context
    assert result["fault"] == "shrink" and result["ok"] is True and result["reasons"] == [], context
    assert result["identical"] is True and result["final_state_identical"] is True, context
    assert result["lost_steps"] == 0 and result["steps"] == STEPS and result["ranks"] == 4, context
    assert result["exit_codes"] == {"fault_free": 0, "with_fault": 0}, context
    lost = [i for i in result["incidents"] if i["kind"] == "node-loss"]
    assert sorted(i["rank"] for i in lost) == [2, 3], context
    assert all(i["action"] == "regroup" and i["status"] == "recovered" for i in lost), context
    assert [i["kind"] for i in result["incidents"]].count("node-joined") == 1, context
    _assert_regroups(Path(result["job_dirs"]["with_fault"]), unchanged, [(4, 2), (2, 4)], lambda: err[-6000:])
