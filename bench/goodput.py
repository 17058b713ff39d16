"""Goodput side by side: one interruption schedule replayed against undying and torchrun.

Method
------
One workload, the demo job (recovery.py's, small and paced: a step lasts at least
``--step-seconds``), on ``--ranks`` ranks for ``--minutes`` of fault-free training
(steps = minutes x 60 / step seconds, rounded up to whole epochs of 100 steps).
One seeded schedule (bench/goodput_plan.py) of interruptions in the Llama 3 405B
mix, one every ``--mtbi`` seconds of training on average, each at a step: crashes
(hardware and software), comm errors and hangs (network), bit flips (silent data
corruption) and preemptions (planned). Five runs, in this order:

1. reference: the plain DDP script (bench/plain_ddp.py) under torchrun, no
   checkpoint, no fault: the fault-free wall time of the steps;
2. torchrun fault-free: the same with its checkpoints (Young's interval);
3. undying fault-free: ``undying run`` with one warm spare and ``--verify-every``;
4. torchrun with the schedule: the plain script does each fault to itself at its
   step, once (plain_ddp.py's ``--faults``); ``--max-restarts`` is the number of
   interruptions (it never gives up); a hang ends when its peers' collective times
   out (``--hang-timeout``, passed as the process group's timeout); a preemption is
   a planned stop with notice (rank 0 checkpoints, every rank exits 0) and the
   driver launches the job again; a bit flip goes unnoticed;
5. undying with the schedule: the driver arms each fault through the job's API a
   few steps ahead (crash: SIGKILL at the step; comm-error: the rank's connections
   broken in forward; hang: SIGSTOP, found by missing heartbeats after
   ``--heartbeat-timeout`` = ``--hang-timeout``; bitflip: ``grad-finite`` on the
   rank and step a verification replays), and preempts by SIGTERM to the launcher's
   process group at the step, then launches the same command again.

Reported per system: wall time under faults (every launch's, summed), goodput =
reference wall time / wall time under faults (so a slowed step, a checkpoint and
a restart all count against it), goodput against its own fault-free run, steps
lost (completed, then run again), and for undying the manager's own goodput
accounting (every launch's log, its losses by cause). An undetected bit flip
counts twice: goodput as timed (the flip harmless), and ``goodput_sdc`` with every
step from the flip to the end counted lost (trained on a corrupted state: a
checkpoint saved after it keeps it). The ratio undying / torchrun is printed.

Run it from the repository root::

    python bench/goodput.py --minutes 30 --json --out /tmp/goodput   # the issue's run (~3 h)
    python bench/goodput.py --minutes 3 --mtbi 20 --hang-timeout 10  # a short validation

It reports and asserts nothing. Every process started is stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from goodput_plan import (  # noqa: E402
    LLAMA3,
    MIX,
    Fault,
    checkpoint_every,
    goodput,
    schedule,
    verified_step,
)
from recovery import (  # noqa: E402  (bench/ is a folder of scripts)
    PLAIN_SCRIPT,
    Commit,
    Workload,
    bench_env,
    interrupt,
    launch,
    lost_steps,
    plain_worker_pids,
    publish,
    read_plain_records,
    stop,
    wait_for,
    work_root,
)
from soak import launch_logs, load_launches  # noqa: E402
from soak_plan import SOAK_SCRIPT  # noqa: E402
from soak_single import SingleJob  # noqa: E402

from undying.cli.client import api_post  # noqa: E402
from undying.cli.summary import logged_account  # noqa: E402
from undying.demo.oracle import (  # noqa: E402
    compare_runs,
    final_losses,
    load_run,
    rolled_back_steps,
)
from undying.errors import JobNotRunningError, UsageError  # noqa: E402
from undying.jobfiles.events import read_job  # noqa: E402

STEPS_PER_EPOCH = 100
ARM_LEAD = 3  # steps ahead of the job a fault is armed
# The driver asks the job's step (a status call to its manager) only as often as the distance to
# the next fault needs: half the least time the steps left can take, within these bounds. Asked
# every 50 ms for the whole run, the calls cost the launcher about 1 s of CPU in 25 and slowed
# the steps by about 0.3% (bench runs of 2026-12-01: 101.69 against 101.40 ms a step), a load on
# undying's faulted run alone, which neither its fault-free run nor torchrun's runs carry.
POLL_MIN_S, POLL_MAX_S = 0.05, 10.0
SKIPPABLE = ("torchrun_fault_free", "undying_fault_free", "torchrun")  # --skip
UNDYING_FAULT = {  # the schedule's kinds as the injection API takes them
    "crash-hw": {"kind": "crash", "phase": "step"},
    "crash-sw": {"kind": "crash", "phase": "step"},
    "comm-error": {"kind": "comm-error", "phase": "forward"},
    "hang": {"kind": "hang", "phase": "step", "how": "stop"},
    "bitflip": {"kind": "bitflip", "how": "grad-finite"},
}


def workload_for(args: argparse.Namespace) -> Workload:
    steps = math.ceil(args.minutes * 60 / args.step_seconds / STEPS_PER_EPOCH) * STEPS_PER_EPOCH
    return Workload(steps // STEPS_PER_EPOCH, args.ranks * args.batch_size * STEPS_PER_EPOCH,
                    args.features, args.hidden, args.layers, args.batch_size, ranks=args.ranks,
                    step_seconds=args.step_seconds)


def save_cost_s(workload: Workload, repeats: int = 5) -> float:
    """The plain script's checkpoint save (its model, optimizer with momentum, scheduler;
    fsynced), timed here: the median of ``repeats``."""
    import torch
    from plain_ddp import build_model, save_checkpoint
    model = build_model(argparse.Namespace(features=workload.features, hidden=workload.hidden,
                                           layers=workload.layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    model(torch.randn(4, workload.features)).sum().backward()
    optimizer.step()
    times = []
    with tempfile.TemporaryDirectory(prefix="undying-bench-save-") as folder:
        for _ in range(repeats):
            started = time.perf_counter()
            save_checkpoint(Path(folder) / "c.pt", 1, model, optimizer, scheduler)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


# --- torchrun + the plain script -----------------------------------------------------------


def run_plain(workload: Workload, run_dir: Path, every: int, faults: list[Fault] | None,
              args: argparse.Namespace) -> dict[str, Any]:
    """The plain script under torchrun, launched again after each planned stop; its figures."""
    run_dir.mkdir(parents=True)
    extra = []
    if faults is not None:
        (run_dir / "faults.json").write_text(json.dumps([f.to_dict() for f in faults]))
        extra = ["--faults", str(run_dir / "faults.json")]
    restarts = len(faults or []) + 1
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(workload.ranks), "--max-restarts", str(restarts), "--monitor-interval", "0.1",
            str(PLAIN_SCRIPT), *workload.script_args(), "--run-dir", str(run_dir),
            "--checkpoint-every", str(every), "--collective-timeout", str(args.hang_timeout),
            *extra]
    deadline = time.monotonic() + args.run_timeout
    wall, launches = 0.0, []
    for n in range(1 + sum(1 for f in faults or [] if f.kind == "preempt")):
        env = bench_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", BENCH_LAUNCH=str(n))
        started = time.monotonic()
        process = launch(argv, env, run_dir / f"torchrun-{n}.log")
        try:
            rc = wait_for(process, deadline)
        finally:
            stop(process, lambda: plain_worker_pids(run_dir), str(PLAIN_SCRIPT))
        wall += time.monotonic() - started
        launches.append(rc)
        if rc != 0 or (run_dir / "done.json").exists():
            break
    records = read_plain_records(run_dir)
    commits = [Commit(r["rank"], r["step"], r["attempt"], r["t"])
               for r in records if r["event"] == "step"]
    fired = []
    for path in run_dir.glob("faults.rank*.jsonl"):
        fired += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    flips = [f["step"] for f in fired if f["kind"] == "bitflip"]
    return {"wall_s": round(wall, 3), "launches": launches,
            "done": (run_dir / "done.json").exists(),
            "steps_done": len({c.step for c in commits}), "lost_steps": lost_steps(commits),
            "faults_fired": len({f["i"] for f in fired}),
            "untrusted_steps": workload.total_steps - min(flips) + 1 if flips else 0}


# --- undying -------------------------------------------------------------------------------


def undying_argv(workload: Workload, run_dir: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "undying", "run", "-n", str(workload.ranks), "--port", "0",
            "--job-dir", str(run_dir / "job"), "--job-id", run_dir.name, "--spares", "1",
            "--heartbeat-timeout", str(args.hang_timeout), "--verify-every", str(args.verify_every),
            "--stop-grace", "3", str(SOAK_SCRIPT), *workload.script_args()]


def run_undying(workload: Workload, run_dir: Path, faults: list[Fault] | None,
                args: argparse.Namespace, log: TextIO) -> dict[str, Any]:
    """``undying run`` of the demo job, the schedule's faults armed through its API."""
    run_dir.mkdir(parents=True)
    job = SingleJob(undying_argv(workload, run_dir, args), bench_env(), run_dir, log)
    deadline = time.monotonic() + args.run_timeout
    started = time.monotonic()
    armed: list[dict[str, Any]] = []
    try:
        job.start()
        for fault in faults or []:
            armed.append(_arm(job, fault, deadline, (args.verify_every, workload.ranks), log,
                              args.step_seconds))
        rc = job.wait(max(1.0, deadline - time.monotonic()))
        while rc == 75 and time.monotonic() < deadline and job.relaunch(f"exit {rc}"):
            rc = job.wait(max(1.0, deadline - time.monotonic()))  # a preemption at the very end
    finally:
        job.end()
    wall = time.monotonic() - started
    return {"wall_s": round(wall, 3), "launches": [x["rc"] for x in job.launches],
            "armed": armed, **undying_figures(run_dir / "job")}


def _step(job: SingleJob) -> int:
    with contextlib.suppress(JobNotRunningError, UsageError, OSError, KeyError):
        return int(job.status()["step"])
    return -1


def poll_interval(steps_left: int, step_seconds: float) -> float:
    """How long the driver waits before it asks the job's step again: half the least time
    ``steps_left`` steps can take (a step lasts at least ``step_seconds``), within
    [POLL_MIN_S, POLL_MAX_S]; so the fault is still armed ahead of its step."""
    return min(POLL_MAX_S, max(POLL_MIN_S, steps_left * step_seconds / 2))


def _arm(job: SingleJob, fault: Fault, deadline: float, verify: tuple[int, int],
         log: TextIO, step_seconds: float) -> dict[str, Any]:
    """Wait for the job to come near ``fault.step``, then arm it (a preemption: do it).

    ``verify``: (``--verify-every``, world size), to move a bitflip that could not be armed at
    its step to the next step a verification replays on the rank it replays."""
    lead = 0 if fault.kind == "preempt" else ARM_LEAD
    step = -1
    while time.monotonic() < deadline and job.process is not None and job.process.poll() is None:
        step = _step(job)
        if step >= fault.step - lead:
            break
        time.sleep(poll_interval(fault.step - lead - step, step_seconds))
    if fault.kind == "preempt":
        assert job.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.process.pid, signal.SIGTERM)
        rc = wait_for(job.process, time.monotonic() + 60)
        job.launches[-1]["rc"] = rc
        ok = job.relaunch(f"preempted at step {step} (exit {rc})")
        return {**fault.to_dict(), "at": step, "rc": rc, "relaunched": ok}
    body = {**UNDYING_FAULT[fault.kind], "rank": fault.rank}
    at = fault.step
    while time.monotonic() < deadline and job.process is not None and job.process.poll() is None:
        try:
            api_post(job.url, "/api/inject", {**body, "at_step": at})
            return {**fault.to_dict(), "armed_at": at}
        except UsageError as e:  # a recovery under way, or the step passed: a moment, then later
            print(f"goodput: arming {fault} at {at}: {e}", file=log, flush=True)
            time.sleep(0.5)
            at = max(at, _step(job) + 2)
            if fault.kind == "bitflip":  # only a verified step's flip is findable
                at, body["rank"] = verified_step(at, *verify)
    return {**fault.to_dict(), "armed_at": None}


def undying_figures(job_dir: Path) -> dict[str, Any]:
    """Every launch's log: steps, steps re-run, incidents, and the manager's goodput account."""
    logs = sorted(job_dir.glob("events.*.db"), key=lambda p: p.stat().st_mtime)
    logs.append(job_dir / "events.db")
    commits, incidents = [], []
    goodput_s = wall_s = 0.0
    losses: dict[str, float] = {}
    for n, path in enumerate(p for p in logs if p.exists()):
        job = read_job(path)
        commits += [Commit(s["rank"], s["step"], 1000 * n + s["generation"], s["t"])
                    for s in job["steps"]]
        incidents += [i["kind"] for i in job["incidents"]]
        account = logged_account(path).goodput
        goodput_s += account.goodput_s
        wall_s += account.wall_s
        for name, seconds in account.losses.items():
            losses[name] = round(losses.get(name, 0.0) + seconds, 3)
    return {"steps_done": len({c.step for c in commits}), "lost_steps": lost_steps(commits),
            "incidents": {k: incidents.count(k) for k in sorted(set(incidents))},
            "manager_goodput": {"ratio": round(goodput_s / wall_s, 4) if wall_s else None,
                                "goodput_s": round(goodput_s, 3), "wall_s": round(wall_s, 3),
                                "losses": {k: v for k, v in losses.items() if v}}}


# --- the benchmark -------------------------------------------------------------------------


def run_all(args: argparse.Namespace, root: Path, log: TextIO) -> dict[str, Any]:
    workload = workload_for(args)
    training_s = workload.total_steps * args.step_seconds
    count = max(1, round(training_s / args.mtbi))
    faults = schedule(count, workload.total_steps, workload.ranks, random.Random(args.seed),
                      verify_every=args.verify_every, every_kind=not args.mix_only)
    cost = save_cost_s(workload)
    every = checkpoint_every(cost, training_s / count, args.step_seconds)
    print(f"goodput: {workload.total_steps} steps on {workload.ranks} ranks (~{training_s / 60:.1f} "
          f"min paced), {count} interruptions, save {1000 * cost:.1f} ms -> torchrun checkpoints "
          f"every {every} steps", file=log, flush=True)
    runs: dict[str, dict[str, Any]] = {}
    plan = [("reference", "plain", 0, None), ("torchrun_fault_free", "plain", every, None),
            ("undying_fault_free", "undying", 0, None), ("torchrun", "plain", every, faults),
            ("undying", "undying", 0, faults)]
    plan = [p for p in plan if p[0] not in args.skip]
    for name, system, ckpt, schedule_ in plan:
        print(f"goodput: {name} ...", end=" ", file=log, flush=True)
        load = os.getloadavg()[0]
        if system == "plain":
            run = run_plain(workload, root / name, ckpt, schedule_, args)
        else:
            run = run_undying(workload, root / name, schedule_, args, log)
        run["load_1min"] = round(load, 2)
        runs[name] = run
        print(f"{run['wall_s']:.1f} s, launches {run['launches']}", file=log, flush=True)
    runs["undying"]["oracle"] = (
        oracle(root / "undying" / "job", root / "undying_fault_free" / "job")
        if "undying_fault_free" in runs else {"not_run": "undying's fault-free run was skipped"})
    return report(args, workload, faults, cost, every, runs)


def oracle(faulty: Path, fault_free: Path) -> dict[str, Any]:
    """undying's oracle across the faulty job's launches, against its fault-free run.

    ``identical``: every execution of every step logged the fault-free loss and
    no step ran twice (``compare_runs``, strict). A bit flip's roll-back breaks
    that by design: the steps after the flip ran on the corrupt state, logged
    other losses, and were run again. ``identical_after_rollbacks`` judges the
    run that stands: each step's last loss on every rank is the fault-free one,
    the final states are equal, nothing is missing, and every step run twice is
    one an ``sdc`` roll-back re-ran.
    """
    try:
        baseline = load_run(fault_free / "events.db")
        run = load_launches(faulty)
        c = compare_runs(baseline, run)
        losses, disagree = final_losses(launch_logs(faulty))
    except (OSError, ValueError, KeyError) as e:
        return {"error": str(e)}
    rolled = rolled_back_steps(run.incidents)
    unaccounted = sorted(set(run.rerun_steps) - rolled)
    missing = sorted(s for s in baseline.losses if s not in losses)
    differ = sorted(s for s in baseline.losses if s in losses and losses[s] != baseline.losses[s])
    return {"identical": c.identical, "reasons": c.reasons[:4],
            "identical_after_rollbacks": (not disagree and not missing and not differ
                                          and c.digests_equal and not unaccounted),
            "digests_equal": c.digests_equal, "rolled_back_steps": len(rolled),
            "missing_steps": missing[:10], "final_losses_differ": differ[:10],
            "ranks_disagree": disagree[:10], "reruns_not_rolled_back": unaccounted[:10]}


def report(args: argparse.Namespace, workload: Workload, faults: list[Fault], cost: float,
           every: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    reference = runs["reference"]["wall_s"]
    total = workload.total_steps
    systems: dict[str, dict[str, Any] | None] = {"torchrun": None}
    for name in ("torchrun", "undying"):
        if name not in runs:
            continue
        run, own = runs[name], runs.get(f"{name}_fault_free")
        systems[name] = {
            "wall_s": run["wall_s"], "fault_free_wall_s": None if own is None else own["wall_s"],
            "goodput": _r(goodput(reference, run["wall_s"])),
            "goodput_vs_own_fault_free": None if own is None else _r(goodput(own["wall_s"],
                                                                             run["wall_s"])),
            "goodput_sdc": _r(goodput(reference, run["wall_s"], total_steps=total,
                                      untrusted_steps=run.get("untrusted_steps", 0))),
            "lost_steps": run["lost_steps"], "finished": run["steps_done"] == total,
        }
    t, u = systems["torchrun"], systems["undying"]
    training_s = total * args.step_seconds
    return {
        "job": {"ranks": workload.ranks, "steps": total, "step_seconds": args.step_seconds,
                "minutes": round(training_s / 60, 2), "hidden": workload.hidden,
                "layers": workload.layers, "batch_size": workload.batch_size, "seed": args.seed},
        "interruptions": {"count": len(faults), "mtbi_s": round(training_s / len(faults), 2),
                          "kinds": {k: sum(1 for f in faults if f.kind == k) for k in MIX},
                          "llama3": LLAMA3, "mix": MIX, "every_kind": not args.mix_only,
                          "schedule": [f.to_dict() for f in faults]},
        "torchrun_settings": {"max_restarts": len(faults) + 1, "collective_timeout_s":
                              args.hang_timeout, "save_cost_s": round(cost, 5),
                              "checkpoint_every_steps": every,
                              "young_interval_s": round(every * args.step_seconds, 3),
                              "bit_flip": "undetected; goodput_sdc counts every step from it lost"},
        "undying_settings": {"spares": 1, "heartbeat_timeout_s": args.hang_timeout,
                             "verify_every": args.verify_every},
        "reference_wall_s": reference,
        "torchrun": t, "undying": u,
        "ratio_goodput": (_r(u["goodput"] / t["goodput"]) if u and t and u["goodput"]
                          and t["goodput"] else None),
        "runs": runs,
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def render(result: dict[str, Any], out: TextIO) -> None:
    j, i, ts = result["job"], result["interruptions"], result["torchrun_settings"]
    print(f"\njob: {j['ranks']} ranks, {j['steps']} steps paced to {j['step_seconds']} s "
          f"({j['minutes']} min of training); {i['count']} interruptions, one every "
          f"{i['mtbi_s']} s of training on average: {i['kinds']}", file=out)
    print(f"torchrun: --max-restarts {ts['max_restarts']}, collective timeout "
          f"{ts['collective_timeout_s']} s, checkpoint every {ts['checkpoint_every_steps']} steps "
          f"(Young: save {1000 * ts['save_cost_s']:.1f} ms, interval {ts['young_interval_s']} s); "
          f"bit flip: {ts['bit_flip']}", file=out)
    print(f"reference (plain DDP, no checkpoint, no fault): {result['reference_wall_s']:.1f} s",
          file=out)
    rows = [("wall time under faults (s)", "wall_s", "{:.1f}"),
            ("wall time fault-free (s)", "fault_free_wall_s", "{:.1f}"),
            ("goodput (reference / under faults)", "goodput", "{:.3f}"),
            ("goodput, a bit flip's steps lost", "goodput_sdc", "{:.3f}"),
            ("goodput against its own fault-free", "goodput_vs_own_fault_free", "{:.3f}"),
            ("steps lost (completed, then re-run)", "lost_steps", "{:d}"),
            ("ran every step", "finished", "{}")]
    print(f"\n{'':40} {'torchrun':>10} {'undying':>10}", file=out)
    for label, key, fmt in rows:
        cells = ["-" if result[s] is None or result[s][key] is None
                 else fmt.format(result[s][key]) for s in ("torchrun", "undying")]
        print(f"{label:40} {cells[0]:>10} {cells[1]:>10}", file=out)
    mg = result["runs"]["undying"].get("manager_goodput", {})
    print(f"\nundying's own account: goodput {mg.get('ratio')}, losses (s) {mg.get('losses')}; "
          f"incidents {result['runs']['undying'].get('incidents')}", file=out)
    print(f"undying's oracle against its fault-free run: {result['runs']['undying'].get('oracle')}",
          file=out)
    print(f"ratio of goodputs undying / torchrun: {result['ratio_goodput']}", file=out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Goodput: one interruption schedule, undying vs "
                                "torchrun + checkpoints",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="fault-free training time")
    p.add_argument("--mtbi", type=float, default=60.0,
                   help="mean seconds of training between interruptions")
    p.add_argument("--step-seconds", type=float, default=0.1, help="a step lasts at least this")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--verify-every", type=int, default=20, help="undying's --verify-every")
    p.add_argument("--hang-timeout", type=float, default=30.0,
                   help="undying's --heartbeat-timeout and torchrun's collective timeout")
    p.add_argument("--seed", type=int, default=405)
    p.add_argument("--mix-only", action="store_true",
                   help="the mix's shares only (default: every kind at least once)")
    p.add_argument("--no-torchrun-fault-free", action="store_true",
                   help="skip torchrun's fault-free run (a fifth of the bench's time): it feeds "
                   "only torchrun's goodput against its own fault-free run (= --skip "
                   "torchrun_fault_free)")
    p.add_argument("--skip", default="", metavar="RUNS",
                   help="comma-separated runs to leave out, of " + ", ".join(SKIPPABLE) + ": "
                   "undying_fault_free feeds undying's oracle and its goodput against its own "
                   "fault-free run; torchrun, every torchrun column. The reference and undying's "
                   "faulted run always run")
    p.add_argument("--run-timeout", type=float, default=None,
                   help="seconds for one run (default: 3 x the training time + 10 min)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout, the report on stderr")
    p.add_argument("--out", type=Path, default=None, help="keep every run's logs and records here")
    args = p.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60 or args.mtbi <= 0 or args.step_seconds <= 0:
        p.error("--minutes must be in (0, 1440], --mtbi and --step-seconds positive")
    if not 2 <= args.ranks <= 64:
        p.error(f"--ranks {args.ranks}: give 2 to 64")
    if args.hang_timeout <= 0:
        p.error("--hang-timeout must be positive")
    if args.run_timeout is None:
        args.run_timeout = 3 * args.minutes * 60 + 600
    skip = {name for name in args.skip.split(",") if name}
    if skip - set(SKIPPABLE):
        p.error(f"--skip {args.skip}: give runs of {', '.join(SKIPPABLE)}")
    args.skip = skip | ({"torchrun_fault_free"} if args.no_torchrun_fault_free else set())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    text = sys.stderr if args.json else sys.stdout
    try:
        with work_root(args.out, "undying-bench-goodput-") as root:
            result = run_all(args, root, sys.stderr)
    except ValueError as e:
        print(f"goodput: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a launch that did not come up (soak_single.SingleJob.start)
        print(f"goodput: {e}; every process started was stopped", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; every process started was stopped", file=sys.stderr)
        return 130
    render(result, text)
    publish(result, args.out, args.json, text, "logs and records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
