"""Soak: long seeded jobs under a stream of random real faults, then the oracle.

Two soaks: the single-node one (below) and the multi-node one (bench/soak_multi.py:
2 nodes x 2 ranks on network-namespace hosts). Each fault kind is named in
bench/soak_plan.py; ``--kinds`` limits a run to some of them (only the soaks
that run one of them start).

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

And the faults of undying's own processes (issue #25; bench/soak_own.py), each
given 30 s:

* zygote-kill: SIGKILL of the agent's zygote (the fork server). Recovered: no
  incident, every rank the same process, a new zygote, the job 3 steps on.
* zygote-stop: SIGSTOP of the zygote, then a rank crashes. Recovered: exactly
  that crash, seen within 1 s (the incident's ``detected`` phase) and recovered
  while the zygote stays stopped; then SIGCONT.
* launcher-hup: SIGHUP to the launcher's process group (a closed terminal, a
  dropped ssh session). A planned end: exit 75 after a dying gasp, and the
  driver relaunches the same command at once (as a scheduler requeues it);
  passed when the relaunch resumed at the newest step every rank committed
  (nothing re-run).
* verifier-kill: SIGKILL of the ``--verify-every`` verifier (the job then runs
  with ``--verify-every 32``). Recovered: a new verifier, no incident.
* rank-leave: a rank exits 0 while the others go on, ``sys.exit(0)`` inside a
  step or its loop returning (bench/soak_train.py, the demo job with a switch
  for it). Recovered: a ``left-early`` incident, recovered as a crash is.

A job that ends otherwise (failed, or exit 0 before its last step) is
relaunched too, at most ``--relaunches`` times, so the other kinds still run;
the scenario before it is counted failed. The oracle merges every launch's log.

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

    python bench/soak.py                  # both soaks, 200 + 100 faults, text report
    python bench/soak.py --faults 20 --json
    python bench/soak.py --kinds zygote-kill --faults 3

Every scenario's outcome (recovered, planned-end, failed, with why) is in the
report per kind. It asserts nothing; it reports, and exits 1 when the soak did
not hold. Every process started is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery import Workload, interrupt  # noqa: E402  (bench/ is a folder of scripts)
from soak_own import job_processes, verifier_pids  # noqa: E402
from soak_plan import MULTI, SINGLE, faults_of, kind, schedule, soaks_of  # noqa: E402
from soak_report import holds, outcomes_by_kind, render_outcomes  # noqa: E402
from soak_single import LIMIT_S, TOLD, epochs_for, run_baseline, run_faulty  # noqa: E402

from undying.config import EXIT_PREEMPTED  # noqa: E402
from undying.demo.oracle import RunRecord, compare_runs, load_run, merge_runs  # noqa: E402

DEFAULT_FAULTS = {"single": 200, "multi": 100}


def launch_logs(job_dir: Path) -> list[Path]:
    """Every launch's event log, oldest first (the older ones archived as events.<time>.db at each start)."""
    return [*sorted(job_dir.glob("events.*.db"), key=lambda p: p.stat().st_mtime), job_dir / "events.db"]


def load_launches(job_dir: Path) -> RunRecord:
    """Every launch of the job as one record (the older logs were archived as events.<time>.db at each start)."""
    first, *later = launch_logs(job_dir)
    record = load_run(first)
    for path in later:
        record = merge_runs(record, load_run(path))
    return record


def leaked_processes(job_dir: Path) -> list[int]:
    """Processes still alive that belong to the job (workers, spares and the zygote carry its dir in their
    environment, a verifier its folder in the job dir)."""
    return sorted({*job_processes(job_dir), *verifier_pids(job_dir)})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(faulty_dir: Path, baseline_dir: Path, injected: list[dict[str, Any]],
              returncode: int) -> dict[str, Any]:
    faulty = load_launches(faulty_dir / "job")
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
        "outcomes": outcomes_by_kind(injected),
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
    for kind_, s in result["recovery_s_by_kind"].items():
        print(f"  {kind_:<26} n={s['n']:<3} median {s['median']:.2f} s  p95 {s['p95']:.2f} s  max {s['max']:.2f} s",
              file=out)
    print(f"  job {result['job_state']} (exit {result['returncode']}); {result['steps']} steps; losses identical: "
          f"{result['identical']}; lost steps: {result['lost_steps']}; wall {result['wall_s']:.0f} s "
          f"(fault-free {result['baseline_wall_s']:.0f} s)", file=out)
    print(f"  launches: {result['launches']}", file=out)
    print(f"  processes left behind: {len(result['leaked_processes'])} {result['leaked_processes'] or ''}", file=out)
    render_outcomes(result["outcomes"], out)
    for reason in result["reasons"]:
        print(f"  ! {reason}", file=out)


def soak_single(deck: list[str], args: argparse.Namespace, root: Path, out: Any) -> dict[str, Any]:
    workload = Workload(epochs=args.epochs or epochs_for(len(deck)), samples=8192, features=32, hidden=64, layers=2,
                        batch_size=16)
    verify = "verifier-kill" in deck
    started = time.monotonic()
    rc, injected, job = run_faulty(workload, root / "faulty", deck, args, out)
    wall = time.monotonic() - started
    started = time.monotonic()
    baseline_rc = run_baseline(workload.script_args(), root / "baseline", args, verify)
    baseline_wall = time.monotonic() - started
    result = summarize(root / "faulty", root / "baseline", injected, rc)
    result["leaked_processes"] = leaked_processes(root / "faulty" / "job") + leaked_processes(root / "baseline" / "job")
    result.update({
        "date": time.strftime("%Y-%m-%d"),
        "faults_injected": sum(s["faults"] for s in injected),
        "seed": args.seed, "workload": vars(workload), "total_steps": workload.total_steps,
        "wall_s": round(wall, 1), "baseline_wall_s": round(baseline_wall, 1), "baseline_returncode": baseline_rc,
        "limits_s": {"heartbeat": LIMIT_S, "step": LIMIT_S}, "runs": str(root), "launches": job.launches,
        "scenario_log": injected,
    })
    result["holds"] = holds(result, planned_exits=(EXIT_PREEMPTED,))
    render(result, out)
    return result


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, interrupt)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=None,
                   help=f"faults to inject per soak (an overlap counts its faults; default {DEFAULT_FAULTS})")
    p.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all): "
                   f"single-node {', '.join(SINGLE)}; multi-node {', '.join(MULTI)}")
    p.add_argument("--at-least", type=int, default=20,
                   help="scenarios of each of undying's own kinds, as far as --faults allows")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    p.add_argument("--epochs", type=int, default=0,
                   help="epochs of the single-node job (128 steps each; 0: sized from --faults)")
    p.add_argument("--multi-steps", type=int, default=0,
                   help="steps of the multi-node job (0: sized from --faults, see bench/soak_multi.py)")
    p.add_argument("--relaunches", type=int, default=3, help="relaunches after unplanned ends of the job")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    p.add_argument("--keep", default=None, help="keep the runs' folders here")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout; the report on stderr")
    p.add_argument("--fill-mb", type=int, default=16 if os.geteuid() == 0 else 0,
                   help="size of the tmpfs the faulted job checkpoints to, filled and freed during the run "
                        "(root only; 0: a plain folder that never fills)")
    args = p.parse_args(argv)
    names = [k for k in args.kinds.split(",") if k] or [*SINGLE, *MULTI]
    try:
        soaks = soaks_of(names)
    except ValueError as e:
        p.error(f"--kinds: {e}")
    out = sys.stderr if args.json else sys.stdout
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="undying-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for soak in soaks:
        kinds = [n for n in names if kind(n).soak == soak]
        faults = args.faults or DEFAULT_FAULTS[soak]
        deck = schedule(kinds, faults, args.at_least, random.Random(f"{args.seed}:{soak}"))
        print(f"soak ({soak}): {faults_of(deck)} faults in {len(deck)} scenarios, {dict(Counter(deck))}", file=out,
              flush=True)
        if soak == "single":
            results[soak] = soak_single(deck, args, root / "single", out)
        else:
            from soak_multi import soak_multi

            results[soak] = soak_multi(deck, args, root / "multi", out,
                                       lambda script_args, run_dir: run_baseline(script_args, run_dir, args, False))
    held = all(r.get("holds", False) for r in results.values())
    verdicts = ", ".join(f"{name}: {'held' if r.get('holds') else 'did not hold'}" for name, r in results.items())
    print(f"soak: {'held' if held else 'did NOT hold'} ({verdicts})", file=out)
    if args.json:
        sys.stdout.write(json.dumps({**results, "held": held}) + "\n")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
