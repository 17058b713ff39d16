"""The multi-node soak: faults of undying's own multi-node processes, on network-namespace hosts.

Method
------
The soak's job (bench/soak_train.py: the demo job, 2 nodes x 2 ranks, paced
to ``STEP_S`` a step while faults come) runs on test hosts
(``undying.demo.hosts``, root needed): ``undying manager`` alone on host 0,
node 0's agent on host 1, node 1's on host 2, and a warm standby agent
(``undying run --standby``) parked on host 3; host 4 is free. Heartbeat
timeout ``LIMIT_S``, one warm spare per node. The driver runs the scenarios
of its deck one at a time, each given ``DEADLINE_S`` to recover:

* agent-kill: SIGKILL of a node's agent. Its ranks, zygote and spares must die
  with it (nothing left on its host within 10 s); the node's loss is recovered
  by the standby, or, with none parked, by a new agent the driver starts on a
  free host once the loss is declared (as a scheduler starts a new pod).
* agent-pause: SIGSTOP of a node's agent for 1.5-2.5 heartbeat timeouts, then
  SIGCONT. Recovered: the only incidents are that node's losses, recovered (by
  the standby, or by the agent itself, fenced and rejoined); the continued
  agent declares nothing about its own stall.
* manager-kill: SIGKILL of the manager, 1-3 s without one, then a new manager
  on the same job dir (the scheduler's restart). Recovered: no incident, the
  job 3 steps further.
* manager-pause: SIGSTOP of the manager for 1.5-2.5 heartbeat timeouts, then
  SIGCONT. Recovered: no incident (a judge that was stopped declares no one
  silent), the job 3 steps further.
* standby-kill: SIGKILL of the parked standby. Recovered: no incident, its
  zygote and spares gone with it, the manager no longer lists it; the driver
  then parks a new standby (a scheduler restarting it).

Between scenarios the driver restores the layout: a host whose agent exited is
checked for leftovers (each is counted) and freed; a standby is parked again
(with its warm spares) when none is. After the deck the pacing stops and the
job runs out; the same job's fault-free run (``undying run -n 4``, unpaced: the
losses do not depend on the pacing) is the oracle's baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from soak_plan import PACE_ENV, SOAK_SCRIPT, until
from soak_report import holds, outcomes_by_kind, render_outcomes

from undying.cli.client import api_get
from undying.demo.cluster import Cluster
from undying.demo.hosts import Hosts
from undying.demo.namespaces import netns_unavailable_reason
from undying.demo.oracle import compare_runs, load_run

LIMIT_S = 3.0
STEP_S = 0.25  # the pace while a fault is injected and recovered
IDLE_STEP_S = 1.0  # the pace while the driver restores the layout (a standby warming up): fewer steps spent
DEADLINE_S = 60.0
SCENARIO_STEPS = 60  # steps a scenario spends, its restore included (measured; sizes the job)
SCRIPT_ARGS = ["--samples", "8192", "--features", "32", "--hidden", "64", "--layers", "2", "--batch-size", "16"]
STEPS_PER_EPOCH = 128  # 8192 samples over 4 ranks, 16 a batch
ENDED = ("succeeded", "failed", "stopped")

__all__ = ["soak_multi", "steps_for"]


def steps_for(scenarios: int) -> int:
    """The job's length for a deck: ``SCENARIO_STEPS`` a scenario and a third more as margin, whole epochs."""
    return math.ceil((scenarios * SCENARIO_STEPS * 4 / 3 + 100) / STEPS_PER_EPOCH) * STEPS_PER_EPOCH


class MultiJob:
    """The cluster and which host plays which part: nodes' agents, the parked standby, free hosts."""

    def __init__(self, hosts: Hosts, cluster: Cluster, log: Any, pace: Path) -> None:
        self.hosts, self.cluster, self.log, self.pace_file = hosts, cluster, log, pace
        self.node_host = {0: 1, 1: 2}
        self.standby: int | None = None  # the host of the parked standby
        self.free = [3, 4]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}  # host -> the agent (or standby) started there
        self.logs: dict[int, str] = {}  # host -> the name of its agent's log (Cluster.log)
        self.leftovers: list[dict[str, Any]] = []  # processes found on a host after its agent exited

    def start(self) -> None:
        self.cluster.start()
        self.procs.update({self.node_host[n]: p for n, p in self.cluster.agents.items()})
        self.logs.update({self.node_host[n]: f"node{n}" for n in self.cluster.agents})

    def status(self) -> dict[str, Any]:
        return self.cluster.status()

    def pace(self, seconds: float) -> None:
        tmp = self.pace_file.with_suffix(".tmp")
        tmp.write_text(str(seconds))
        tmp.replace(self.pace_file)

    def look(self) -> dict[str, Any] | None:
        """The status, or None at once when no manager answers (``status`` waits a minute for one)."""
        with contextlib.suppress(Exception), self.hosts.inside(self.cluster.manager_host):
            url = self.cluster.url(timeout=0.5)
            return dict(api_get(url, "/api/status", token=self.cluster.token))
        return None

    def park_standby(self, want: int = 0) -> bool:
        """A standby on a free host, waited for until the manager lists it (with ``want`` warm spares: they warm
        up meanwhile, beside the next scenario, as a restarted pod's would)."""
        host = self.free.pop(0)
        process = self.procs[host] = self.cluster.start_standby(host)
        self.logs[host] = f"standby{host}"
        self.standby = host

        def parked() -> bool | None:
            status = self.look() or {}
            if status.get("state") != "running":
                return None if status else True  # the job ended, or its manager is gone: nothing to wait for
            return any(s["agent_pid"] == process.pid and s["spares_ready"] >= want for s in status.get("standbys", []))

        if until(parked, 120):
            return True
        print(f"soak: the standby on host {host} was not parked (with {want} warm spares) in 120 s", file=self.log,
              flush=True)
        return False

    def settle(self) -> None:
        """Restore the layout: see who holds each node, free the hosts whose agent left, park a standby."""
        status = self.look() or {}
        for node in status.get("nodes", []):
            host = next((h for h, p in self.procs.items() if p.pid == node.get("agent_pid")), None)
            if host is not None and node.get("attached"):
                self.node_host[int(node["node"])] = host
                self.cluster.agents[int(node["node"])] = self.procs[host]
                if host == self.standby:  # the standby took this node
                    self.standby = None
                    self.cluster.standbys.pop(host, None)
        if self.standby is not None and self.procs[self.standby].poll() is not None:
            self.standby = None
        busy = {*self.node_host.values(), *([self.standby] if self.standby is not None else [])}
        for host in range(1, len(self.hosts)):
            if host not in busy and host not in self.free:
                self._free(host)
        if self.standby is None:
            self.pace(IDLE_STEP_S)
            try:
                self.park_standby()
            finally:
                self.pace(STEP_S)

    def _free(self, host: int) -> None:
        """A host whose agent lost its node: its agent exits (fenced) within 20 s, and nothing of it stays."""
        process = self.procs.pop(host, None)
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(20)
        left = self.hosts.pids(host)
        if left:
            self.leftovers.append({"host": host, "pids": left, "t": time.time(), "which": _described(left),
                                   "agent_exit": process.poll() if process is not None else None})
            print(f"soak: host {host}: {len(left)} processes left 20 s after its agent lost its node: "
                  f"{_described(left)}", file=self.log, flush=True)
        self.hosts.kill_host(host)
        self.free.append(host)

    def new_agent(self, node: int) -> None:
        """A new agent for ``node`` on a free host (a scheduler's new pod)."""
        host = self.free.pop(0)
        self.procs[host] = self.cluster.start_agent(node, host)
        self.logs[host] = f"node{node}"
        self.node_host[node] = host


def _kinds(incidents: list[dict[str, Any]]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in Counter(f"{i['kind']}:{i['status']}" for i in incidents).items())


def _settled(job: MultiJob, before: int, want: int, step: int) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Wait until the job runs with at least ``want`` incidents since ``before``, all closed, 3 steps past ``step``."""
    def done() -> dict[str, Any] | None:
        manager = job.cluster.manager
        if manager is not None and manager.poll() is not None:
            return {"gone": manager.returncode}  # the job ended (or its manager died): nothing more comes
        s = job.look()
        if s is None or s["state"] != "running":
            return None
        new = s["incidents"][before:]
        return s if len(new) >= want and all(i["status"] != "open" for i in new) and s["step"] >= step + 3 else None

    status = until(done, DEADLINE_S)
    last = job.look()
    incidents = last["incidents"][before:] if last else []
    if status is not None and "gone" in status:
        return None, incidents + [{"kind": f"(the manager exited {status['gone']})", "status": "-"}]
    return status, incidents


def _verdict(problems: list[str], fine: str, **record: Any) -> dict[str, Any]:
    return {**record, "outcome": "failed" if problems else "recovered", "why": "; ".join(problems) or fine}


def _losses(incidents: list[dict[str, Any]], ranks: set[int]) -> list[str]:
    """What is wrong with a node's loss: incidents other than its ranks' node-loss, or not recovered."""
    bad = [i for i in incidents if i["kind"] != "node-loss" or i["status"] != "recovered" or i["rank"] not in ranks]
    return [f"incidents {_kinds(incidents)}, expected node-loss of ranks {sorted(ranks)} recovered"] if bad else []


def agent_kill(job: MultiJob, rng: random.Random) -> dict[str, Any]:
    node = rng.choice(sorted(job.node_host))
    host, agent = job.node_host[node], job.cluster.agents[node]
    status = job.status()
    ranks = {int(r) for n in status["nodes"] if n["node"] == node for r in n["ranks"]}
    before, step = len(status["incidents"]), status["step"]
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(10)
    job.procs.pop(host, None)
    job.node_host.pop(node)  # until someone holds it again (settle)
    problems = []
    if not until(lambda: not job.hosts.pids(host), 10):
        problems.append(f"processes outlived their agent on host {host}: {job.hosts.pids(host)}")
    declared = until(lambda: any(i["kind"] == "node-loss" for i in (job.look() or {"incidents": []})["incidents"]
                                  [before:]), 20)
    if declared and job.standby is None:
        job.new_agent(node)
    after, incidents = _settled(job, before, len(ranks) or 1, step)
    if after is None:
        problems.append(f"not recovered within {DEADLINE_S:.0f} s ({_kinds(incidents) or 'no incident'})")
    problems += _losses(incidents, ranks) if after is not None else []
    return _verdict(problems, f"node {node}'s loss recovered", node=node)


def agent_pause(job: MultiJob, rng: random.Random) -> dict[str, Any]:
    node = rng.choice(sorted(job.node_host))
    agent = job.cluster.agents[node]
    status = job.status()
    ranks = {int(r) for n in status["nodes"] if n["node"] == node for r in n["ranks"]}
    before, step = len(status["incidents"]), status["step"]
    pause = round(rng.uniform(1.5, 2.5) * LIMIT_S, 2)
    log = job.logs[job.node_host[node]]
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        time.sleep(pause)
    finally:
        seen = len(job.cluster.log(log))
        os.kill(agent.pid, signal.SIGCONT)
    after, incidents = _settled(job, before, 1, step)
    problems = []
    if after is None:
        problems.append(f"not recovered within {DEADLINE_S:.0f} s ({_kinds(incidents) or 'no incident'})")
    else:
        problems += _losses(incidents, ranks)
    # Once continued, the agent declares nothing about its own stall: no rank or spare of its own found silent.
    declared = [line.split("] ", 1)[-1] for line in job.cluster.log(log)[seen:].splitlines()
                if ("silent for" in line or "no progress" in line) and "fenced:" not in line]  # (that one quotes
    # the manager's verdict on this node: its loss, which is this scenario's expected outcome)
    if declared:
        problems.append(f"the continued agent blamed its own stall on others: {declared[0]}"
                        + (f" (and {len(declared) - 1} more)" if len(declared) > 1 else ""))
    return _verdict(problems, f"node {node}'s loss recovered", node=node, pause_s=pause)


def manager_kill(job: MultiJob, rng: random.Random) -> dict[str, Any]:
    status = job.status()
    before, step = len(status["incidents"]), status["step"]
    manager = job.cluster.manager
    assert manager is not None
    gap = round(rng.uniform(1, 3), 2)
    os.kill(manager.pid, signal.SIGKILL)
    manager.wait(10)
    time.sleep(gap)
    job.cluster.start_manager()
    after, incidents = _settled(job, before, 0, step)
    problems = []
    if after is None:
        problems.append(f"the job did not run on within {DEADLINE_S:.0f} s ({_kinds(incidents) or 'no incident'})")
    elif incidents:
        problems.append(f"incidents {_kinds(incidents)}")
    return _verdict(problems, "the new manager carried the job on", gap_s=gap)


def manager_pause(job: MultiJob, rng: random.Random) -> dict[str, Any]:
    status = job.status()
    before, step = len(status["incidents"]), status["step"]
    manager = job.cluster.manager
    assert manager is not None
    pause = round(rng.uniform(1.5, 2.5) * LIMIT_S, 2)
    os.kill(manager.pid, signal.SIGSTOP)
    try:
        time.sleep(pause)
    finally:
        os.kill(manager.pid, signal.SIGCONT)
    time.sleep(LIMIT_S + 1)  # a wrong verdict of silence comes within a heartbeat timeout of the continue
    after, incidents = _settled(job, before, 0, step)
    problems = []
    if after is None:
        problems.append(f"the job did not run on ({_kinds(incidents) or 'no incident'}; "
                        f"{(job.look() or {}).get('state', 'no manager')})")
    elif incidents:
        problems.append(f"incidents {_kinds(incidents)}")
    return _verdict(problems, "no one declared silent", pause_s=pause)


def standby_kill(job: MultiJob, rng: random.Random) -> dict[str, Any]:
    if job.standby is None:
        return {"outcome": "skipped", "why": "no standby parked"}
    host, standby = job.standby, job.cluster.standbys[job.standby]
    status = job.status()
    before, step = len(status["incidents"]), status["step"]
    os.kill(standby.pid, signal.SIGKILL)
    standby.wait(10)
    problems = []
    if not until(lambda: not job.hosts.pids(host), 10):
        problems.append(f"processes outlived the standby on host {host}: {_described(job.hosts.pids(host))}")
    dropped = until(lambda: not any(s["agent_pid"] == standby.pid for s in (job.look() or {}).get("standbys", [])),
                     3 * LIMIT_S + 5)
    if not dropped:
        problems.append("the manager still lists the killed standby")
    after, incidents = _settled(job, before, 0, step)
    if after is None or incidents:
        problems.append(f"incidents {_kinds(incidents)}" if incidents else "the job did not run on")
    return _verdict(problems, "dropped, nothing else", host=host)


def _described(pids: list[int]) -> list[str]:
    """Each process as PID, parent, state and command line: which of the standby's parts outlived it."""
    described = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
        except OSError:
            continue
        described.append(f"{pid} (parent {fields[1]}, state {fields[0]}): {command}")
    return described


SCENARIOS: dict[str, Callable[[MultiJob, random.Random], dict[str, Any]]] = {
    "agent-kill": agent_kill, "agent-pause": agent_pause, "manager-kill": manager_kill,
    "manager-pause": manager_pause, "standby-kill": standby_kill,
}


def drive(job: MultiJob, deck: list[str], seed: int, total_steps: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    injected: list[dict[str, Any]] = []
    for n, scenario in enumerate(deck, 1):
        status = until(lambda: (s := job.look()) and s["state"] in ("running", *ENDED) and
                        all(i["status"] != "open" for i in s["incidents"]) and s, DEADLINE_S)
        if not status or status["state"] != "running":
            print(f"soak: the job is {status['state'] if status else 'gone or stuck'} after {n - 1} scenarios",
                  file=job.log, flush=True)
            if injected and injected[-1]["outcome"] != "failed":
                injected[-1].update(outcome="failed", why=f"{injected[-1]['why']}; then the job ended or hung")
            break
        if status["step"] > total_steps - 50:
            print(f"soak: the job is near its end (step {status['step']}); {n - 1} scenarios", file=job.log)
            break
        t = time.time()
        record: dict[str, Any] = {"scenario": scenario, "t": t, "step": status["step"], "faults": 1,
                                  **SCENARIOS[scenario](job, rng)}
        if record["outcome"] != "skipped" and (job.look() or {}).get("state") == "running":
            job.settle()
        record["s"] = round(time.time() - t, 2)
        injected.append(record)
        print(f"soak: [{n}/{len(deck)}] {scenario} at step {status['step']}: {record['outcome']} "
              f"({record['why']}; {record['s']:.0f} s)", file=job.log, flush=True)
    return injected


def soak_multi(deck: list[str], args: argparse.Namespace, root: Path, out: Any,
               baseline: Callable[[list[str], Path], int]) -> dict[str, Any]:
    """Run the multi-node soak on ``deck``; ``baseline(script_args, run_dir)`` runs the fault-free job."""
    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"soak (multi): not run: {reason}", file=out)
        return {"not_run": reason, "holds": False}
    total = args.multi_steps or steps_for(len(deck))
    script_args = [*SCRIPT_ARGS, "--epochs", str(math.ceil(total / STEPS_PER_EPOCH))]
    root.mkdir(parents=True, exist_ok=True)
    pace = root / "pace"
    pace.write_text(str(IDLE_STEP_S))
    saved = {k: os.environ.get(k) for k in (PACE_ENV, "OMP_NUM_THREADS")}
    os.environ.update({PACE_ENV: str(pace), "OMP_NUM_THREADS": "1"})
    hosts = Hosts(5)
    cluster = Cluster(hosts, root, "faulty", script_args, script=SOAK_SCRIPT,
                      run_args=["--heartbeat-timeout", str(LIMIT_S), "--spares", "1", "--rendezvous-timeout", "60"])
    job = MultiJob(hosts, cluster, out, pace)
    started = time.monotonic()
    injected: list[dict[str, Any]] = []
    code, leaked = 124, []
    try:
        job.start()
        cluster.wait_for_step(5, timeout=180)
        job.park_standby(want=2)  # the first one warm: the soak starts from the steady state
        job.pace(STEP_S)
        injected = drive(job, deck, args.seed, total)
        job.pace(0)  # the faults are in: the job runs out at full speed
        with contextlib.suppress(TimeoutError):
            code = cluster.wait(args.timeout)
        leaked = [p for h in range(len(hosts)) for p in hosts.pids(h)]
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        cluster.close()
        with contextlib.suppress(RuntimeError):
            hosts.close()
    wall = time.monotonic() - started
    started = time.monotonic()
    baseline_rc = baseline(script_args, root / "baseline")
    baseline_wall = time.monotonic() - started
    faulty = load_run(cluster.job_dir / "events.db")
    comparison = compare_runs(load_run(root / "baseline" / "job" / "events.db"), faulty)
    mttr = [i["mttr_s"] for i in faulty.incidents if i["status"] == "recovered" and i.get("mttr_s") is not None]
    result = {
        "date": time.strftime("%Y-%m-%d"), "seed": args.seed, "scenarios": len(injected),
        "faults_injected": sum(r["faults"] for r in injected if r["outcome"] != "skipped"),
        "scenario_counts": dict(Counter(r["scenario"] for r in injected)), "outcomes": outcomes_by_kind(injected),
        "incidents": len(faulty.incidents), "incident_status": dict(Counter(i["status"] for i in faulty.incidents)),
        "node_loss_mttr_s": {"n": len(mttr), "median": round(statistics.median(mttr), 3)} if mttr else None,
        "job_state": faulty.state, "returncode": code, "identical": comparison.identical, "steps": comparison.steps,
        "lost_steps": comparison.lost_steps, "reasons": comparison.reasons,
        "leaked_processes": leaked + [p for left in job.leftovers for p in left["pids"]],
        "leftovers": job.leftovers, "wall_s": round(wall, 1), "baseline_wall_s": round(baseline_wall, 1),
        "baseline_returncode": baseline_rc, "limits_s": {"heartbeat": LIMIT_S, "step_pace": STEP_S},
        "total_steps": total, "runs": str(root), "scenario_log": injected,
    }
    result["holds"] = holds(result)
    render(result, out)
    return result


def render(result: dict[str, Any], out: Any) -> None:
    print(f"soak (multi): {result['faults_injected']} faults in {result['scenarios']} scenarios "
          f"({result['scenario_counts']})", file=out)
    print(f"  incidents: {result['incidents']} {result['incident_status']}; recovery (node loss) "
          f"{result['node_loss_mttr_s']}", file=out)
    print(f"  job {result['job_state']} (exit {result['returncode']}); {result['steps']} steps; losses identical: "
          f"{result['identical']}; lost steps: {result['lost_steps']}; wall {result['wall_s']:.0f} s "
          f"(fault-free {result['baseline_wall_s']:.0f} s)", file=out)
    print(f"  processes left behind: {len(result['leaked_processes'])} {result['leaked_processes'] or ''}", file=out)
    render_outcomes(result["outcomes"], out)
    for reason in result["reasons"]:
        print(f"  ! {reason}", file=out)


if __name__ == "__main__":
    sys.exit("run bench/soak.py --kinds with multi-node kinds")
