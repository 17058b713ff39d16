"""A planned move (``undying migrate``): a rank leaves at a step boundary for a warm spare, nothing lost.

One seeded 2-rank job (the configuration of test_goodput, whose fault-free
baseline the oracle caches): once it runs with a warm spare, rank 1 is moved.
The per-step losses and the final state equal the run without the move, no
step completed twice, and the incident log holds one planned ``migration``
incident, recovered, with its timeline and the warm spare that took the rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Hosts, make_hosts  # noqa: F401 - the fixture
from tests.oracle import Oracle
from undying.cli.client import api_post
from undying.cli.demo import FAULTS
from undying.demo.cluster import Cluster, wait_for
from undying.demo.oracle import compare_runs, load_run
from undying.errors import UsageError
from undying.manager.events import connect_readonly, read_job

# test_goodput's job (2 ranks, 64 steps), paced: its fault-free baseline (pacing aside) is shared.
SCRIPT_ARGS = ("--epochs", "2", "--step-seconds", "0.1")


def test_a_rank_migrates_to_a_warm_spare_with_identical_losses(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", [FAULTS["migrate"]], ranks=2, script_args=SCRIPT_ARGS,
                                     extra_run_args=("--spares", "1"), when_warm=True)
    assert outcome.run.rerun_steps == []  # no step completed twice (the oracle says so too)
    [incident] = outcome.incidents
    assert (incident["kind"], incident["rank"], incident["action"]) == ("migration", 1, "migrate")
    assert incident["detail"]["replacement"] == "warm spare"
    moved = incident["detail"]["migration"]
    [planned] = outcome.events("migration_planned")
    # It left at a boundary: its last committed step is the one the incident names, at or past the plan's.
    assert moved["boundary_step"] == incident["step"] >= planned["boundary"]
    phases = incident["phases"]
    for phase in ("detected", "decided", "replacement_ready", "group_rebuilt", "state_restored", "first_step_done"):
        assert phase in phases, phases
    assert incident["mttr_s"] is not None and incident["mttr_s"] > 0
    # The replacement's state came from the other rank, at the boundary: the step after it ran once, there.
    assert incident["detail"]["restored_step"] == incident["step"]
    # It was started while the rank trained on, before the boundary opened the generation it joined.
    db = connect_readonly(outcome.job_dir / "events.db")
    try:
        order = [(kind, {**json.loads(data), "generation": generation}) for kind, generation, data in db.execute(
            "SELECT kind, generation, data FROM events WHERE kind IN ('spawned', 'generation_opened') ORDER BY id")]
    finally:
        db.close()
    generation = incident["detail"]["generation"]
    spawned = next(i for i, (k, d) in enumerate(order) if k == "spawned" and d.get("joining"))
    opened = next(i for i, (k, d) in enumerate(order) if k == "generation_opened" and d["generation"] == generation)
    assert spawned < opened, order
    # Ready before the boundary: the stall is the group rebuilt, the state sent and one step.
    assert incident["phases"]["replacement_ready"] <= incident["phases"]["detected"], incident["phases"]


# test_multinode's job (2 nodes x 2 ranks, 96 paced steps): its fault-free 4-rank baseline is shared.
MULTINODE_ARGS = ["--epochs", "3", "--samples", "2048", "--step-seconds", "0.1"]
MULTINODE_RUN = ["--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", "60"]


def test_a_drained_hosts_node_moves_to_a_standby_with_identical_losses(
        make_hosts: Callable[[int], Hosts], oracle: Oracle, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`undying drain HOST` on a network-namespace host: its node's two ranks leave at one step boundary,
    the standby parked on a third host takes the node on its warm spares, the losses are the fault-free run's."""
    hosts = make_hosts(3)
    cluster = Cluster(hosts, tmp_path, "mg", MULTINODE_ARGS, run_args=MULTINODE_RUN)
    try:
        cluster.start_manager()
        for node in range(2):  # (namespaces share the machine's hostname: each agent is given its own)
            monkeypatch.setenv("UNDYING_HOST_NAME", f"host{node + 1}")
            cluster.start_agent(node, node + 1)
        standby = hosts.add_host()
        monkeypatch.setenv("UNDYING_HOST_NAME", f"host{standby}")
        cluster.start_standby(standby)
        wait_for(lambda: cluster.log(f"standby{standby}").count("is warm") >= 2, 90, "the standby's two warm spares")
        cluster.wait_for_step(10)
        with hosts.inside(0):
            idle = _post_error(cluster, "/api/drain", {"host": "host9"})  # runs nothing: drained at once
            answer = api_post(cluster.url(), "/api/drain", {"host": "host2", "reason": "disk swap"},
                              token=cluster.token)
        assert idle is None
        [moved] = answer["moved"]
        assert (moved["migrating_node"], moved["ranks"], moved["to"]) == (1, [2, 3], f"host{standby}"), answer
        out = {m["host"]: m for m in cluster.status()["hosts_out"]}
        assert out["host2"]["state"] == "drained" and out["host2"]["reason"] == "disk swap", out
        assert cluster.wait(120) == 0, cluster.logs() + cluster.log(f"standby{standby}")[-3000:]
        run = load_run(cluster.job_dir / "events.db")
        comparison = compare_runs(oracle.baseline(MULTINODE_ARGS, ranks=4), run)
        assert comparison.identical and comparison.lost_steps == 0 and not run.rerun_steps, comparison.reasons
        job = read_job(cluster.job_dir / "events.db")
        incidents = job["incidents"]
        assert sorted(i["rank"] for i in incidents) == [2, 3], incidents
        assert all((i["kind"], i["action"], i["status"]) == ("migration", "migrate", "recovered")
                   for i in incidents), incidents
        assert all(i["detail"]["replacement"] == "warm spare" for i in incidents), incidents
        assert len({i["detail"]["generation"] for i in incidents}) == 1  # one new generation for the node
        assert "gave this agent node 1" in cluster.log(f"standby{standby}")
        assert cluster.agents[1].returncode == 0  # the drained host's agent was told it is done
        assert {m["host"] for m in job["job"]["hosts"]} == {"host2", "host9"}  # kept in the log
    finally:
        cluster.close()


def _post_error(cluster: Cluster, path: str, body: dict[str, Any]) -> str | None:
    """The manager's 400 for ``body`` (None: it was accepted)."""
    try:
        api_post(cluster.url(), path, body, token=cluster.token)
    except UsageError as e:
        return str(e)
    return None
