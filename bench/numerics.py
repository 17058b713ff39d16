"""Numeric checks' overhead: the step time of the same job with and without ``numerics``.

Method
------
One workload, the demo job (``undying/demo/train.py``: a seeded regression MLP,
DDP over gloo on CPU, 4 ranks, recovery.py's size by default), run as whole
jobs by ``undying run``, twice per repetition: ``--numerics off`` and
``--numerics skip`` (``job.steps(..., numerics=Numerics())``: every gradient
summed as backward computes it, before the all-reduce, the loss and the
verdict the all-reduce carries checked in the optimizer's pre-hook). Which mode runs first
alternates between repetitions. Step time as in recovery.py: done(s) is when
the last rank committed step s, a step time is done(s) - done(s-1), the first
``--warmup`` steps are skipped, and a run's figure is the median. The overhead
is taken within a repetition (checked / unchecked - 1); the report gives its
median and range over the repetitions, and each mode's own spread (the noise
floor on a shared machine). Target (issue #18): <= 1%. No fault is injected:
this is the price of the checks on a healthy job. It reports; it asserts nothing.

Whole jobs on a shared 2-core machine spread by tens of percent, far more than
the target; so the checks' own cost is also timed directly (``micro``): one
process, a 1-rank gloo group, the workload's model twice, one under DDP's
built-in all-reduce and one under undying's checks (the gradient hooks, the
step's ``begin`` and ``check``), and a third with ``on_persistent="rollback"``
(the same checks plus the snapshot ring's copy of the state before each step);
a full training step (forward, backward, optimizer) of each per round, the
order rotating, ``--micro-rounds`` rounds; a cost is the median of the paired
differences, as a share of the unchecked step's median, and of the whole job's
unchecked step time. Beside it, one read of the gradients (a norm of each,
timed alone): the floor of any check that looks at every gradient.

Run it from the repository root::

    python bench/numerics.py                 # 5 repetitions (about 5 min on 2 cores)
    python bench/numerics.py --repeats 3 --json

With ``--json`` the text report goes to stderr and the last stdout line is one
JSON object. Every process started is stopped on exit, Ctrl-C and SIGTERM
included (the launcher's group, then any worker it left, by PID).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery import (  # noqa: E402  (bench/ is a folder of scripts)
    RANKS,
    Commit,
    Workload,
    add_workload_arguments,
    bench_env,
    interrupt,
    launch,
    publish,
    step_times,
    stop,
    undying_worker_pids,
    wait_for,
)

from undying.demo import TRAIN_SCRIPT  # noqa: E402
from undying.jobfiles.events import read_job  # noqa: E402

MODES = ("off", "skip")
TARGET_PCT = 1.0


def run_job(workload: Workload, mode: str, run_dir: Path, timeout_s: float, warmup: int) -> dict[str, Any]:
    """One ``undying run`` of the demo job with ``--numerics MODE``: its median step time."""
    run_dir.mkdir(parents=True)
    job_dir = run_dir / "job"
    argv = [sys.executable, "-m", "undying", "run", "-n", str(RANKS), "--port", "0",
            "--job-dir", str(job_dir), "--job-id", run_dir.name, "--stop-grace", "3", "--spares", "0",
            str(TRAIN_SCRIPT), *workload.script_args(), "--numerics", mode]
    events_db = job_dir / "events.db"
    started = time.monotonic()
    process = launch(argv, bench_env(), run_dir / "undying.log")
    try:
        rc = wait_for(process, started + timeout_s)
        wall_s = time.monotonic() - started
    finally:
        stop(process, lambda: undying_worker_pids(events_db), str(TRAIN_SCRIPT))
    commits = [Commit(s["rank"], s["step"], s["generation"], s["t"])
               for s in read_job(events_db)["steps"]] if events_db.exists() else []
    times = step_times(commits, warmup)
    return {"rc": rc, "wall_s": round(wall_s, 2), "steps": len({c.step for c in commits}),
            "step_ms": round(1000 * statistics.median(times), 3) if times else None}


def summarize(reps: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in MODES:
        each = [r[mode]["step_ms"] for r in reps]
        present = [v for v in each if v is not None]
        med = statistics.median(present) if present else None
        modes[mode] = {"step_ms": med, "step_ms_each": each,
                       "spread_pct": round(100 * (max(present) - min(present)) / med, 2) if present and med else None,
                       "failed_runs": sum(1 for r in reps if r[mode]["rc"] != 0)}
    each_pct = [round(100 * (r["skip"]["step_ms"] / r["off"]["step_ms"] - 1), 2)
                for r in reps if r["skip"]["step_ms"] and r["off"]["step_ms"]]
    return {"modes": modes, "overhead_pct": statistics.median(each_pct) if each_pct else None,
            "overhead_pct_each": each_pct, "overhead_pct_min": min(each_pct, default=None),
            "overhead_pct_max": max(each_pct, default=None), "target_pct": TARGET_PCT}


def render(result: dict[str, Any], out: TextIO) -> None:
    w = result["workload"]
    print(f"\nnumeric checks' overhead, {result['repeats']} repetitions, {RANKS} ranks, "
          f"{w['hidden']}x{w['layers']} MLP, batch {w['batch_size']}; {result['machine']}", file=out)
    for mode in MODES:
        m = result["modes"][mode]
        print(f"  numerics {mode:4}: step {m['step_ms']} ms (each {m['step_ms_each']}, spread {m['spread_pct']}%)",
              file=out)
    print(f"  overhead: {result['overhead_pct']}% median (range {result['overhead_pct_min']} .. "
          f"{result['overhead_pct_max']}; each {result['overhead_pct_each']}); target <= {TARGET_PCT}%", file=out)
    m = result["micro"]
    print(f"  timed directly ({m['rounds']} rounds, {m['params']} parameters, 1 rank): {m['cost_ms']} ms a step, "
          f"{m['cost_pct_of_step']}% of the step alone ({m['step_ms']} ms), {m['cost_pct_of_job_step']}% of the "
          "4-rank job's unchecked step", file=out)
    print(f"  one read of the gradients alone (a norm of each, the floor of any check of them): {m['read_ms']} ms, "
          f"{m['read_pct_of_step']}% of the step alone", file=out)
    print(f"  --numerics rollback's snapshot ring (2 steps): +{m['rollback_ring_ms']} ms a step over the checks "
          f"({m['rollback_ring_pct_of_step']}% of the step alone), {m['rollback_ring_mib']} MiB held", file=out)


def micro(workload: Workload, rounds: int) -> dict[str, Any]:
    """The checks' cost per step, timed in this process (see the module's docstring)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from undying.worker.numerics import Numerics
    from undying.worker.numerics_guard import NumericsGuard
    from undying.worker.state import State

    torch.set_num_threads(1)
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def build() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        width = workload.features
        for _ in range(workload.layers):
            layers += [torch.nn.Linear(width, workload.hidden), torch.nn.ReLU()]
            width = workload.hidden
        model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
        return model, DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    class _Step:
        def __init__(self, index: int) -> None:
            self.index, self.generation, self.metrics = index, 0, {}

    kinds = {"plain": None, "checked": Numerics(), "rollback": Numerics(on_persistent="rollback", rollback_steps=2)}
    runs: dict[str, tuple[Any, Any, NumericsGuard | None]] = {}
    for name, config in kinds.items():
        model, ddp, opt = build()
        guard = None if config is None else NumericsGuard(config, State(model=model, optimizer=opt), 0, lambda: 0,
                                                          lambda m: None)
        runs[name] = (ddp, opt, guard)
    x, y = torch.randn(workload.batch_size, workload.features), torch.randn(workload.batch_size, 1)

    def one(name: str, index: int) -> float:
        ddp, opt, guard = runs[name]
        start = time.perf_counter()
        step = _Step(index)
        if guard is not None:
            guard.begin(step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        step.metrics["loss"] = float(loss.item())
        opt.zero_grad()
        loss.backward()
        if guard is not None:
            guard.check(step)
        opt.step()
        return time.perf_counter() - start

    names = list(kinds)
    for i in range(5):
        for name in names:
            one(name, i)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:  # the order rotates
            times[name].append(one(name, i))
    step_ms = 1000 * statistics.median(times["plain"])
    out: dict[str, Any] = {"rounds": rounds, "params": sum(p.numel() for p in runs["plain"][0].parameters()),
                           "step_ms": round(step_ms, 3)}
    cost_ms = 1000 * statistics.median([b - a for a, b in zip(times["plain"], times["checked"], strict=True)])
    out.update(cost_ms=round(cost_ms, 4), cost_pct_of_step=round(100 * cost_ms / step_ms, 2))
    ring_ms = 1000 * statistics.median([b - a for a, b in zip(times["checked"], times["rollback"], strict=True)])
    ring = runs["rollback"][2].ring if runs["rollback"][2] is not None else None
    out.update(rollback_ring_ms=round(ring_ms, 4), rollback_ring_pct_of_step=round(100 * ring_ms / step_ms, 2),
               rollback_ring_mib=round(ring.nbytes / 2**20, 2) if ring is not None else None)
    # The floor of any check of every gradient: one read of them, timed alone on the gradients of a step.
    grads = [p.grad for p in runs["plain"][0].module.parameters() if p.grad is not None]
    reads = []
    for _ in range(rounds):
        start = time.perf_counter()
        torch._foreach_norm(grads)
        reads.append(time.perf_counter() - start)
    read_ms = 1000 * statistics.median(reads)
    out.update(read_ms=round(read_ms, 4), read_pct_of_step=round(100 * read_ms / step_ms, 2))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p, epochs=1)
    p.add_argument("--repeats", type=int, default=5, help="pairs of jobs (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out at the start of each run (default 5)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one job may take (default 300)")
    p.add_argument("--micro-rounds", type=int, default=400, help="rounds of the in-process timing (default 400)")
    p.add_argument("--keep", type=Path, default=None, help="keep the jobs' folders and result.json here")
    p.add_argument("--json", action="store_true", help="the report to stderr, one JSON line on stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        print(f"--repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupt)
    text = sys.stderr if args.json else sys.stdout
    workload = Workload(args.epochs, args.samples, args.features, args.hidden, args.layers, args.batch_size)
    root = args.keep or Path(tempfile.mkdtemp(prefix="undying-bench-numerics-"))
    load = os.getloadavg()
    reps: list[dict[str, dict[str, Any]]] = []
    try:
        for i in range(args.repeats):
            order = MODES if i % 2 == 0 else MODES[::-1]
            rep: dict[str, dict[str, Any]] = {}
            for mode in order:
                print(f"[{i + 1}/{args.repeats}] numerics {mode} ...", end=" ", file=text, flush=True)
                rep[mode] = run_job(workload, mode, root / f"rep{i + 1}-{mode}", args.run_timeout, args.warmup)
                print(f"rc {rep[mode]['rc']}, {rep[mode]['wall_s']}s, step {rep[mode]['step_ms']} ms",
                      file=text, flush=True)
            reps.append(rep)
        print(f"micro: {args.micro_rounds} rounds in this process ...", file=text, flush=True)
        timed = micro(workload, args.micro_rounds)
        unchecked_ms = summarize(reps)["modes"]["off"]["step_ms"]
        timed["cost_pct_of_job_step"] = round(100 * timed["cost_ms"] / unchecked_ms, 2) if unchecked_ms else None
        result = {
            "micro": timed,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "repeats": args.repeats,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {load[0]:.1f} at start, "
                       f"{os.getloadavg()[0]:.1f} at end",
            "workload": vars(workload) if hasattr(workload, "__dict__") else workload.script_args(),
            **summarize(reps), "runs": reps,
        }
        render(result, text)
        publish(result, args.keep, args.json, text, "jobs kept")
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
