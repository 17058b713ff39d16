"""Node-loss benchmark: what a lost node costs when a host replaces it, and when none does (a regroup).

Method
------
One workload, the demo job (``undying/demo/train.py``, 2 nodes x 2 ranks, each
step at least ``--step-seconds``), on network-namespace test hosts
(``undying.demo.hosts``; root needed): ``undying manager`` alone on host 0,
node i's agent on host i + 1. Three scenarios, each run ``--repeats`` times:

* replace: node 1's host is lost at step S (every process on it SIGKILLed) and a
  new host joins as node 1 as soon as the manager has declared the node lost, as
  a cluster scheduler would start a new pod. The ranks' state comes from peers.
* standby: as replace, but a warm standby agent (``undying run --standby``) was
  parked on a third host before the fault, its zygote and two spares warm; the
  manager gives it node 1's rank when the node is lost, and the ranks start on
  its spares. Nothing is started after the fault.
* shrink: ``--nnodes 1:2``; node 1's host is lost at step S and nothing replaces
  it. After ``--node-wait`` the survivors save their newest step and the job
  starts again on node 0 alone from it (a regroup).
* grow: ``--nnodes 1:2`` started with node 0 alone; at step S node 1 joins and the
  job regroups on both nodes.
* shrink-invariant, grow-invariant: shrink and grow in invariant mode
  (``--virtual-ranks 4``, ``undying/demo/invariant_train.py``: the same MLP, the
  same global batch of ``4 x --batch-size`` at 4 ranks, split over the 4 virtual
  ranks), for MTTR and step time against the default mode at the same world
  size. Run them interleaved with shrink and grow.

Besides the MTTR, every run reports the steady-state step time before the fault
and after the recovery (rank 0's commits: the median gap between consecutive
steps, the first 3 steps of each side left out as warm-up). With
``--step-seconds`` above the step's work that is the pacing only: measure step
time with ``--step-seconds 0`` and more ``--samples``.
* migrate: no fault: at step S rank 3 is moved (``undying migrate --rank 3``) to a
  warm spare of its node at a step boundary; its stall is set beside a step and
  the group rebuild (``run_migrate``).

From the manager's incident (every phase is measured from the fault: the
SIGKILL, or the join) the report takes detection, the decision, the regroup's
checkpoint write, the replacement processes ready, the group rebuilt, the state
restored and the first step done on every rank (MTTR), and the steps completed
twice (lost). The node-wait is policy, not work: the report also gives the MTTR
without it. ``--spares`` sets the warm spares per node (the surviving node's
spares start the regrouped ranks without an interpreter start).

A benchmark reports numbers; it asserts nothing. Run it as root from the
repository root::

    python bench/regroup.py                  # 3 repetitions of each scenario
    python bench/regroup.py --repeats 1 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from undying.cli.client import api_post
from undying.demo import TRAIN_SCRIPT
from undying.demo.cluster import Cluster, wait_for
from undying.demo.hosts import Hosts
from undying.demo.namespaces import netns_unavailable_reason
from undying.demo.shrink import INVARIANT_SCRIPT
from undying.jobfiles.events import LogReader, read_job

SCENARIOS = ("replace", "standby", "shrink", "grow", "shrink-invariant", "grow-invariant", "migrate")
INVARIANT = "-invariant"  # the suffix of a scenario run in invariant mode (--virtual-ranks 4)
VIRTUAL_RANKS = 4
PHASES = ("detected", "decided", "checkpoint_written", "replacement_ready", "group_rebuilt", "state_restored",
          "first_step_done")


def run_once(scenario: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    invariant = scenario.endswith(INVARIANT)
    scenario, mode = scenario.removesuffix(INVARIANT), scenario
    hosts = Hosts(4)
    job_id = f"{mode}-{int(time.time() * 1000) % 10**8}"
    script_args = ["--samples", str(args.samples), "--epochs", str(args.epochs),
                   "--step-seconds", str(args.step_seconds), "--batch-size", str(args.batch_size)]
    run_args = ["--heartbeat-timeout", str(args.heartbeat_timeout), "--spares", str(args.spares),
                "--node-wait", str(args.node_wait), "--rendezvous-timeout", "120"]
    if invariant:  # the job of 4 virtual ranks: each reads --batch-size, as each of 4 ranks does by default
        run_args += ["--virtual-ranks", str(VIRTUAL_RANKS)]
    cluster = Cluster(hosts, root, job_id, script_args, run_args=run_args,
                      min_nodes=1 if scenario in ("shrink", "grow") else 0,
                      script=INVARIANT_SCRIPT if invariant else TRAIN_SCRIPT)
    try:
        cluster.start_manager()
        cluster.start_agent(0, 1)
        if scenario != "grow":
            cluster.start_agent(1, 2)
        if scenario == "standby":
            cluster.start_standby(3)
            want = max(args.spares, 2)  # a standby keeps as many warm spares as a node has ranks, at least
            wait_for(lambda: cluster.log("standby3").count("is warm") >= want, 180, "the standby's warm spares")
        cluster.wait_for_step(args.at_step, timeout=180)
        fault_t = time.time()
        if scenario == "grow":
            cluster.start_agent(1, 2)
        else:
            hosts.kill_host(2)
        if scenario == "replace":
            wait_for(lambda: any(i["kind"] == "node-loss" for i in cluster.status()["incidents"]), 60, "the loss")
            cluster.start_agent(1, 3)
        code = cluster.wait(600)
    finally:
        cluster.close()
        hosts.close()
    job = read_job(cluster.job_dir / "events.db")
    incidents = [i for i in job["incidents"] if i["kind"] in ("node-loss", "node-joined")]
    first = incidents[0] if incidents else {}
    # Phases are stored relative to the incident's fault_t; re-base them on the moment the bench acted.
    offset = float(first.get("fault_t", fault_t)) - fault_t
    phases = {p: round(v + offset, 3) for p, v in (first.get("phases") or {}).items()}
    regroup = (first.get("detail") or {}).get("regroup") or {}
    mttr = phases.get("first_step_done")
    waited = args.node_wait if scenario == "shrink" else 0.0
    before_s, after_s = _steady_step_times(cluster.job_dir / "events.db", fault_t, fault_t + (mttr or 0.0))
    return {
        "scenario": mode, "exit_code": code, "state": job["job"].get("state"),
        "phases": phases, "mttr_s": mttr,
        "mttr_without_node_wait_s": round(mttr - waited, 3) if mttr is not None else None,
        "lost_steps": len(job["job"].get("rerun_steps", [])) + int((first.get("detail") or {}).get("lost_steps", 0)),
        "world_size": job["job"].get("world_size"), "action": first.get("action"),
        "regroup_step": regroup.get("checkpoint_step"), "regroup_kind": regroup.get("checkpoint_kind"),
        "step_s_before": before_s, "step_s_after": after_s,
    }


def _steady_step_times(db: Path, fault_t: float, recovered_t: float, warmup: int = 3) -> tuple[float | None, ...]:
    """Rank 0's median gap between consecutive steps before ``fault_t`` and after ``recovered_t`` (seconds).

    The first ``warmup`` steps of each side are left out (a fresh group's first
    steps build buffers and warm caches); a gap across a missing step is no step.
    """
    with LogReader(db) as reader:
        times = sorted((s, t) for r, s, t in reader.commit_times() if r == 0)

    def median_gap(side: list[tuple[int, float]]) -> float | None:
        gaps = [b[1] - a[1] for a, b in zip(side[warmup:], side[warmup + 1:], strict=False) if b[0] == a[0] + 1]
        return round(statistics.median(gaps), 4) if gaps else None

    return (median_gap([c for c in times if c[1] < fault_t]), median_gap([c for c in times if c[1] > recovered_t]))
def run_migrate(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """migrate: a planned move (``undying migrate --rank 3``) to a warm spare of node 1, no host lost.

    The rank leaves at a step boundary (``manager.migration``); the stall is the
    time between the boundary step's commit and the next one's on every rank,
    set beside the job's median step (commit to commit) and the incident's own
    timeline (from the exit at the boundary). Target: a stall under one step
    plus the group rebuild (from the boundary, or from the replacement ready
    when it was not ready by then, to the group rebuilt).
    """
    hosts = Hosts(3)
    job_id = f"migrate-{int(time.time() * 1000) % 10**8}"
    script_args = ["--samples", str(args.samples), "--epochs", str(args.epochs),
                   "--step-seconds", str(args.step_seconds)]
    run_args = ["--heartbeat-timeout", str(args.heartbeat_timeout), "--spares", str(max(1, args.spares)),
                "--rendezvous-timeout", "120"]
    cluster = Cluster(hosts, root, job_id, script_args, run_args=run_args)
    try:
        cluster.start()
        cluster.wait_for_step(args.at_step, timeout=180)
        wait_for(lambda: cluster.status()["spares_ready"] >= 2, 120, "a warm spare on each node")
        with hosts.inside(cluster.manager_host):
            api_post(cluster.url(), "/api/migrate", {"rank": 3}, token=cluster.token)
        code = cluster.wait(600)
    finally:
        cluster.close()
        hosts.close()
    job = read_job(cluster.job_dir / "events.db")
    moved = next((i for i in job["incidents"] if i["kind"] == "migration"), {})
    phases = {p: round(v, 3) for p, v in (moved.get("phases") or {}).items()}
    done: dict[int, float] = {}  # step -> when its last rank committed it
    for commit in job["steps"]:
        done[commit["step"]] = max(done.get(commit["step"], 0.0), commit["t"])
    gaps = [done[s + 1] - done[s] for s in sorted(done) if s + 1 in done]
    boundary = int(moved.get("step", 0))
    stall = done[boundary + 1] - done[boundary] if boundary in done and boundary + 1 in done else None
    # The group rebuild: from the boundary, or from the replacement's start when it was not ready by then.
    rebuild = (phases["group_rebuilt"] - max(0.0, phases["replacement_ready"])
               if "group_rebuilt" in phases and "replacement_ready" in phases else None)
    step = statistics.median(gaps) if gaps else None
    return {
        "scenario": "migrate", "exit_code": code, "state": job["job"].get("state"),
        "phases": phases, "mttr_s": phases.get("first_step_done"), "mttr_without_node_wait_s": phases.get("first_step_done"),
        "lost_steps": len(job["job"].get("rerun_steps", [])), "world_size": job["job"].get("world_size"),
        "action": moved.get("action"), "replacement": (moved.get("detail") or {}).get("replacement"),
        "boundary_step": boundary, "stall_s": round(stall, 3) if stall is not None else None,
        "median_step_s": round(step, 4) if step is not None else None,
        "group_rebuild_s": round(rebuild, 3) if rebuild is not None else None,
        "target_s": round(step + rebuild, 3) if step is not None and rebuild is not None else None,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[float | None]) -> float | None:
        got = [v for v in values if v is not None]
        return round(statistics.median(got), 3) if got else None

    mttrs = [r["mttr_s"] for r in runs if r["mttr_s"] is not None]
    return {
        "runs": len(runs), "ok": sum(r["exit_code"] == 0 for r in runs),
        "phases": {p: med([r["phases"].get(p) for r in runs]) for p in PHASES},
        "mttr_s": med([r["mttr_s"] for r in runs]),
        "mttr_min_s": min(mttrs, default=None), "mttr_max_s": max(mttrs, default=None),
        "mttr_without_node_wait_s": med([r["mttr_without_node_wait_s"] for r in runs]),
        "lost_steps": max((r["lost_steps"] for r in runs), default=0),
        "world_size_after": runs[-1]["world_size"] if runs else None,
        **{f"{k}_{how}": v for k in ("step_s_before", "step_s_after")
           for how, v in _spread([r.get(k) for r in runs]).items()},
        **({k: med([r[k] for r in runs]) for k in ("stall_s", "median_step_s", "group_rebuild_s", "target_s")}
           if runs and "stall_s" in runs[0] else {}),
    }


def _spread(values: list[float | None]) -> dict[str, float | None]:
    """The median, min and max of ``values`` (None ones left out)."""
    got = [v for v in values if v is not None]
    return {"median": round(statistics.median(got), 4) if got else None,
            "min": min(got, default=None), "max": max(got, default=None)}


def render(result: dict[str, Any]) -> str:
    lines = [f"node loss on test hosts, {result['machine']}, {result['date']}: 2 nodes x 2 ranks, steps >= "
             f"{result['args']['step_seconds']}s, heartbeat timeout {result['args']['heartbeat_timeout']}s, node-wait "
             f"{result['args']['node_wait']}s, spares {result['args']['spares']}; medians of "
             f"{result['args']['repeats']}"]
    header = f"{'scenario':<17}" + "".join(f"{p[:14]:>15}" for p in PHASES) + f"{'-node-wait':>12}{'lost':>6}{'ranks':>6}"
    lines.append(header)
    for name, s in result["scenarios"].items():
        cells = "".join(f"{s['phases'][p] if s['phases'][p] is not None else '-':>15}" for p in PHASES)
        lines.append(f"{name:<17}{cells}{s['mttr_without_node_wait_s'] or '-':>12}{s['lost_steps']:>6}"
                     f"{s['world_size_after']:>6}  ({s['ok']}/{s['runs']} ok)")
    lines.append("seconds from the fault (the SIGKILL of the host, or the join); first_step_done is the MTTR")
    for name, s in result["scenarios"].items():
        lines.append(f"{name}: MTTR median {s['mttr_s']}, min {s['mttr_min_s']}, max {s['mttr_max_s']} "
                     f"({s['runs']} runs); step time before {s.get('step_s_before_median')} s "
                     f"({s.get('step_s_before_min')}-{s.get('step_s_before_max')}), after "
                     f"{s.get('step_s_after_median')} s ({s.get('step_s_after_min')}-{s.get('step_s_after_max')})")
    scenarios = result["scenarios"]
    if "migrate" in scenarios:
        m = scenarios["migrate"]
        lines.append(f"migrate: stall (boundary commit to the next) median {m['stall_s']} s; target (a step "
                     f"{m['median_step_s']} s + the group rebuild {m['group_rebuild_s']} s) {m['target_s']} s")
    if "replace" in scenarios and "standby" in scenarios and scenarios["standby"]["mttr_s"]:
        cold, warm = scenarios["replace"]["mttr_s"], scenarios["standby"]["mttr_s"]
        lines.append(f"standby vs replace (a cold host): MTTR {warm} s vs {cold} s, {cold / warm:.1f}x faster"
                     if cold else "")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of " + ", ".join(SCENARIOS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--at-step", type=int, default=15, help="the fault once the job passed this step")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--step-seconds", type=float, default=0.1,
                   help="every step lasts at least this long (0: as fast as it runs, to measure step time)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="samples per rank per step (per virtual rank in the invariant scenarios)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--node-wait", type=float, default=5.0)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (the text on stderr)")
    p.add_argument("--keep", default="", metavar="DIR", help="keep the jobs' dirs and logs here")
    args = p.parse_args(argv)
    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"bench/regroup.py: {reason}", file=sys.stderr)
        return 2
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        p.error(f"--scenarios: unknown {unknown}; choose from {', '.join(SCENARIOS)}")
    started, machine = time.strftime("%Y-%m-%d %H:%M"), _machine()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="undying-bench-regroup-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        # Interleaved (one of each scenario, then again): a load that changes meanwhile hits every scenario alike.
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
        for _ in range(args.repeats):
            for s in scenarios:
                runs[s].append(run_migrate(args, root) if s == "migrate" else run_once(s, args, root))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result = {"date": f"{started} to {time.strftime('%H:%M')}", "machine": f"{machine}; at the end {_machine()}",
              "args": vars(args),
              "scenarios": {s: summarize(r) for s, r in runs.items()}, "runs": runs}
    text = render(result)
    print(text, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0


def _machine() -> str:
    import os
    import platform

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPU {platform.machine()}, load average {load}"


if __name__ == "__main__":
    sys.exit(main())
