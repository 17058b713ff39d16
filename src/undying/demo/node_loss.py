"""``undying demo --fault node-loss``: the seeded job on separate test hosts, one host lost mid-run.

The job runs as 2 nodes x 2 ranks on network-namespace hosts
(:mod:`undying.demo.hosts`, driven by :class:`undying.demo.cluster.Cluster`):
``undying manager`` alone on host 0, node i's agent on host i + 1. Once the
job has passed :data:`LOSE_AT_STEP`, node 1's host is lost (every process on
it SIGKILLed: its agent and ranks 2 and 3); once the manager has declared the
node lost, a new host joins with a new agent for node 1, as a cluster
scheduler would bring one up, and the job must finish with every step's loss
equal to the fault-free 4-rank run's. The namespaces need root, so where they
cannot be made the demo says why and what to do before it runs anything.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from undying.demo.cluster import Cluster, wait_for
from undying.demo.hosts import Hosts
from undying.demo.namespaces import netns_unavailable_reason
from undying.demo.oracle import RunRecord, load_run

__all__ = [
    "LOSE_AT_STEP",
    "LOST_NODE",
    "NNODES",
    "NPROC_PER_NODE",
    "BASELINE_RUN_ARGS",
    "NodeLossRun",
    "baseline_args",
    "check_incidents",
    "refuse",
    "run_with_node_loss",
    "script_args",
    "unavailable_reason",
]

NNODES = 2
NPROC_PER_NODE = 2
LOST_NODE = 1
LOST_RANKS = [LOST_NODE * NPROC_PER_NODE + r for r in range(NPROC_PER_NODE)]
LOSE_AT_STEP = 15
# 32 steps an epoch at 4 ranks, each at least 0.1 s: time to lose a host mid-run in a job of
# seconds.
SCRIPT_ARGS = ("--samples", "2048")
STEP_SECONDS = 0.1
# A short heartbeat timeout finds the lost node in seconds; no spares, since a lost host takes its
# spares along.
RUN_ARGS = ("--heartbeat-timeout", "3", "--spares", "0", "--rendezvous-timeout", "60")
# The fault-free run recovers nothing, so a warm spare would only take CPU from its ranks.
BASELINE_RUN_ARGS = ("--spares", "0")
DETECT_TIMEOUT_S = 30.0
JOB_TIMEOUT_S = 120.0


def script_args(epochs: int) -> list[str]:
    """The seeded job's arguments for the run with the node loss."""
    return [*SCRIPT_ARGS, "--epochs", str(epochs), "--step-seconds", str(STEP_SECONDS)]


def baseline_args(epochs: int) -> list[str]:
    """The same job for the fault-free run, at full speed: ``--step-seconds`` only sleeps after
    a step's work, so every loss and the final state are the same with it or without it (and the
    run takes ~10 s less)."""
    return [*SCRIPT_ARGS, "--epochs", str(epochs)]


def unavailable_reason() -> str | None:
    """Why this demo cannot run here (not root, no ``ip``, no namespaces), with what to do; None
    if it can."""
    return netns_unavailable_reason()


def refuse(reason: str, *, as_json: bool) -> int:
    """Say on one line why the demo cannot run (and, with ``--json``, as the contract's object);
    exit 2."""
    sys.stderr.write(f"undying: error: demo --fault node-loss cannot run here: {reason}\n")
    if as_json:
        result = {
            "fault": "node-loss", "identical": False, "steps": 0, "lost_steps": 0, "incidents": [],
            "ranks": NNODES * NPROC_PER_NODE, "final_state_identical": False, "exit_codes": {},
            "wall_s": 0.0,
            "ok": False, "reasons": [f"cannot run here: {reason}"], "unavailable": reason,
        }
        sys.stdout.write(json.dumps(result) + "\n")
    return 2


@dataclass
class NodeLossRun:
    """What the faulty run left: its record for the oracle, the manager's exit code, what went
    wrong."""

    record: RunRecord
    returncode: int | None
    lost_at: float | None = None
    reasons: list[str] = field(default_factory=list)


class _Terminated(SystemExit):
    """SIGTERM to the demo: unwinds (exit 143) so that every host, and every process in it, is
    cleaned up."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While the hosts exist, SIGTERM raises instead of killing outright (which would leave them
    behind)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: nothing to install, the caller cleans up
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_with_node_loss(root: Path, args: list[str], console: Console, *,
                       job_id: str = "with-fault", lose_at_step: int = LOSE_AT_STEP,
                       timeout_s: float = JOB_TIMEOUT_S) -> NodeLossRun:
    """Run the job on three hosts, lose node 1's host past ``lose_at_step``, bring a new one,
    await the end.

    The job dir is ``root / job_id``; the manager's and agents' logs lie beside
    it. A failure on the way (a timeout, a process that exited early) is not
    raised but returned in ``reasons``, with the logs' tails on stderr, so the
    demo still reports what the job's log holds. Every host is gone on return.
    """
    returncode: int | None = None
    lost_at: float | None = None
    reasons: list[str] = []
    with _sigterm_unwinds(), Hosts(1 + NNODES) as hosts:
        cluster = Cluster(hosts, root, job_id, args, nnodes=NNODES, nproc_per_node=NPROC_PER_NODE,
                          run_args=RUN_ARGS)
        try:
            console.print(f"    {len(hosts)} hosts (network namespaces on {hosts.subnet}): the "
                          f"manager on {hosts.addr(0)}, node i's agent on host i + 1")
            cluster.start()
            cluster.wait_for_step(lose_at_step)
            lost_host = LOST_NODE + 1
            lost_at = time.time()
            hosts.kill_host(lost_host)
            console.print(f"    step >= {lose_at_step}: node {LOST_NODE}'s host "
                          f"({hosts.addr(lost_host)}) lost: its agent and ranks {LOST_RANKS} "
                          "SIGKILLed")
            wait_for(lambda: _declared_lost(cluster), DETECT_TIMEOUT_S,
                     "the manager to declare the node lost")
            replacement = hosts.add_host()
            cluster.start_agent(LOST_NODE, replacement)
            console.print(f"    node loss declared after {time.time() - lost_at:.1f}s; a new host "
                          f"({hosts.addr(replacement)}) joins with node {LOST_NODE}'s agent")
            returncode = cluster.wait(timeout_s)
            console.print(f"    the job ended: the manager exited {returncode}")
        except (TimeoutError, RuntimeError, OSError, subprocess.SubprocessError) as e:
            reasons.append(f"the run with the node loss broke off: {e}".splitlines()[0])
            console.print(cluster.logs(), markup=False, highlight=False)
        except _Terminated:
            console.print("    terminated: stopping the job and removing its hosts")
            raise
        finally:
            cluster.close()
    return NodeLossRun(_load(root / job_id / "events.db"), returncode, lost_at, reasons)


def _declared_lost(cluster: Cluster) -> bool:
    with contextlib.suppress(Exception):  # the API may be busy or between connections: ask again
        return any(i["kind"] == "node-loss" for i in cluster.status()["incidents"])
    return False


def _load(events_db: Path) -> RunRecord:
    """The run's record; an empty one when the job never got far enough to write its log."""
    if events_db.exists():
        return load_run(events_db)
    return RunRecord(state="never started", losses={}, inconsistent_steps=[], rerun_steps=[],
                     digests={}, incidents=[], commits=0)


def check_incidents(incidents: list[dict[str, Any]]) -> list[str]:
    """What is wrong with the faulty run's incidents: each lost rank needs a node-loss incident,
    replaced and recovered. Empty when all is well."""
    lost = {i["rank"]: i for i in incidents if i["kind"] == "node-loss"}
    reasons = []
    if sorted(lost) != LOST_RANKS:
        reasons.append(f"node-loss incidents name ranks {sorted(lost)}, not node {LOST_NODE}'s "
                       f"ranks {LOST_RANKS}")
    for rank, incident in sorted(lost.items()):
        if (incident["action"], incident["status"]) != ("replace", "recovered"):
            reasons.append(f"rank {rank}'s node-loss incident is "
                           f"{incident['action']}/{incident['status']}, not replace/recovered")
    return reasons
