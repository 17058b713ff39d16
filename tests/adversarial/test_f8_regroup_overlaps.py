"""Finding 8, overlapping faults across nodes: a second fault while a regroup saves, a manager killed mid-regroup.

A regroup (a node lost for good in an elastic job) has the survivors meet in a
generation of their own, agree on their newest step, save it and leave; the
job then starts again on the nodes it has. Before the fix, a second fault in
that window (the saver dying, a member's node lost) left the regroup waiting
for members that would never save, until --recovery-timeout failed the job;
and a manager restarted mid-regroup did not know of it and took the members'
exits for crashes. Now the members left meet again and save (or, the state
being saved, are let go), a restarted manager reads the regroup back from
its log and carries it through, and only where too few nodes remain does the
job fail, naming both faults.

Real processes on separate network hosts (namespaces, root only: skipped with
the reason otherwise): the manager alone (`undying manager`) on host 0, one
agent per node. Every run is checked with the oracle: each step's loss equals,
bit for bit, the job saved at the regroup's step and resumed on the new size
(``Oracle.regrouped``), or the fault-free run when the size comes back, and no
step completed twice.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.jobs import alive
from tests.netns import Hosts, make_hosts  # noqa: F401 - the fixture
from tests.oracle import Oracle
from undying.demo.cluster import Cluster, wait_for
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.events import connect_readonly, read_job

# 3 nodes x 1 rank: 20 steps an epoch on 3 ranks, 30 on 2, 60 on 1; ~0.1 s a step.
SCRIPT_ARGS = ["--epochs", "2", "--samples", "960", "--step-seconds", "0.1"]
RUN_ARGS = ["--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", "60", "--node-wait", "2",
            "--recovery-timeout", "90"]


@pytest.fixture
def cluster_of(make_hosts: Callable[[int], Hosts], tmp_path: Path) -> Iterator[Callable[..., Cluster]]:  # noqa: F811
    """``cluster_of(name, nnodes=3, min_nodes=1, run_args=...)``: one agent a node, one rank an agent."""
    made: list[Cluster] = []

    def make(name: str, *, nnodes: int = 3, min_nodes: int = 1, run_args: list[str] | None = None) -> Cluster:
        hosts = make_hosts(nnodes + 1)
        cluster = Cluster(hosts, tmp_path, name, SCRIPT_ARGS, nnodes=nnodes, nproc_per_node=1, min_nodes=min_nodes,
                          run_args=RUN_ARGS if run_args is None else run_args)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


def _events(cluster: Cluster, kind: str) -> list[dict[str, Any]]:
    """The job's events of ``kind`` so far, read from its log as `undying status` reads it."""
    db_path = cluster.job_dir / "events.db"
    if not db_path.exists():
        return []
    db = connect_readonly(db_path)
    try:
        return [{"rank": rank, **json.loads(data)}
                for rank, data in db.execute("SELECT rank, data FROM events WHERE kind = ? ORDER BY id", (kind,))]
    finally:
        db.close()


def _status_or_none(cluster: Cluster) -> dict[str, Any] | None:
    """The job's status, or None while its manager's API is not up (a restarted one)."""
    try:
        return cluster.status()
    except Exception:
        return None


def _fault_fired(cluster: Cluster, rank: int, phase: str) -> bool:
    return any(e["rank"] == rank and e["phase"] == phase for e in _events(cluster, "fault_injected"))


def _the_regroup(job: dict[str, Any]) -> dict[str, Any]:
    """The regroup's record on its incidents: every one recovered, and no step lost."""
    incidents = [i for i in job["incidents"] if i["action"] == "regroup"]
    assert incidents and all(i["status"] == "recovered" for i in incidents), job["incidents"]
    assert all(i["detail"]["lost_steps"] == 0 for i in incidents), incidents
    return dict(incidents[0]["detail"]["regroup"])


def _assert_regrouped_identical(oracle: Oracle, cluster: Cluster, *, ranks: int, then: int) -> dict[str, Any]:
    """Losses equal those of the job saved on ``ranks`` at the regroup's step and resumed on ``then``; no rerun."""
    job = read_job(cluster.job_dir / "events.db")
    regroup = _the_regroup(job)
    assert (regroup["from_world_size"], regroup["world_size"]) == (ranks, then), regroup
    assert regroup["checkpoint_kind"] == "regroup", regroup  # the survivors' state, not an older checkpoint
    reference = oracle.regrouped(SCRIPT_ARGS, ranks=ranks, then=then, at_step=regroup["checkpoint_step"])
    run = load_run(cluster.job_dir / "events.db")
    comparison = compare_runs(reference, run)
    assert comparison.identical, (comparison.reasons, cluster.logs())
    assert not run.rerun_steps, run.rerun_steps
    return regroup


def test_the_saver_dying_while_the_regroup_saves_has_the_members_left_save_it(
        cluster_of: Callable[..., Cluster], oracle: Oracle) -> None:
    """Finding 8: node 2 lost for good; ranks 0 and 1 regroup, and rank 0, the one that saves, is SIGKILLed
    before its checkpoint is written. Rank 1 still holds the state: it meets no one but itself in a second
    regroup generation, saves it, and the job goes on on nodes 0 and 1, bit-identical, long before the
    recovery timeout."""
    cluster = cluster_of("saver")
    cluster.start()
    cluster.wait_for_step(8)
    cluster.inject({"kind": "crash", "rank": 0, "phase": "regroup", "at_step": 1})
    hosts = cluster.hosts
    assert isinstance(hosts, Hosts)
    t0 = time.monotonic()
    hosts.kill_host(3)
    assert cluster.wait(150) == 0, cluster.logs()
    assert time.monotonic() - t0 < 90, "the regroup waited out its recovery timeout"
    assert _fault_fired(cluster, 0, "regroup"), cluster.logs()
    regroup = _assert_regrouped_identical(oracle, cluster, ranks=3, then=2)
    assert regroup["nodes"] == [0, 1] and regroup["attempts"] == 2, regroup
    assert any("rank 0 killed by SIGKILL" in f for f in regroup["faults"]), regroup
    job = read_job(cluster.job_dir / "events.db")
    kinds = sorted((i["kind"], i["rank"]) for i in job["incidents"])
    assert kinds == [("crash", 0), ("node-loss", 2)], job["incidents"]
    saved = [e for e in _events(cluster, "checkpoint_saved") if e["kind"] == "regroup"]
    assert [e["rank"] for e in saved] == [1], saved  # the member left saved it, once


def test_a_members_node_lost_while_the_regroup_saves_leaves_the_job_on_the_node_it_has(
        cluster_of: Callable[..., Cluster], oracle: Oracle) -> None:
    """Finding 8: node 2 lost for good; while ranks 0 and 1 regroup, rank 1 stops (SIGSTOP) as rank 0 saves,
    and its host is killed: node 1 is lost mid-regroup. With --nnodes 1:3 node 0 may go on alone: it does,
    from the state saved at the regroup's step, bit-identical, with both node losses recovered."""
    cluster = cluster_of("member")
    cluster.start()
    cluster.wait_for_step(8)
    cluster.inject({"kind": "hang", "rank": 1, "phase": "regroup", "at_step": 1})
    hosts = cluster.hosts
    assert isinstance(hosts, Hosts)
    hosts.kill_host(3)
    wait_for(lambda: _fault_fired(cluster, 1, "regroup"), 60, "rank 1 stopping in the regroup")
    t0 = time.monotonic()
    hosts.kill_host(2)
    assert cluster.wait(150) == 0, cluster.logs()
    regroup = _assert_regrouped_identical(oracle, cluster, ranks=3, then=1)
    assert regroup["nodes"] == [0], regroup
    assert any("node 1 lost" in f for f in regroup["faults"]), regroup
    job = read_job(cluster.job_dir / "events.db")
    kinds = sorted((i["kind"], i["rank"]) for i in job["incidents"])
    assert kinds == [("node-loss", 1), ("node-loss", 2)], job["incidents"]
    assert job["job"]["world_size"] == 1 and job["job"]["nodes"] == [0]
    assert time.monotonic() - t0 < 90, "the regroup waited out its recovery timeout"


def test_too_few_nodes_left_after_a_second_loss_fails_naming_both_within_the_timeout(
        cluster_of: Callable[..., Cluster]) -> None:
    """Finding 8: --nnodes 2:3. Node 2 is lost for good and ranks 0 and 1 regroup; node 1 is lost too while
    they save. One node is no quorum: the job saves the state it has, waits the rendezvous timeout for a
    host, and fails saying which nodes were lost, that it needs 2, and where the state is saved."""
    rendezvous_s = 8
    run_args = ["--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", str(rendezvous_s),
                "--node-wait", "2", "--recovery-timeout", "90"]
    cluster = cluster_of("quorum", min_nodes=2, run_args=run_args)
    cluster.start()
    cluster.wait_for_step(8)
    cluster.inject({"kind": "hang", "rank": 1, "phase": "regroup", "at_step": 1})
    hosts = cluster.hosts
    assert isinstance(hosts, Hosts)
    survivors = set(hosts.pids(1)) - {cluster.agents[0].pid}
    hosts.kill_host(3)
    wait_for(lambda: _fault_fired(cluster, 1, "regroup"), 60, "rank 1 stopping in the regroup")
    t0 = time.monotonic()
    hosts.kill_host(2)
    assert cluster.wait(60) == 1, cluster.logs()
    took = time.monotonic() - t0
    assert took < rendezvous_s + 20, f"the job failed {took:.1f}s after the quorum was lost"
    assert cluster.agents[0].wait(15) == 1, cluster.log("node0")
    assert not any(alive(pid) for pid in survivors), "a worker outlived the failed job"
    job = read_job(cluster.job_dir / "events.db")
    assert job["job"]["state"] == "failed"
    reason = job["job"]["exit_reason"]
    assert "node 2 lost" in reason and "during the regroup: node 1 lost" in reason, reason
    assert "needs 2 node(s) and has 1" in reason and "recovery timeout" not in reason, reason
    saved = reason.split("is saved in ")[1].split(":")[0]
    assert (Path(saved) / "manifest.json").exists(), reason  # the survivors' state: a resume loses nothing
    assert all(i["status"] == "failed" for i in job["incidents"]), job["incidents"]


def test_a_manager_killed_while_the_job_waits_for_a_node_carries_the_regroup_on(
        cluster_of: Callable[..., Cluster], oracle: Oracle) -> None:
    """Finding 8: a fixed size (--nnodes 2): node 1 is lost, the survivor saves and the job waits for a host.
    The manager is SIGKILLed then and started again: it reads the regroup back from its log and, when a new
    host joins as node 1, starts the job from the saved state: bit-identical to the fault-free run."""
    cluster = cluster_of("waiting", nnodes=2, min_nodes=0)
    cluster.start()
    cluster.wait_for_step(8)
    hosts = cluster.hosts
    assert isinstance(hosts, Hosts)
    hosts.kill_host(2)
    waiting = wait_for(lambda: (cluster.status().get("regroup") or {}).get("waiting_for_nodes_since")
                       and cluster.status(), 40, "the job waiting for a node")
    assert waiting["regroup"]["checkpoint"], waiting["regroup"]
    assert cluster.manager is not None
    os.kill(cluster.manager.pid, signal.SIGKILL)
    cluster.manager.wait(10)
    cluster.start_manager()
    # What the old one had not committed yet (the member's exit), the agent tells the new one again.
    waiting = wait_for(lambda: ((_status_or_none(cluster) or {}).get("regroup") or {}).get("waiting_for_nodes_since")
                       and _status_or_none(cluster), 30, "the restarted manager waiting for a node")
    assert waiting["state"] == "recovering" and waiting["regroup"]["left"] == [0], waiting["regroup"]
    cluster.start_agent(1, hosts.add_host())
    assert cluster.wait(150) == 0, cluster.logs()
    baseline = oracle.baseline(SCRIPT_ARGS, ranks=2)
    run = load_run(cluster.job_dir / "events.db")
    comparison = compare_runs(baseline, run)
    assert comparison.identical and not run.rerun_steps, (comparison.reasons, cluster.logs())
    job = read_job(cluster.job_dir / "events.db")
    regroup = _the_regroup(job)
    assert regroup["world_size"] == 2 and regroup["checkpoint_kind"] == "regroup", regroup
    assert _events(cluster, "manager_restarted"), "the manager did not restart from its log"
    # Carried on, not begun again (a second save, the node-wait anew) nor the member's exit taken for a crash.
    assert len(_events(cluster, "regroup")) == 1, _events(cluster, "regroup")
    assert [(i["kind"], i["rank"]) for i in job["incidents"]] == [("node-loss", 1)], job["incidents"]
    _assert_carried_on(cluster)


def test_a_manager_killed_mid_regroup_with_a_member_stopped_carries_it_through(
        cluster_of: Callable[..., Cluster], oracle: Oracle) -> None:
    """Finding 8: node 2 lost for good; ranks 0 and 1 regroup and rank 1 stops (SIGSTOP) in it. The manager
    is SIGKILLed at that moment and started again. The new one reads the regroup back, hears the stopped
    member's hang from its agent, lets the members go once the state is saved, and the job goes on on
    nodes 0 and 1: bit-identical, nothing re-run."""
    cluster = cluster_of("restart")
    cluster.start()
    cluster.wait_for_step(8)
    cluster.inject({"kind": "hang", "rank": 1, "phase": "regroup", "at_step": 1})
    hosts = cluster.hosts
    assert isinstance(hosts, Hosts)
    hosts.kill_host(3)
    wait_for(lambda: _fault_fired(cluster, 1, "regroup"), 60, "rank 1 stopping in the regroup")
    assert cluster.manager is not None
    os.kill(cluster.manager.pid, signal.SIGKILL)
    cluster.manager.wait(10)
    cluster.start_manager()
    assert cluster.wait(150) == 0, cluster.logs()
    regroup = _assert_regrouped_identical(oracle, cluster, ranks=3, then=2)
    assert regroup["nodes"] == [0, 1], regroup
    assert any("rank 1 hung" in f for f in regroup["faults"]), regroup
    job = read_job(cluster.job_dir / "events.db")
    kinds = sorted((i["kind"], i["rank"]) for i in job["incidents"])
    assert kinds == [("hang", 1), ("node-loss", 2)], job["incidents"]
    assert _events(cluster, "manager_restarted"), "the manager did not restart from its log"
    _assert_carried_on(cluster)


def _assert_carried_on(cluster: Cluster) -> None:
    """From the regroup on, only regroup generations and the new world's: no member replaced in the old world."""
    reasons = [e["reason"] for e in _events(cluster, "generation_opened")]
    first = next(i for i, r in enumerate(reasons) if r.startswith("regroup:"))
    assert all(r.startswith("regroup:") or " node(s) " in r for r in reasons[first:]), reasons
