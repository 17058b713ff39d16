"""``undying demo --fault shrink``: invariant mode on separate test hosts, a host lost and the
job shrinking, then growing.

The job is ``invariant_train.py`` with ``--virtual-ranks 4``, elastic
(``--nnodes 1:2``), 2 nodes x 2 ranks on network-namespace hosts
(:mod:`undying.demo.hosts`): ``undying manager`` on host 0, node i's agent on
host i + 1. Past :data:`LOSE_AT_STEP` node 1's host is lost (its agent and
ranks 2 and 3 SIGKILLed) and nobody replaces it within the node-wait: the job
regroups onto node 0's 2 ranks (2 virtual ranks each). Once it trains there,
a new host joins as node 1 and the job grows back to 4 ranks. Every step's loss
and the final state must equal the fault-free 4-rank run's, bit for bit: in
invariant mode the curve does not depend on the number of ranks.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from undying.demo.cluster import Cluster, wait_for
from undying.demo.hosts import Hosts
from undying.demo.oracle import RunRecord, load_run

__all__ = ["INVARIANT_SCRIPT", "VIRTUAL_RUN_ARGS", "ShrinkRun", "script_args", "baseline_args",
           "refuse", "run_with_shrink", "check_incidents"]

INVARIANT_SCRIPT = Path(__file__).with_name("invariant_train.py")
VIRTUAL_RANKS = 4
VIRTUAL_RUN_ARGS = ("--virtual-ranks", str(VIRTUAL_RANKS))
NPROC_PER_NODE = 2
LOSE_AT_STEP = 15
# 64 steps an epoch (2048 samples over 4 virtual ranks in batches of 8), each at least 0.1 s.
SCRIPT_ARGS = ("--samples", "2048")
STEP_SECONDS = 0.1
RUN_ARGS = ("--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", "60",
            "--node-wait", "3", *VIRTUAL_RUN_ARGS)
JOB_TIMEOUT_S = 180.0


def script_args(epochs: int) -> list[str]:
    return [*SCRIPT_ARGS, "--epochs", str(epochs), "--step-seconds", str(STEP_SECONDS)]


def baseline_args(epochs: int) -> list[str]:
    """The fault-free run at full speed (``--step-seconds`` only sleeps: the losses are the
    same)."""
    return [*SCRIPT_ARGS, "--epochs", str(epochs)]


def refuse(reason: str, *, as_json: bool) -> int:
    """Say on one line why the demo cannot run (and, with ``--json``, as the contract's object);
    exit 2."""
    sys.stderr.write(f"undying: error: demo --fault shrink cannot run here: {reason}\n")
    if as_json:
        sys.stdout.write(json.dumps({
            "fault": "shrink", "identical": False, "steps": 0, "lost_steps": 0, "incidents": [],
            "ranks": 2 * NPROC_PER_NODE, "final_state_identical": False, "exit_codes": {},
            "wall_s": 0.0,
            "ok": False, "reasons": [f"cannot run here: {reason}"], "unavailable": reason}) + "\n")
    return 2


@dataclass
class ShrinkRun:
    record: RunRecord
    returncode: int | None
    reasons: list[str] = field(default_factory=list)


def run_with_shrink(root: Path, args: list[str], console: Console, *,
                    job_id: str = "with-fault") -> ShrinkRun:
    """Run the job on three hosts, lose node 1's host past :data:`LOSE_AT_STEP`, let it shrink,
    then grow it back.

    A failure on the way is returned in ``reasons`` (with the logs on stderr), not raised; every
    host is gone on return.
    """
    returncode: int | None = None
    reasons: list[str] = []
    with Hosts(3) as hosts:
        cluster = Cluster(hosts, root, job_id, args, nnodes=2, nproc_per_node=NPROC_PER_NODE,
                          min_nodes=1, run_args=list(RUN_ARGS), script=INVARIANT_SCRIPT)
        try:
            cluster.start()
            cluster.wait_for_step(LOSE_AT_STEP)
            lost_at = time.time()
            hosts.kill_host(2)
            console.print(f"    step >= {LOSE_AT_STEP}: node 1's host ({hosts.addr(2)}) lost, "
                          "nobody replaces it")
            status = wait_for(lambda: _running_on(cluster, 2), 60, "the job to train on 2 ranks")
            console.print(f"    the job shrank to 2 ranks ({time.time() - lost_at:.1f}s after the "
                          f"loss) and trains on at step {status['step']}; a new host joins as "
                          "node 1")
            cluster.start_agent(1, hosts.add_host())
            returncode = cluster.wait(JOB_TIMEOUT_S)
            console.print(f"    the job ended: the manager exited {returncode}")
        except (TimeoutError, RuntimeError, OSError, subprocess.SubprocessError) as e:
            reasons.append(f"the run with the shrink broke off: {e}".splitlines()[0])
            console.print(cluster.logs(), markup=False, highlight=False)
        finally:
            cluster.close()
    db = root / job_id / "events.db"
    record = load_run(db) if db.exists() else RunRecord(
        state="never started", losses={}, inconsistent_steps=[], rerun_steps=[], digests={},
        incidents=[], commits=0)
    return ShrinkRun(record, returncode, reasons)


def _running_on(cluster: Cluster, ranks: int) -> dict[str, Any] | None:
    with contextlib.suppress(Exception):  # the API may be between connections: ask again
        status = cluster.status()
        if status["state"] == "running" and status["world_size"] == ranks:
            return status
    return None


def check_incidents(incidents: list[dict[str, Any]]) -> list[str]:
    """Node 1's ranks lost and regrouped (recovered), then node 1 joined: empty when all is well."""
    reasons = []
    lost = sorted(i["rank"] for i in incidents if i["kind"] == "node-loss")
    if lost != [2, 3]:
        reasons.append(f"node-loss incidents name ranks {lost}, not node 1's ranks [2, 3]")
    if not any(i["kind"] == "node-joined" for i in incidents):
        reasons.append("no node-joined incident: the job did not grow back")
    for incident in incidents:
        if incident["status"] != "recovered":
            reasons.append(f"incident {incident['kind']} of rank {incident['rank']} is "
                           f"{incident['status']}")
    return reasons
