"""Recovery benchmark: undying against torchrun with checkpoints, one rank SIGKILLed at step S.

Method
------
One workload, the demo job (``undying/demo/train.py``: a seeded regression MLP
with dropout, SGD with momentum, StepLR, DDP over gloo on CPU, 4 ranks; sized by
``--hidden``, ``--layers``, ``--samples`` and ``--batch-size`` so that a step
takes 50-200 ms), runs under two systems:

* torchrun: ``torchrun --standalone --nproc-per-node 4 --max-restarts 3
  --monitor-interval 0.1 bench/plain_ddp.py``, the same job as a plain DDP script
  (no undying import) whose rank 0 saves a checkpoint every K steps
  (``--checkpoint-every``). After a failure torchrun stops every worker and starts
  all four again; they resume from the latest checkpoint.
* undying: ``undying run -n 4`` on the demo script itself; no checkpoints.

Each repetition runs each system twice, fault-free and with the fault, in the
order torchrun, undying, torchrun with the fault, undying with the fault. The
fault is a SIGKILL of rank R (``--kill-rank``) at the start of step S
(``--kill-step``): for undying through its injection API (phase ``step``), for
the plain script by the rank killing itself on its first attempt, after logging
the time. Every step completed by every rank is recorded with its wall-clock
time (undying's event log; the plain script's per-rank JSON lines), and each
completion belongs to a generation (undying) or restart attempt (torchrun).
From those records:

* recovery time: from the kill until every rank has completed its first step
  after the recovery (its first step in a later generation or attempt). For
  undying with the manager's phase breakdown; for torchrun: every new worker has
  started (Python and torch loaded), the process group is up and the checkpoint
  loaded, the first step is done.
* catch-up time: from the kill until every rank has completed step S again, i.e.
  the job is back where it was; for torchrun this includes re-running the steps
  since its last checkpoint.
* lost steps: steps that some rank completed more than once (completed before the
  kill and run again after it). The step in flight at the kill never completed,
  so it is not lost.
* wall time: launcher start to exit, fault-free and with the fault; the
  difference is what the fault cost the job.
* steady-state step time: done(s) is when the last rank completed step s; the
  step times are done(s) - done(s-1) for consecutive steps of the same generation
  or attempt, skipping the first ``--warmup`` steps of each (so no step around a
  fault counts); the median of each fault-free run. The overhead is undying's
  over plain DDP's (torchrun, no fault), minus 1.

Every figure printed is the median over ``--repeats`` repetitions. A benchmark
reports numbers; it asserts nothing. Workers get ``OMP_NUM_THREADS=1`` under both
systems. torchrun gets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the store
shared between its rendezvous and the workers (the default since torch 2.5), a
restarted gloo worker can read a dead peer's address left by the previous
attempt and fail to connect (pytorch/pytorch#135712), which turns one fault into
a failed job.

Run it from the repository root::

    python bench/recovery.py                # 3 repetitions, text report
    python bench/recovery.py --repeats 1 --json

With ``--json`` the text report goes to stderr and stdout holds one JSON object.
Every process started is stopped on exit, Ctrl-C and SIGTERM included: the
launcher's process group with SIGTERM then SIGKILL, and any worker it left with
SIGKILL, by the PIDs the runs recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from undying.cli.client import api_post
from undying.demo import TRAIN_SCRIPT
from undying.demo.oracle import compare_runs, load_run
from undying.errors import UsageError
from undying.jobfiles.events import read_job
from undying.jobfiles.jobdir import JobDir

# One token for every job a benchmark starts (they inherit it, and ensure_token takes it), so the
# API calls below, which know only a URL, are let in. Set before any job starts; a user's own wins.
os.environ.setdefault("UNDYING_TOKEN", __import__("secrets").token_urlsafe(32))

BENCH_DIR = Path(__file__).resolve().parent
PLAIN_SCRIPT = BENCH_DIR / "plain_ddp.py"
RANKS = 4
STOP_GRACE_S = 15.0
UNDYING_PHASES = ("detected", "decided", "replacement_ready", "group_rebuilt", "state_restored",
                  "first_step_done")
TORCHRUN_PHASES = ("workers_started", "group_ready", "first_step_done")
TARGET_RECOVERY_RATIO = 0.25
TARGET_OVERHEAD_PCT = 3.0
SYSTEMS = ("torchrun", "undying")


# --- what runs -------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The demo script's arguments; both systems run exactly this job."""

    epochs: int
    samples: int
    features: int
    hidden: int
    layers: int
    batch_size: int
    ranks: int = RANKS
    step_seconds: float = 0.0  # a step lasts at least this (a sleep after its work; 0: no pacing)

    def script_args(self) -> list[str]:
        pace = ["--step-seconds", str(self.step_seconds)] if self.step_seconds > 0 else []
        return ["--epochs", str(self.epochs), "--samples", str(self.samples),
                "--features", str(self.features), "--hidden", str(self.hidden),
                "--layers", str(self.layers), "--batch-size", str(self.batch_size), *pace]

    @property
    def steps_per_epoch(self) -> int:  # DistributedSampler pads to equal shards
        return math.ceil(math.ceil(self.samples / self.ranks) / self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int


@dataclass(frozen=True)
class Commit:
    """A rank completed a step, in a generation (undying) or restart attempt (torchrun)."""

    rank: int
    step: int
    attempt: int
    t: float


@dataclass
class Run:
    system: str
    faulty: bool
    rc: int
    wall_s: float
    commits: list[Commit]
    fault_t: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds since the fault
    extra: dict[str, Any] = field(default_factory=dict)
    events_db: Path | None = None


# --- processes -------------------------------------------------------------------


def bench_env(**overrides: str) -> dict[str, str]:
    """The environment of a measured job: one thread per process, and Python's compiled modules
    written and reused, as a pip install leaves them.

    With PYTHONDONTWRITEBYTECODE set over an environment installed without compiling
    (``pip install --no-compile``), every process compiled torch from source on import: a job's
    start took 8-10 s instead of 2.1-2.3 s (2026-12-01), in undying's zygote, its verifier and
    each torchrun rank alike, so a bench's start-up figures measured the environment.
    """
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(overrides)
    return env


def launch(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start a launcher in its own process group, its output to ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(process: subprocess.Popen[bytes], worker_pids: Callable[[], Iterable[int]],
         marker: str) -> list[int]:
    """Stop the launcher's group (SIGTERM, then SIGKILL) and SIGKILL any worker it left.

    Workers run in sessions of their own under both launchers, so they are found
    by the PIDs the run recorded; ``marker`` (the script's path) must be in a
    PID's command line, so a reused PID is never touched. Returns the PIDs killed.
    """
    if process.poll() is None:
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_GRACE_S)
    killed = []
    for pid in worker_pids():
        if _runs(pid, marker):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _runs(pid: int, marker: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and marker in cmdline


def wait_for(process: subprocess.Popen[bytes], deadline: float) -> int:
    """The exit code, or 124 (as timeout(1)) if the deadline passes first."""
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return 124


# --- torchrun + plain DDP --------------------------------------------------------


def run_torchrun(workload: Workload, fault: Fault | None, run_dir: Path, checkpoint_every: int,
                 timeout_s: float) -> Run:
    run_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(workload.ranks), "--max-restarts", "3", "--monitor-interval", "0.1",
            str(PLAIN_SCRIPT), *workload.script_args(), "--run-dir", str(run_dir),
            "--checkpoint-every", str(checkpoint_every)]
    if fault is not None:
        argv += ["--kill-at-step", str(fault.step), "--kill-rank", str(fault.rank)]
    env = bench_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    started = time.monotonic()
    process = launch(argv, env, run_dir / "torchrun.log")
    try:
        rc = wait_for(process, started + timeout_s)
        wall_s = time.monotonic() - started
    finally:
        leftovers = stop(process, lambda: plain_worker_pids(run_dir), str(PLAIN_SCRIPT))
    records = read_plain_records(run_dir)
    commits = [Commit(r["rank"], r["step"], r["attempt"], r["t"])
               for r in records if r["event"] == "step"]
    kill_file = run_dir / "kill.json"
    fault_t = json.loads(kill_file.read_text())["t"] if kill_file.exists() else None
    run = Run("torchrun", fault is not None, rc, wall_s, commits, fault_t,
              extra={"leftover_workers_killed": leftovers})
    if fault_t is not None:
        run.phases = torchrun_phases(records, commits, fault_t, workload.ranks)
    return run


def read_plain_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every JSON line of ``steps.rank<R>.jsonl``, with its ``rank``."""
    records = []
    for path in sorted(run_dir.glob("steps.rank*.jsonl")):
        rank = int(path.name.removeprefix("steps.rank").removesuffix(".jsonl"))
        for line in path.read_text().splitlines():
            if line.strip():
                records.append({**json.loads(line), "rank": rank})
    return records


def plain_worker_pids(run_dir: Path) -> list[int]:
    return [r["pid"] for r in read_plain_records(run_dir) if r["event"] == "start"]


def torchrun_phases(records: list[dict[str, Any]], commits: list[Commit],
                    fault_t: float, ranks: int = RANKS) -> dict[str, float]:
    """Seconds from the kill until every rank of the first restart reached each point."""
    fault_attempt = attempt_at(commits, fault_t)
    restarts = [r["attempt"] for r in records if r["attempt"] > fault_attempt]
    if not restarts:
        return {}
    attempt = min(restarts)
    phases = {}
    for name, event in (("workers_started", "start"), ("group_ready", "ready")):
        times = [r["t"] for r in records if r["attempt"] == attempt and r["event"] == event]
        if len(times) == ranks:
            phases[name] = max(times) - fault_t
    recovery = recovery_s(commits, fault_t, ranks)
    if recovery is not None:
        phases["first_step_done"] = recovery
    return phases


# --- undying ---------------------------------------------------------------------


def run_undying(workload: Workload, fault: Fault | None, run_dir: Path, timeout_s: float,
                spares: int = 1) -> Run:
    run_dir.mkdir(parents=True)
    job_dir = run_dir / "job"
    argv = [sys.executable, "-m", "undying", "run", "-n", str(workload.ranks), "--port", "0",
            "--job-dir", str(job_dir), "--job-id", run_dir.name, "--stop-grace", "3",
            "--spares", str(spares),
            str(TRAIN_SCRIPT), *workload.script_args()]
    events_db = job_dir / "events.db"
    started = time.monotonic()
    deadline = started + timeout_s
    process = launch(argv, bench_env(), run_dir / "undying.log")
    injected = False
    try:
        if fault is not None:
            injected = inject_when_up(JobDir(job_dir), process, fault, deadline)
        rc = wait_for(process, deadline)
        wall_s = time.monotonic() - started
    finally:
        leftovers = stop(process, lambda: undying_worker_pids(events_db), str(TRAIN_SCRIPT))
    run = Run("undying", fault is not None, rc, wall_s, [], events_db=events_db,
              extra={"leftover_workers_killed": leftovers})
    if fault is not None:
        run.extra["injected"] = injected
    if not events_db.exists():
        return run
    job = read_job(events_db)
    run.commits = [Commit(s["rank"], s["step"], s["generation"], s["t"]) for s in job["steps"]]
    run.extra["rerun_steps"] = job["job"].get("rerun_steps")
    crashes = [i for i in job["incidents"] if i["kind"] == "crash"]
    if crashes:
        incident = crashes[0]
        run.fault_t = incident["fault_t"]
        run.phases = dict(incident["phases"])
        run.extra.update(mttr_s=incident["mttr_s"], action=incident["action"],
                         status=incident["status"], incidents=len(job["incidents"]),
                         replacement=incident["detail"].get("replacement"))
    return run


def inject_when_up(job_dir: JobDir, process: subprocess.Popen[bytes], fault: Fault,
                   deadline: float) -> bool:
    """Arm the crash through the manager's API as soon as it answers; False if it never did."""
    while time.monotonic() < deadline and process.poll() is None:
        info = job_dir.read_manager()
        if info is not None:
            try:
                api_post(info["url"], "/api/inject",
                         {"kind": "crash", "rank": fault.rank, "at_step": fault.step,
                          "phase": "step"})
                return True
            except UsageError as e:  # also JobNotRunningError: the job ended meanwhile
                print(f"injection failed: {e}", file=sys.stderr)
                return False
        time.sleep(0.05)
    return False


def undying_worker_pids(events_db: Path) -> list[int]:
    if not events_db.exists():
        return []
    try:
        db = sqlite3.connect(f"file:{events_db}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT data FROM events WHERE kind = 'spawned'").fetchall()
        finally:
            db.close()
    except sqlite3.Error:
        return []
    return [json.loads(data)["pid"] for (data,) in rows]


def losses_identical(fault_free: Run, faulty: Run) -> bool | None:
    """undying's own oracle: every per-step loss equal with and without the fault."""
    if fault_free.events_db is None or faulty.events_db is None:
        return None
    if not (fault_free.events_db.exists() and faulty.events_db.exists()):
        return None
    return compare_runs(load_run(fault_free.events_db), load_run(faulty.events_db)).identical


# --- measures from the records ---------------------------------------------------


def attempt_at(commits: list[Commit], t: float) -> int:
    """The generation/attempt the job was in at time ``t`` (its latest commit before it)."""
    return max((c.attempt for c in commits if c.t <= t), default=0)


def recovery_s(commits: list[Commit], fault_t: float, ranks: int = RANKS) -> float | None:
    """From the fault until every rank completed its first step in a later generation/attempt."""
    fault_attempt = attempt_at(commits, fault_t)
    first: dict[int, float] = {}
    for c in commits:
        if c.attempt > fault_attempt:
            first[c.rank] = min(first.get(c.rank, math.inf), c.t)
    return max(first.values()) - fault_t if len(first) == ranks else None


def catch_up_s(commits: list[Commit], fault_t: float, fault_step: int,
               ranks: int = RANKS) -> float | None:
    """From the fault until every rank completed the step it was killed in."""
    fault_attempt = attempt_at(commits, fault_t)
    done = {c.rank: c.t for c in commits if c.attempt > fault_attempt and c.step == fault_step}
    return max(done.values()) - fault_t if len(done) == ranks else None


def lost_steps(commits: list[Commit]) -> int:
    """Steps that some rank completed more than once."""
    seen: dict[tuple[int, int], int] = defaultdict(int)
    for c in commits:
        seen[(c.rank, c.step)] += 1
    return len({step for (_, step), n in seen.items() if n > 1})


def step_times(commits: list[Commit], warmup: int, ranks: int = RANKS) -> list[float]:
    """done(s) - done(s-1) within each generation/attempt, past its first ``warmup`` steps."""
    done: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in commits:
        done[c.attempt][c.step].append(c.t)
    durations = []
    for steps in done.values():
        full = {s: max(ts) for s, ts in steps.items() if len(ts) == ranks}
        for s in sorted(full)[warmup:]:
            if s - 1 in full:
                durations.append(full[s] - full[s - 1])
    return durations


def run_metrics(run: Run, fault: Fault, warmup: int, ranks: int = RANKS) -> dict[str, Any]:
    """One run's figures (times in seconds, step time in milliseconds)."""
    times = step_times(run.commits, warmup, ranks)
    metrics: dict[str, Any] = {
        "rc": run.rc,
        "wall_s": round(run.wall_s, 3),
        "steps_done": len({c.step for c in run.commits}),
        "step_ms": round(1000 * statistics.median(times), 2) if times else None,
        **run.extra,
    }
    if run.faulty:
        fault_t = run.fault_t
        metrics.update(
            fault_seen=fault_t is not None,
            recovery_s=None if fault_t is None else _round(recovery_s(run.commits, fault_t, ranks)),
            catch_up_s=None if fault_t is None else _round(
                catch_up_s(run.commits, fault_t, fault.step, ranks)),
            lost_steps=lost_steps(run.commits),
            phases={k: round(v, 4) for k, v in run.phases.items()},
        )
    return metrics


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def summarize(system: str, reps: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the repetitions of one system's fault-free and faulty runs."""
    free = [r["fault_free"] for r in reps]
    faulty = [r["with_fault"] for r in reps]
    phase_names = UNDYING_PHASES if system == "undying" else TORCHRUN_PHASES
    summary: dict[str, Any] = {
        "recovery_s": median(f["recovery_s"] for f in faulty),
        "recovery_s_each": [f["recovery_s"] for f in faulty],
        "phases": {p: median(f["phases"].get(p) for f in faulty) for p in phase_names},
        "catch_up_s": median(f["catch_up_s"] for f in faulty),
        "lost_steps": median(f["lost_steps"] for f in faulty),
        "lost_steps_max": max(f["lost_steps"] for f in faulty),
        "step_ms": median(r["step_ms"] for r in free),
        "step_ms_each": [r["step_ms"] for r in free],
        "wall_fault_free_s": median(r["wall_s"] for r in free),
        "wall_with_fault_s": median(f["wall_s"] for f in faulty),
        "fault_wall_cost_s": median(f["wall_s"] - r["wall_s"]
                                    for r, f in zip(free, faulty, strict=True)),
        "failed_runs": sum(1 for r in free + faulty if r["rc"] != 0),
        "faults_not_seen": sum(1 for f in faulty if not f["fault_seen"]),
    }
    if system == "undying":
        summary["mttr_s"] = median(f.get("mttr_s") for f in faulty)
        summary["identical_losses"] = [f.get("identical_losses") for f in faulty]
    return summary


# --- the benchmark ---------------------------------------------------------------


def run_repeat(index: int, args: argparse.Namespace, workload: Workload, fault: Fault,
               root: Path, progress: TextIO) -> dict[str, dict[str, dict[str, Any]]]:
    """One repetition: torchrun, undying, torchrun with the fault, undying with the fault."""
    runs: dict[str, dict[str, Run]] = {s: {} for s in SYSTEMS}
    for faulty in (False, True):
        for system in SYSTEMS:
            label = "with_fault" if faulty else "fault_free"
            run_dir = root / f"rep{index}-{system}-{label.replace('_', '-')}"
            print(f"[{index}/{args.repeats}] {system} {label} ...", end=" ", file=progress,
                  flush=True)
            plan = fault if faulty else None
            if system == "torchrun":
                run = run_torchrun(workload, plan, run_dir, args.checkpoint_every, args.run_timeout)
            else:
                run = run_undying(workload, plan, run_dir, args.run_timeout, args.spares)
            print(f"rc {run.rc}, {run.wall_s:.1f}s", file=progress, flush=True)
            runs[system][label] = run
    result = {s: {label: run_metrics(run, fault, args.warmup) for label, run in by_label.items()}
              for s, by_label in runs.items()}
    undying_runs = runs["undying"]
    result["undying"]["with_fault"]["identical_losses"] = losses_identical(
        undying_runs["fault_free"], undying_runs["with_fault"])
    if args.spares > 0:  # the same fault with no spare warm: a cold replacement process
        run_dir = root / f"rep{index}-undying-no-spare-with-fault"
        print(f"[{index}/{args.repeats}] undying (no spare) with_fault ...", end=" ", file=progress,
              flush=True)
        cold = run_undying(workload, fault, run_dir, args.run_timeout, spares=0)
        print(f"rc {cold.rc}, {cold.wall_s:.1f}s", file=progress, flush=True)
        result["undying_no_spare"] = {"with_fault": run_metrics(cold, fault, args.warmup)}
    return result


def report(args: argparse.Namespace, workload: Workload, fault: Fault,
           reps: list[dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    systems = {s: summarize(s, [r[s] for r in reps]) for s in SYSTEMS}
    und, tr = systems["undying"], systems["torchrun"]
    overhead = (100 * (und["step_ms"] / tr["step_ms"] - 1)
                if und["step_ms"] and tr["step_ms"] else None)
    ratio = (und["recovery_s"] / tr["recovery_s"]
             if und["recovery_s"] is not None and tr["recovery_s"] else None)
    cold = [r["undying_no_spare"]["with_fault"] for r in reps if "undying_no_spare" in r]
    cold_recovery = median(c.get("recovery_s") for c in cold) if cold else None
    spares = {
        "spares": args.spares,
        "recovery_s_with_spare": und["recovery_s"],
        "recovery_s_without_spare": _round(cold_recovery),
        "recovery_s_without_spare_each": [c.get("recovery_s") for c in cold],
        "phases_without_spare": {
            p: median(c.get("phases", {}).get(p) for c in cold)
            for p in (cold[0].get("phases", {}) if cold else {})
        },
        "ratio": _round(und["recovery_s"] / cold_recovery, 4)
        if und["recovery_s"] is not None and cold_recovery else None,
    }
    return {
        "spares": spares,
        "workload": {**asdict(workload), "ranks": RANKS, "steps": workload.total_steps,
                     "steps_per_epoch": workload.steps_per_epoch, "kill_rank": fault.rank,
                     "kill_step": fault.step, "checkpoint_every": args.checkpoint_every,
                     "warmup": args.warmup, "repeats": args.repeats},
        "undying": und,
        "torchrun": tr,
        "overhead_pct": _round(overhead, 2),
        "recovery_ratio": _round(ratio, 4),
        "targets": {"recovery_ratio_max": TARGET_RECOVERY_RATIO, "undying_lost_steps": 0,
                    "torchrun_lost_steps_max": args.checkpoint_every,
                    "overhead_pct_max": TARGET_OVERHEAD_PCT},
        "runs": reps,
    }


def render(result: dict[str, Any], out: TextIO) -> None:
    w, und, tr = result["workload"], result["undying"], result["torchrun"]
    sp = result["spares"]
    if sp["recovery_s_without_spare"] is not None:
        print(f"\nundying recovery with {sp['spares']} warm spare(s) {_fmt(sp['recovery_s_with_spare'], '{:.2f}')} s, "
              f"without {_fmt(sp['recovery_s_without_spare'], '{:.2f}')} s "
              f"(ratio {_fmt(sp['ratio'], '{:.2f}')}; per repetition {sp['recovery_s_without_spare_each']}); "
              "without, seconds after the kill: "
              + ", ".join(f"{p} {_fmt(v, '{:.2f}')}" for p, v in sp["phases_without_spare"].items()),
              file=out)
    print(f"\nworkload: {w['ranks']} ranks (gloo, CPU), MLP {w['features']}->"
          f"{w['hidden']}x{w['layers']}->1, batch {w['batch_size']}/rank, {w['steps']} steps; "
          f"SIGKILL of rank {w['kill_rank']} at the start of step {w['kill_step']}; torchrun "
          f"checkpoints every {w['checkpoint_every']} steps; medians of {w['repeats']} "
          "repetition(s)", file=out)
    rows = [
        ("recovery: kill -> every rank's first step (s)", "recovery_s", "{:.2f}"),
        ("catch-up: kill -> step S done again (s)", "catch_up_s", "{:.2f}"),
        ("lost steps (completed, then re-run)", "lost_steps", "{:g}"),
        ("wall time, fault-free (s)", "wall_fault_free_s", "{:.1f}"),
        ("wall time, with the fault (s)", "wall_with_fault_s", "{:.1f}"),
        ("wall time the fault cost (s)", "fault_wall_cost_s", "{:.1f}"),
        ("steady-state step time, no fault (ms)", "step_ms", "{:.1f}"),
        ("runs that did not exit 0", "failed_runs", "{:d}"),
    ]
    print(f"\n{'':48} {'torchrun':>10} {'undying':>10}", file=out)
    for label, key, fmt in rows:
        print(f"{label:48} {_fmt(tr[key], fmt):>10} {_fmt(und[key], fmt):>10}", file=out)
    for name, system in (("undying", und), ("torchrun", tr)):
        phases = ", ".join(f"{p} {_fmt(v, '{:.2f}')}" for p, v in system["phases"].items())
        print(f"\n{name} recovery, seconds after the kill: {phases}", file=out)
        if w["repeats"] > 1:
            print(f"{name} per repetition: recovery s {system['recovery_s_each']}, "
                  f"step ms {system['step_ms_each']}", file=out)
    print(f"undying per-step losses identical to its fault-free run: {und['identical_losses']}",
          file=out)
    print("\nratios (targets in brackets):", file=out)
    print(f"  recovery undying / torchrun: {_fmt(result['recovery_ratio'], '{:.3f}')} "
          f"[<= {TARGET_RECOVERY_RATIO}]", file=out)
    print(f"  lost steps: undying {_fmt(und['lost_steps'], '{:g}')} [0], torchrun "
          f"{_fmt(tr['lost_steps'], '{:g}')} [up to {w['checkpoint_every']}]", file=out)
    print(f"  step-time overhead of undying over plain DDP: "
          f"{_fmt(result['overhead_pct'], '{:+.1f}')}% [<= {TARGET_OVERHEAD_PCT:g}%]", file=out)


def _fmt(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def add_workload_arguments(p: argparse.ArgumentParser, *, epochs: int | None, hidden: int = 768,
                           layers: int = 4) -> None:
    """The demo job's size, as every benchmark takes it (``epochs=None``: the bench sizes the job itself)."""
    if epochs is not None:
        p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Recovery benchmark: undying vs torchrun + checkpoints",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="repetitions (medians are reported)")
    add_workload_arguments(p, epochs=2)
    p.add_argument("--kill-step", type=int, default=26, help="SIGKILL at the start of this step")
    p.add_argument("--kill-rank", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=10, help="torchrun's checkpoint period")
    p.add_argument("--spares", type=int, default=1, help="undying's hot spares per node")
    p.add_argument("--warmup", type=int, default=5, help="steps of each generation not timed")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds for one run")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout, the report on stderr")
    p.add_argument("--out", type=Path, default=None, help="keep every run's logs and records here")
    p.add_argument("--ranks", default=None,
                   help="world sizes to sweep, e.g. 2,4,8,16: recovery as the world grows "
                        "(bench/recovery_ranks.py; then a small paced job is the default)")
    p.add_argument("--steps", type=int, default=40,
                   help="with --ranks: the steps of the job at every size")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="every step lasts at least this (a sleep; 0.2 with --ranks)")
    known, _ = p.parse_known_args(argv)
    if known.ranks is not None:
        from recovery_ranks import SWEEP_DEFAULTS
        p.set_defaults(**SWEEP_DEFAULTS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.ranks is not None:
        from recovery_ranks import parse_ranks
        try:
            args.ranks = parse_ranks(args.ranks)
        except ValueError as e:
            p.error(str(e))
        if not 1 < args.kill_step <= args.steps or args.kill_rank >= min(args.ranks):
            p.error(f"with --ranks: --kill-step must be in 2..{args.steps} (--steps) and "
                    f"--kill-rank below the smallest size, {min(args.ranks)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ranks is not None:
        return main_sweep(args)
    workload = Workload(args.epochs, args.samples, args.features, args.hidden, args.layers,
                        args.batch_size, step_seconds=args.step_seconds)
    if not 1 < args.kill_step <= workload.total_steps or not 0 <= args.kill_rank < RANKS:
        sys.exit(f"--kill-step must be in 2..{workload.total_steps} "
                 f"and --kill-rank in 0..{RANKS - 1}")
    fault = Fault(rank=args.kill_rank, step=args.kill_step)
    signal.signal(signal.SIGTERM, interrupt)
    text = sys.stderr if args.json else sys.stdout
    try:
        with work_root(args.out, "undying-bench-recovery-") as root:
            reps = [run_repeat(i, args, workload, fault, root, sys.stderr)
                    for i in range(1, args.repeats + 1)]
    except KeyboardInterrupt:
        print("interrupted; every process started was stopped", file=sys.stderr)
        return 130
    result = report(args, workload, fault, reps)
    render(result, text)
    publish(result, args.out, args.json, text, "logs and records")
    return 0


def main_sweep(args: argparse.Namespace) -> int:
    """``--ranks``: the same fault at each world size (bench/recovery_ranks.py)."""
    from recovery_ranks import render_sweep, run_sweep
    signal.signal(signal.SIGTERM, interrupt)
    text = sys.stderr if args.json else sys.stdout
    try:
        with work_root(args.out, "undying-bench-recovery-ranks-") as root:
            result = run_sweep(args, args.ranks, root, sys.stderr)
    except KeyboardInterrupt:
        print("interrupted; every process started was stopped", file=sys.stderr)
        return 130
    render_sweep(result, text)
    publish(result, args.out, args.json, text, "logs and records")
    return 0


@contextlib.contextmanager
def work_root(out: Path | None, prefix: str) -> Iterator[Path]:
    """Where a bench's runs keep their logs: ``--out`` (kept), or a temporary folder removed at
    the end, however the bench ends."""
    root = out or Path(tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    finally:
        if out is None:
            shutil.rmtree(root, ignore_errors=True)


def publish(result: dict[str, Any], out: Path | None, as_json: bool, text: TextIO, kept: str) -> None:
    """Every bench's ending: result.json beside the kept logs, and the one JSON line on stdout when asked."""
    if out is not None:
        (out / "result.json").write_text(json.dumps(result, indent=2))
        print(f"\n{kept}: {out}", file=text)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C: the bench's finally-blocks stop every process it started."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
