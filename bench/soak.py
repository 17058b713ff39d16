"""Soak: one long seeded job under a stream of random real faults, then the oracle.

Method
------
The demo job (4 ranks, gloo on CPU) runs under ``undying run`` with one warm
spare, short detection limits (``--heartbeat-timeout`` and ``--step-timeout``,
2 s each) and ``--max-restarts`` 3. A driver injects faults through the job's
HTTP API, one scenario at a time: it arms the scenario a few steps ahead of
the job, waits until every incident it caused is recovered (or failed), and
goes on until ``--faults`` faults were injected. The scenarios, drawn with a
seeded RNG:

* crash: SIGKILL of a rank, at the start of a step, in forward, in backward's
  gradient all-reduce or in the optimizer step;
* hang (stop): SIGSTOP of a rank (missing heartbeats);
* hang (spin) / hang (block): the rank's training thread loops or blocks
  forever in forward or backward while the process lives and beats (missing
  progress: the step timeout);
* comm-error: the rank breaks its process group's connections (retry in place);
* overlap (two at once): two ranks crash at the same step;
* overlap (during recovery): a rank crashes, and another hangs (SIGSTOP) as it
  starts recovering from it;
* overlap (replacement dies): a rank crashes, and its replacement crashes once
  it has joined;
* spare (stopped): the warm spare is SIGSTOPped, then a rank crashes: the agent
  must give up on the spare within its take timeout and recover through a cold
  start, never waiting out the init timeout;
* spare (killed): the warm spare is SIGKILLed: the agent must start a new one
  (the scenario waits until a spare with another PID is ready).

The faulted job also saves a checkpoint every ``SAVE_EVERY`` steps into a
folder on a small tmpfs (root only; ``--fill-mb 0`` or not root: a plain folder).
A third of the way through the faults the driver fills that tmpfs to the last
byte and frees it again at two thirds: the saves in between must fail as
``checkpoint_failed`` incidents while training goes on, and the saves after it
must succeed again.

Then the same job runs fault-free and the two are compared step by step
(``undying.demo.oracle``): every per-step loss identical, no step completed twice,
the final states equal. Reported: faults injected and recovered, per incident
kind the median and p95 recovery time (fault to the first step every rank
completed after the recovery), and the scenarios that ended otherwise.

Run it from the repository root::

    python bench/soak.py                  # 100 faults, text report
    python bench/soak.py --faults 20 --json

It asserts nothing; it reports. Every process started is stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery import (  # noqa: E402  (bench/ is a folder of scripts)
    Workload,
    bench_env,
    interrupt,
    launch,
    stop,
    undying_worker_pids,
    wait_for,
)

from undying.cli.client import api_get, api_post  # noqa: E402
from undying.demo import TRAIN_SCRIPT  # noqa: E402
from undying.demo.oracle import compare_runs, load_run  # noqa: E402
from undying.errors import JobNotRunningError, UsageError  # noqa: E402
from undying.manager.jobdir import JobDir  # noqa: E402

RANKS = 4
LIMIT_S = 2.0
STEP_PHASES = ("step", "forward", "backward", "optimizer")
# (scenario, weight): single faults most of the time, overlaps one time in five.
SCENARIOS = (
    ("crash", 4), ("hang-stop", 2), ("hang-spin", 1), ("hang-block", 1), ("comm-error", 3),
    ("overlap-two-at-once", 1), ("overlap-during-recovery", 1), ("overlap-replacement-dies", 1),
    ("spare-stop", 1), ("spare-kill", 1),
)
# Incidents that are told, not recovered: a failed save leaves the job training, the incident stays as a record.
TOLD = ("checkpoint_failed",)
SAVE_EVERY = 64


@dataclass(frozen=True)
class Injection:
    kind: str
    rank: int
    phase: str
    how: str | None = None
    offset: int = 0  # steps after the scenario's base step ("rejoin" and "recovery" use 1)


def plan(scenario: str, rng: random.Random) -> list[Injection]:
    a, b = rng.sample(range(RANKS), 2)
    if scenario == "crash":
        return [Injection("crash", a, rng.choice(STEP_PHASES))]
    if scenario.startswith("hang-"):
        how = scenario.removeprefix("hang-")
        phase = "step" if how == "stop" else rng.choice(("forward", "backward"))
        return [Injection("hang", a, phase, how=how)]
    if scenario == "comm-error":
        return [Injection("comm-error", a, rng.choice(("forward", "backward")))]
    if scenario == "overlap-two-at-once":
        return [Injection("crash", a, "backward"), Injection("crash", b, "backward")]
    if scenario == "overlap-during-recovery":
        return [Injection("crash", a, "backward"), Injection("hang", b, "recovery", how="stop", offset=-10**6)]
    if scenario == "overlap-replacement-dies":
        return [Injection("crash", a, "forward"), Injection("crash", a, "rejoin", offset=-10**6)]
    if scenario == "spare-stop":  # the spare is stopped by the driver first; then a crash needs a replacement
        return [Injection("crash", a, "forward")]
    if scenario == "spare-kill":
        return []
    raise ValueError(scenario)


def spare_pids(job_dir: Path, rank_pids: set[int]) -> list[int]:
    """The job's warm spares: processes of the job (their environment names its folder) that hold no rank.

    A spare started fresh runs ``undying.worker.boot --spare``; one forked by the
    agent's zygote shows the zygote's command line, so it is told by its parent.
    A spare that took a rank keeps its command line, hence the rank PIDs left out.
    """
    marker = f"UNDYING_JOB_DIR={job_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in rank_pids:
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            forked = b"undying.worker.zygote" in Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if b"--spare" in argv or forked:
            found.append(int(entry.name))
    return found


def _ready_spare(url: str, job_dir: Path, deadline: float, not_pid: int = -1) -> int | None:
    """A warm spare's PID once one is ready (other than ``not_pid``), or None by ``deadline``."""
    while time.monotonic() < deadline:
        with contextlib.suppress(JobNotRunningError, UsageError):
            status = _status(url)
            if status["spares_ready"] >= 1:
                ranks = {int(r["pid"]) for r in status["ranks"] if r.get("pid")}
                pids = [p for p in spare_pids(job_dir, ranks) if p != not_pid]
                if pids:
                    return pids[0]
        time.sleep(0.1)
    return None


class FillingFolder:
    """A checkpoint folder on a tmpfs of its own that the driver can fill to the last byte and free again."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True)
        self._ballast = path / "ballast"

    def fill(self) -> None:
        # Unbuffered, and the suppression outside the open: ENOSPC, from a write or the close, ends it.
        for chunk in (1 << 20, 4096):  # megabytes, then the last partial megabyte
            with contextlib.suppress(OSError), open(self._ballast, "ab", buffering=0) as f:
                while True:
                    f.write(b"\0" * chunk)

    def free(self) -> None:
        self._ballast.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


def _status(url: str) -> dict[str, Any]:
    return api_get(url, "/api/status")


def drive(url: str, args: argparse.Namespace, total_steps: int, log: Any, job_dir: Path,
          filler: FillingFolder | None) -> list[dict[str, Any]]:
    """Inject scenarios until ``args.faults`` faults are in; returns what was injected."""
    rng = random.Random(args.seed)
    names = [name for name, _ in SCENARIOS]
    weights = [w for _, w in SCENARIOS]
    injected: list[dict[str, Any]] = []
    count = 0
    while count < args.faults:
        try:
            status = _status(url)
        except JobNotRunningError:  # it ended between two looks: report what was injected
            print(f"soak: the job ended after {count} faults", file=log)
            break
        if status["state"] in ("succeeded", "failed", "stopped", "stopping"):
            print(f"soak: the job ended ({status['state']}) after {count} faults", file=log)
            break
        if status["state"] != "running" or any(i["status"] == "open" and i["kind"] not in TOLD
                                                for i in status["incidents"]):
            time.sleep(0.1)
            continue
        if filler is not None and count >= args.faults // 3 and not any(s.get("disk") == "filled" for s in injected):
            filler.fill()
            injected.append({"scenario": "disk", "disk": "filled", "t": time.time(), "step": status["step"],
                             "faults": 0})
            print(f"soak: checkpoint folder filled at step {status['step']}", file=log, flush=True)
        if filler is not None and count >= 2 * args.faults // 3 and not any(s.get("disk") == "freed" for s in injected):
            filler.free()
            injected.append({"scenario": "disk", "disk": "freed", "t": time.time(), "step": status["step"],
                             "faults": 0})
            print(f"soak: checkpoint folder freed at step {status['step']}", file=log, flush=True)
        base = status["step"] + 3
        if base > total_steps - 10:
            print(f"soak: the job is near its end (step {status['step']}); {count} faults", file=log)
            break
        scenario = rng.choices(names, weights)[0]
        before = len(status["incidents"])
        t = time.time()
        faults = plan(scenario, rng)
        extra: dict[str, Any] = {}
        if scenario.startswith("spare-"):
            spare = _ready_spare(url, job_dir, time.monotonic() + 60)
            if spare is None:
                print("soak: no warm spare within 60 s; scenario skipped", file=log, flush=True)
                continue
            os.kill(spare, signal.SIGSTOP if scenario == "spare-stop" else signal.SIGKILL)
            count += 1
            extra["spare_pid"] = spare
            if scenario == "spare-kill":
                extra["spare_replaced"] = _ready_spare(url, job_dir, time.monotonic() + 60, not_pid=spare) is not None
        for injection in faults:
            at_step = max(1, base + injection.offset)
            api_post(url, "/api/inject", {"kind": injection.kind, "rank": injection.rank,
                                          "at_step": at_step, "phase": injection.phase, "how": injection.how})
            count += 1
        injected.append({"scenario": scenario, "t": t, "base_step": base,
                         "faults": len(faults) + scenario.startswith("spare-"), **extra})
        if faults:  # a killed spare makes no incident: its scenario waited for the new spare above
            _wait_recovered(url, before, deadline=time.monotonic() + 90)
        print(f"soak: [{count}/{args.faults}] {scenario} at step {base}", file=log, flush=True)
    return injected


def _wait_recovered(url: str, before: int, deadline: float) -> None:
    """Until the scenario's incidents exist and none is open (or the job ended)."""
    while time.monotonic() < deadline:
        try:
            status = _status(url)
        except JobNotRunningError:
            return
        incidents = [i for i in status["incidents"][before:] if i["kind"] not in TOLD]
        if status["state"] in ("succeeded", "failed", "stopped"):
            return
        if incidents and all(i["status"] != "open" for i in incidents) and status["state"] == "running":
            time.sleep(0.3)  # a second fault of the scenario may still be on its way
            status = _status(url)
            if all(i["status"] != "open" for i in status["incidents"][before:] if i["kind"] not in TOLD) \
                    and status["state"] == "running":
                return
        time.sleep(0.1)


def run_job(workload: Workload, run_dir: Path, args: argparse.Namespace, log: Any,
            with_faults: bool) -> tuple[int, list[dict[str, Any]]]:
    job_dir = run_dir / "job"
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = run_dir / "checkpoints"
    filler = FillingFolder(checkpoints, args.fill_mb) if with_faults and args.fill_mb else None
    argv = [sys.executable, "-m", "undying", "run", "-n", str(RANKS), "--port", "0",
            "--job-dir", str(job_dir), "--job-id", run_dir.name, "--spares", "1" if with_faults else "0",
            "--heartbeat-timeout", str(LIMIT_S), "--step-timeout", str(LIMIT_S),
            "--checkpoint-dir", str(checkpoints), "--save-every", str(SAVE_EVERY),
            "--max-restarts", "3", "--stop-grace", "3", str(TRAIN_SCRIPT), *workload.script_args()]
    process = launch(argv, bench_env(), run_dir / "launcher.log")
    injected: list[dict[str, Any]] = []
    try:
        if with_faults:
            deadline = time.monotonic() + 60
            url = None
            while url is None and time.monotonic() < deadline:
                info = JobDir(job_dir).read_manager()
                if info is not None:
                    try:
                        if _status(info["url"])["spares_ready"] >= 1:
                            url = info["url"]
                    except (JobNotRunningError, UsageError):
                        pass
                time.sleep(0.1)
            if url is None:
                raise RuntimeError(f"the job did not come up with a warm spare; see {run_dir / 'launcher.log'}")
            injected = drive(url, args, workload.total_steps, log, job_dir, filler)
        return wait_for(process, time.monotonic() + args.timeout), injected
    finally:
        stop(process, lambda: undying_worker_pids(job_dir / "events.db"), str(TRAIN_SCRIPT))
        for pid in spare_pids(job_dir, set()):  # a stopped spare the agent did not reap is ours to end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if filler is not None:
            filler.close()


def leaked_processes(job_dir: Path) -> list[int]:
    """Processes still alive that belong to the job (workers and spares carry its dir in their environment)."""
    marker = f"UNDYING_JOB_DIR={job_dir}".encode()
    leaked = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                leaked.append(int(entry.name))
        except OSError:
            continue
    return leaked


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(faulty_dir: Path, baseline_dir: Path, injected: list[dict[str, Any]],
              returncode: int) -> dict[str, Any]:
    faulty = load_run(faulty_dir / "job" / "events.db")
    baseline = load_run(baseline_dir / "job" / "events.db")
    comparison = compare_runs(baseline, faulty)
    by_kind: dict[str, list[float]] = defaultdict(list)
    statuses = Counter(i["status"] for i in faulty.incidents)
    actions = Counter(f"{i['kind']}:{i['action']}" for i in faulty.incidents)
    for incident in faulty.incidents:
        if incident["status"] == "recovered" and incident.get("mttr_s") is not None:
            replacement = incident.get("detail", {}).get("replacement")
            how = {"warm spare": " (warm spare)", "new process": " (new process)"}.get(replacement, "")
            by_kind[incident["kind"] + how].append(incident["mttr_s"])
    rounds = Counter(i.get("recovery") for i in faulty.incidents if i["kind"] not in TOLD)
    overlapped = sum(1 for n in rounds.values() if n > 1)
    return {
        "scenarios": sum(1 for s in injected if s["scenario"] != "disk"),
        "scenario_counts": dict(Counter(s["scenario"] for s in injected)),
        "incidents": len(faulty.incidents),
        "incident_status": dict(statuses),
        "incident_actions": dict(actions),
        "recovery_rounds_with_several_incidents": overlapped,
        "recovery_s_by_kind": {
            kind: {"n": len(v), "median": round(statistics.median(v), 3), "p95": round(percentile(v, 0.95), 3),
                   "max": round(max(v), 3)}
            for kind, v in sorted(by_kind.items())
        },
        "checkpoint_failed": sum(1 for i in faulty.incidents if i["kind"] == "checkpoint_failed"),
        "spares_killed_and_replaced": sum(1 for s in injected if s.get("spare_replaced")),
        "spares_killed": sum(1 for s in injected if s["scenario"] == "spare-kill"),
        "disk": [{k: s[k] for k in ("disk", "step")} for s in injected if s["scenario"] == "disk"],
        "job_state": faulty.state,
        "returncode": returncode,
        "identical": comparison.identical,
        "steps": comparison.steps,
        "lost_steps": comparison.lost_steps,
        "reasons": comparison.reasons,
    }


def render(result: dict[str, Any], out: Any) -> None:
    print(f"soak: {result['faults_injected']} faults in {result['scenarios']} scenarios "
          f"({result['scenario_counts']})", file=out)
    print(f"  incidents: {result['incidents']} {result['incident_status']}; actions {result['incident_actions']}; "
          f"recovery rounds that handled several: {result['recovery_rounds_with_several_incidents']}", file=out)
    print(f"  spares killed {result['spares_killed']}, a new one ready after "
          f"{result['spares_killed_and_replaced']}; checkpoint folder {result['disk']}: "
          f"{result['checkpoint_failed']} checkpoint_failed incidents", file=out)
    for kind, s in result["recovery_s_by_kind"].items():
        print(f"  {kind:<26} n={s['n']:<3} median {s['median']:.2f} s  p95 {s['p95']:.2f} s  max {s['max']:.2f} s",
              file=out)
    print(f"  job {result['job_state']} (exit {result['returncode']}); {result['steps']} steps; losses identical: "
          f"{result['identical']}; lost steps: {result['lost_steps']}; wall {result['wall_s']:.0f} s "
          f"(fault-free {result['baseline_wall_s']:.0f} s)", file=out)
    print(f"  processes left behind: {len(result['leaked_processes'])} {result['leaked_processes'] or ''}", file=out)
    for reason in result["reasons"]:
        print(f"  ! {reason}", file=out)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, interrupt)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=100, help="faults to inject (an overlap counts its faults)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    p.add_argument("--epochs", type=int, default=40, help="epochs of the demo job (128 steps each)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    p.add_argument("--keep", default=None, help="keep the runs' folders here")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout; the report on stderr")
    p.add_argument("--fill-mb", type=int, default=16 if os.geteuid() == 0 else 0,
                   help="size of the tmpfs the faulted job checkpoints to, filled and freed during the run "
                        "(root only; 0: a plain folder that never fills)")
    args = p.parse_args(argv)
    workload = Workload(epochs=args.epochs, samples=8192, features=32, hidden=64, layers=2, batch_size=16)
    out = sys.stderr if args.json else sys.stdout
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="undying-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rc, injected = run_job(workload, root / "faulty", args, out, with_faults=True)
    wall = time.monotonic() - started
    started = time.monotonic()
    baseline_rc, _ = run_job(workload, root / "baseline", args, out, with_faults=False)
    baseline_wall = time.monotonic() - started
    result = summarize(root / "faulty", root / "baseline", injected, rc)
    result["leaked_processes"] = leaked_processes(root / "faulty" / "job") + leaked_processes(root / "baseline" / "job")
    result.update({
        "date": time.strftime("%Y-%m-%d"),
        "faults_injected": sum(s["faults"] for s in injected),
        "seed": args.seed, "workload": vars(workload), "total_steps": workload.total_steps,
        "wall_s": round(wall, 1), "baseline_wall_s": round(baseline_wall, 1), "baseline_returncode": baseline_rc,
        "limits_s": {"heartbeat": LIMIT_S, "step": LIMIT_S}, "runs": str(root),
    })
    render(result, out)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
