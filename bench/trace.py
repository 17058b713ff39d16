"""Tracing overhead: what the markers cost a step, off, on, and with comm markers.

Method
------
One workload, the demo job (``undying/demo/train.py``: a seeded regression MLP,
DDP over gloo on CPU, 4 ranks; by default recovery.py's size, a step of 50-200
ms on 2 cores), measured four ways:

1. Whole jobs, interleaved. Each repetition runs four jobs: plain DDP under
   ``torchrun`` with no undying import (``bench/plain_ddp.py``, no checkpoints),
   and ``undying run`` with ``--trace off``, ``--trace on`` and ``--trace comm``.
   The order rotates by one place each repetition so that no mode always runs
   first or last. Step time as in recovery.py: done(s) is when the last rank
   committed step s, a step time is done(s) - done(s-1), the first ``--warmup``
   steps are skipped, and a run's figure is the median. Ratios (on/off,
   comm/off, off/plain) are taken within a repetition; the report gives their
   median and range over the repetitions, and the spread of each mode's own
   step time, which is the noise floor.
2. One job, switched while it runs: ``undying run --trace off`` on a longer
   job, the switch cycled off -> on -> comm through the HTTP API every
   ``--ab-segment`` seconds. Each step is classed by its trace records (every
   rank has a step record: on; every rank also has comm records: comm; no rank
   has any record: off; anything else, or the first ``--ab-skip`` steps after a
   change, is left out). The same processes, the same load at the same time:
   differences between jobs (process placement, a neighbour's load) cancel.
3. The off path, timed directly (0.2% of a step is below what whole-job wall
   clock resolves here): the calls the step loop makes on ``WorkerTracing`` per
   step with tracing off (``step_started``, the three ``active`` checks of the
   data fetch, the forward pass and the checkpoint seam, ``committed``), timed
   over many iterations in this process minus an empty loop; and the same seams
   with tracing on (records to a real ``TraceWriter`` and the summarizer).
4. The comm hook. While comm markers are on, every DDP undying builds carries
   ``traced_allreduce_hook`` (with them off it carries none: switching comm
   rebuilds the DDP at an agreed step). The hook replaces DDP's built-in C++
   all-reduce with Python, and scales the bucket itself (``bucket.mul_``),
   which the built-in path fuses into its gradient copy: part of comm's cost.
   Timed on the workload's model and on a tiny one, forward and backward, in
   rounds of three DDPs alike but for the hook: built-in, the traced hook, and
   the same hook without its scaling pass (to tell the Python from the extra
   pass over the gradients); one iteration of each per round, the order
   rotating, median of the paired differences. Once with 1 rank (the hook's own
   CPU cost, without a peer's and the loopback's noise) and once with 2 ranks,
   one process each.

The off-path cost is reported as a share of the workload's median step time
with tracing off (from 1.). Targets (issue #6): off <= 0.2%, on <= 1%, comm
<= 2%. The benchmark reports; it asserts nothing.

Run it from the repository root::

    python bench/trace.py                 # 5 repetitions + the switched job + micro (about 10 min on 2 cores)
    python bench/trace.py --repeats 3 --json

With ``--json`` the text report goes to stderr and the last stdout line is one
JSON object. Every process started is stopped on exit, Ctrl-C and SIGTERM
included: launchers by process group (SIGTERM, then SIGKILL), workers they left
and the hook benchmark's processes with SIGKILL, by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
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
    run_torchrun,
    step_times,
    stop,
    undying_worker_pids,
    wait_for,
)

from undying.cli.client import api_post  # noqa: E402
from undying.demo import TRAIN_SCRIPT  # noqa: E402
from undying.errors import UsageError  # noqa: E402
from undying.jobfiles.events import read_job  # noqa: E402
from undying.jobfiles.jobdir import JobDir  # noqa: E402

MODES = ("plain", "off", "on", "comm")
TARGETS_PCT = {"off": 0.2, "on": 1.0, "comm": 2.0}
AB_MODES = ("off", "on", "comm")
AB_SWITCH = {"off": {"on": False}, "on": {"on": True, "comm": False},
             "comm": {"on": True, "comm": True}}
HOOK_WORKER_FLAG = "--hook-worker"

# Processes of the hook benchmark, killed by PID on any exit.
_children: list[subprocess.Popen[bytes]] = []


# --- whole jobs --------------------------------------------------------------------


def run_undying(workload: Workload, mode: str, run_dir: Path, timeout_s: float, spares: int,
                on_up: Callable[[str, subprocess.Popen[bytes], float], Any] | None = None
                ) -> dict[str, Any]:
    """One ``undying run --trace MODE`` job; its commits, wall time and trace volume."""
    run_dir.mkdir(parents=True)
    job_dir = run_dir / "job"
    argv = [sys.executable, "-m", "undying", "run", "-n", str(RANKS), "--port", "0",
            "--job-dir", str(job_dir), "--job-id", run_dir.name, "--stop-grace", "3",
            "--spares", str(spares), "--trace", mode, str(TRAIN_SCRIPT), *workload.script_args()]
    events_db = job_dir / "events.db"
    started = time.monotonic()
    deadline = started + timeout_s
    process = launch(argv, bench_env(), run_dir / "undying.log")
    extra: Any = None
    try:
        if on_up is not None:
            url = manager_url_when_up(job_dir, process, deadline)
            if url is not None:
                extra = on_up(url, process, deadline)
        rc = wait_for(process, deadline)
        wall_s = time.monotonic() - started
    finally:
        leftovers = stop(process, lambda: undying_worker_pids(events_db), str(TRAIN_SCRIPT))
    out: dict[str, Any] = {"rc": rc, "wall_s": round(wall_s, 2), "commits": [],
                           "leftover_workers_killed": leftovers, "extra": extra}
    if events_db.exists():
        out["commits"] = [Commit(s["rank"], s["step"], s["generation"], s["t"])
                          for s in read_job(events_db)["steps"]]
    out["trace_root"] = job_dir / "traces" / run_dir.name
    records, nbytes = trace_volume(out["trace_root"])
    out["trace_records"], out["trace_bytes"] = records, nbytes
    return out


def manager_url_when_up(job_dir: Path, process: subprocess.Popen[bytes], deadline: float) -> str | None:
    while time.monotonic() < deadline and process.poll() is None:
        info = JobDir(job_dir).read_manager()
        if info is not None:
            return str(info["url"])
        time.sleep(0.05)
    return None


def trace_volume(trace_root: Path) -> tuple[int, int]:
    """Records and bytes the job's ranks wrote."""
    records = nbytes = 0
    if trace_root.is_dir():
        for path in trace_root.glob("*/*.ndjson"):
            data = path.read_bytes()
            records += data.count(b"\n")
            nbytes += len(data)
    return records, nbytes


def run_one(mode: str, workload: Workload, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    if mode == "plain":
        run = run_torchrun(workload, None, run_dir, 0, args.run_timeout)
        rc, wall_s, commits = run.rc, run.wall_s, run.commits
        records = nbytes = 0
    else:
        res = run_undying(workload, mode, run_dir, args.run_timeout, args.spares)
        rc, wall_s, commits = res["rc"], res["wall_s"], res["commits"]
        records, nbytes = res["trace_records"], res["trace_bytes"]
    times = step_times(commits, args.warmup)
    steps = len({c.step for c in commits})
    return {
        "rc": rc, "wall_s": round(wall_s, 2), "steps": steps,
        "step_ms": round(1000 * statistics.median(times), 3) if times else None,
        "trace_records": records, "trace_bytes": nbytes,
        "trace_bytes_per_step": round(nbytes / steps) if steps else None,
    }


def whole_jobs(args: argparse.Namespace, workload: Workload, root: Path,
               progress: TextIO) -> list[dict[str, dict[str, Any]]]:
    reps = []
    for i in range(args.repeats):
        order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]
        rep: dict[str, dict[str, Any]] = {}
        for mode in order:
            print(f"[{i + 1}/{args.repeats}] {mode} ...", end=" ", file=progress, flush=True)
            rep[mode] = run_one(mode, workload, root / f"rep{i + 1}-{mode}", args)
            print(f"rc {rep[mode]['rc']}, {rep[mode]['wall_s']:.1f}s, step "
                  f"{_f(rep[mode]['step_ms'], '{:.2f}')} ms", file=progress, flush=True)
        rep["order"] = {"modes": list(order)}
        reps.append(rep)
    return reps


def summarize_jobs(reps: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    per_mode: dict[str, Any] = {}
    for mode in MODES:
        each = [r[mode]["step_ms"] for r in reps]
        present = [v for v in each if v is not None]
        med = statistics.median(present) if present else None
        per_mode[mode] = {
            "step_ms": _r(med), "step_ms_each": each,
            "spread_pct": _r(100 * (max(present) - min(present)) / med, 2) if present and med else None,
            "trace_bytes_per_step": statistics.median(
                [r[mode]["trace_bytes_per_step"] or 0 for r in reps]),
            "failed_runs": sum(1 for r in reps if r[mode]["rc"] != 0),
        }
    ratios: dict[str, Any] = {}
    for name, (a, b) in {"on_vs_off": ("on", "off"), "comm_vs_off": ("comm", "off"),
                         "off_vs_plain": ("off", "plain")}.items():
        each = [_r(100 * (r[a]["step_ms"] / r[b]["step_ms"] - 1), 2)
                for r in reps if r[a]["step_ms"] and r[b]["step_ms"]]
        ratios[name] = {"pct": _r(statistics.median(each), 2) if each else None, "pct_each": each,
                        "min": min(each) if each else None, "max": max(each) if each else None}
    return {"modes": per_mode, "overhead": ratios}


# --- one job, switched while it runs -------------------------------------------------


def ab_job(args: argparse.Namespace, workload: Workload, root: Path, progress: TextIO) -> dict[str, Any]:
    """``--trace off`` at start, then off -> on -> comm -> off ... every ``--ab-segment`` s."""
    switches: list[dict[str, Any]] = []

    def drive(url: str, process: subprocess.Popen[bytes], deadline: float) -> None:
        i = 0
        while process.poll() is None and time.monotonic() < deadline:
            mode = AB_MODES[i % len(AB_MODES)]
            if i > 0:
                try:
                    api_post(url, "/api/trace", {**AB_SWITCH[mode], "by": "bench/trace.py"})
                except UsageError:  # the job ended meanwhile
                    return
                switches.append({"mode": mode, "t": time.time()})
            i += 1
            end = time.monotonic() + args.ab_segment
            while time.monotonic() < end and process.poll() is None:
                time.sleep(0.05)

    ab_workload = Workload(args.ab_epochs, workload.samples, workload.features, workload.hidden,
                           workload.layers, workload.batch_size)
    print(f"switched job: {ab_workload.total_steps} steps, off/on/comm every {args.ab_segment:g}s ...",
          end=" ", file=progress, flush=True)
    res = run_undying(ab_workload, "off", root / "switched", args.run_timeout, args.spares, drive)
    print(f"rc {res['rc']}, {res['wall_s']:.1f}s", file=progress, flush=True)
    modes = classify_steps(res["trace_root"])
    done: dict[int, float] = {}
    by_step: dict[int, list[float]] = defaultdict(list)
    for c in res["commits"]:
        by_step[c.step].append(c.t)
    done = {s: max(ts) for s, ts in by_step.items() if len(ts) == RANKS}
    # Segments: runs of steps in one mode; the first ab_skip steps of each are left out.
    segments: list[tuple[str, list[float]]] = []
    current: str | None = None
    run_len = 0
    for s in sorted(done):
        mode = modes.get(s, "mixed")
        if mode != current:
            current, run_len = mode, 0
            segments.append((mode, []))
        run_len += 1
        if mode in AB_MODES and run_len > args.ab_skip and s - 1 in done and s > args.warmup \
                and modes.get(s - 1) == mode:
            segments[-1][1].append(1000 * (done[s] - done[s - 1]))
    seg_medians = [(m, statistics.median(ts), len(ts)) for m, ts in segments if m in AB_MODES and len(ts) >= 5]
    all_times: dict[str, list[float]] = defaultdict(list)
    for m, ts in segments:
        if m in AB_MODES:
            all_times[m].extend(ts)
    medians = {m: statistics.median(ts) for m, ts in all_times.items() if ts}
    # Paired: each on/comm segment against the mean of the off segments beside it.
    paired: dict[str, list[float]] = {"on": [], "comm": []}
    for i, (m, med, _) in enumerate(seg_medians):
        if m == "off":
            continue
        offs = [seg_medians[j][1] for j in (i - 1, i + 1, i - 2, i + 2)
                if 0 <= j < len(seg_medians) and seg_medians[j][0] == "off"][:2]
        if offs:
            paired[m].append(round(100 * (med / statistics.mean(offs) - 1), 2))
    overhead = {}
    for m in ("on", "comm"):
        if m in medians and "off" in medians:
            overhead[f"{m}_vs_off"] = {
                "pct_all_steps": _r(100 * (medians[m] / medians["off"] - 1), 2),
                "pct_paired_median": _r(statistics.median(paired[m]), 2) if paired[m] else None,
                "pct_paired_each": paired[m],
            }
    counts: dict[str, int] = defaultdict(int)
    for m in modes.values():
        counts[m] += 1
    return {
        "rc": res["rc"], "wall_s": res["wall_s"], "steps": len(done), "switches": len(switches),
        "steps_by_class": dict(counts), "steps_timed": {m: len(ts) for m, ts in all_times.items()},
        "step_ms": {m: _r(v) for m, v in medians.items()}, "segments": len(seg_medians),
        "overhead": overhead,
    }


def classify_steps(trace_root: Path) -> dict[int, str]:
    """Step -> "on", "comm", "off" or "mixed", from every rank's trace records."""
    kinds: dict[int, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))  # step -> rank -> kinds
    if trace_root.is_dir():
        for rank_dir in trace_root.iterdir():
            if not rank_dir.name.isdigit():
                continue
            rank = int(rank_dir.name)
            for path in rank_dir.glob("*.ndjson"):
                for line in path.read_text().splitlines():
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                        kinds[rec["step"]][rank].add(rec.get("kind", ""))
    out: dict[int, str] = {}
    last = max(kinds, default=0)
    for s in range(1, last + 1):
        ranks = kinds.get(s, {})
        if not ranks:
            out[s] = "off"
        elif len(ranks) == RANKS and all("step" in k and "comm" in k for k in ranks.values()):
            out[s] = "comm"
        elif len(ranks) == RANKS and all("step" in k and "comm" not in k for k in ranks.values()):
            out[s] = "on"
        else:
            out[s] = "mixed"
    return out


# --- micro: the step loop's seams ------------------------------------------------------


def micro_seams(iterations: int, tmp: Path) -> dict[str, Any]:
    """Per-step cost of the ``WorkerTracing`` calls the step loop makes, off and on."""
    from undying.protocol.worker_wire import TraceSet
    from undying.worker.tracing import WorkerTracing

    def _fetch(index: int) -> None:
        return None

    def off_loop(t: Any, n: int) -> float:
        start = time.perf_counter()
        for i in range(1, n + 1):
            t.step_started(i, 0)
            if t.active:  # job.steps(): the data fetch
                pass
            if t.active:  # GenerationalDDP.__call__: the forward pass
                pass
            if t.active:  # _maybe_save on a rank that does not write
                pass
            t.committed(i)
        return time.perf_counter() - start

    def empty_loop(n: int) -> float:
        start = time.perf_counter()
        for _ in range(1, n + 1):
            pass
        return time.perf_counter() - start

    def on_loop(t: Any, n: int) -> float:
        start = time.perf_counter()
        for i in range(1, n + 1):
            t.step_started(i, 0)
            t.batch(_fetch, i)
            with t.forward():
                pass
            t.committed(i)
        return time.perf_counter() - start

    sent: list[Any] = []
    off = WorkerTracing(None, 0, sent.append)
    off_loop(off, 1000)
    reps = 7
    off_s = min(off_loop(off, iterations) for _ in range(reps))
    empty_s = min(empty_loop(iterations) for _ in range(reps))
    off_us = 1e6 * (off_s - empty_s) / iterations

    # On: the real writer (files under tmp, written by its thread) and the summarizer.
    # Timed twice: the loop alone (the training thread's part, the writer thread
    # running beside it as in a job), and the loop plus the flush of everything it
    # queued (every record encoded and written: all the CPU the markers cost).
    from undying.trace.writer import TraceWriter

    on = WorkerTracing(None, 0, sent.append)
    writer = TraceWriter(tmp / "micro-traces", "micro", 0)
    on.tracer.writer = writer
    on.apply(TraceSet(True, False, "bench", time.time()))
    n_on = 5000  # 3 records a step: well under the writer's queue limit per round
    loop_s, total_s = [], []
    try:
        on_loop(on, 1000)
        writer.flush(30.0)
        for _ in range(reps):
            start = time.perf_counter()
            loop_s.append(on_loop(on, n_on))
            writer.flush(30.0)
            total_s.append(time.perf_counter() - start)
    finally:
        writer.close()
    empty_on = empty_s * n_on / iterations
    return {"iterations": iterations, "off_us_per_step": round(off_us, 3),
            "on_iterations": n_on,
            "on_us_per_step": round(1e6 * (min(loop_s) - empty_on) / n_on, 3),
            "on_us_per_step_with_writing": round(1e6 * (min(total_s) - empty_on) / n_on, 3),
            "summaries_sent": len(sent), "writer_dropped": writer.dropped}


# --- micro: the comm hook, in two processes -------------------------------------------


def micro_hook(args: argparse.Namespace, workload: Workload, tmp: Path, progress: TextIO,
               world_size: int) -> dict[str, Any]:
    """DDP's built-in all-reduce against ``traced_allreduce_hook`` (comm markers off).

    ``world_size`` processes, one per rank: 2 as a real (if small) job; 1 to
    time the hook's own CPU cost without the noise of a peer and the loopback.
    """
    out_file = tmp / f"hook{world_size}.json"
    port = _free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), HOOK_WORKER_FLAG]
    env = bench_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                    BENCH_HOOK_OUT=str(out_file),
                    BENCH_HOOK_CFG=json.dumps({"features": workload.features, "hidden": workload.hidden,
                                               "layers": workload.layers, "batch": workload.batch_size,
                                               "rounds": args.hook_rounds}))
    print(f"comm hook micro-benchmark ({world_size} rank(s)) ...", end=" ", file=progress, flush=True)
    procs = []
    for rank in range(world_size):
        with open(tmp / f"hook{world_size}-{rank}.log", "wb") as log:
            p = subprocess.Popen([*argv, str(rank)], env={**env, "RANK": str(rank)},
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        _children.append(p)
    deadline = time.monotonic() + args.run_timeout
    rcs = [wait_for(p, deadline) for p in procs]
    _kill_children()
    print(f"rc {rcs}", file=progress, flush=True)
    if any(rcs) or not out_file.exists():
        return {"error": f"hook workers exited {rcs}; see {tmp}/hook{world_size}-*.log"}
    return dict(json.loads(out_file.read_text()))


def hook_worker(rank: int) -> None:
    """One of the two hook-benchmark ranks (run as ``trace.py --hook-worker RANK``)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from undying.worker.tracing import CommHookState, WorkerTracing, traced_allreduce_hook

    cfg = json.loads(os.environ["BENCH_HOOK_CFG"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    tracing = WorkerTracing(None, rank, lambda m: None)  # comm markers off

    def mlp(features: int, hidden: int, layers: int) -> nn.Module:
        mods: list[nn.Module] = []
        width = features
        for _ in range(layers):
            mods += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        return nn.Sequential(*mods, nn.Linear(width, 1))

    def unscaled_hook(state, bucket):  # no annotations: DDP checks them as objects
        # The traced hook's Python path without its scaling pass (sums instead of
        # averaging: a timing reference only, its gradients are thrown away).
        work = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda f: f.value()[0])

    def ddp(model: nn.Module, hook: str) -> DistributedDataParallel:
        d = DistributedDataParallel(model)
        d.reducer._push_all_rebuilt_params()  # as undying's wrapper does
        if hook == "hook":
            d.register_comm_hook(CommHookState(tracing, d.process_group, world_size), traced_allreduce_hook)
        elif hook == "hook_unscaled":
            d.register_comm_hook(CommHookState(tracing, d.process_group, world_size), unscaled_hook)
        return d

    def buckets(model: nn.Module) -> int:
        d = DistributedDataParallel(model)
        d.reducer._push_all_rebuilt_params()
        calls = [0]

        def count(state, bucket):  # no annotations: DDP checks them as objects
            calls[0] += 1
            work = dist.all_reduce(bucket.buffer(), async_op=True)
            assert work is not None
            return work.get_future().then(lambda f: f.value()[0])

        d.register_comm_hook(None, count)
        x, y = torch.randn(4, cfg["features"]), torch.randn(4, 1)
        for _ in range(3):
            F.mse_loss(d(x), y).backward()
        return calls[0] // 3

    results: dict[str, Any] = {}
    sizes = {"tiny": (cfg["features"], 32, 1, 10 * cfg["rounds"]),
             "workload": (cfg["features"], cfg["hidden"], cfg["layers"], cfg["rounds"])}
    variants = ("builtin", "hook", "hook_unscaled")
    for name, (features, hidden, layers, rounds) in sizes.items():
        base = mlp(features, hidden, layers)
        models = {v: ddp(mlp(features, hidden, layers), v) for v in variants}
        for d in models.values():
            d.module.load_state_dict(base.state_dict())
        x, y = torch.randn(cfg["batch"], features), torch.randn(cfg["batch"], 1)
        times: dict[str, list[float]] = {v: [] for v in variants}
        # One iteration of each variant per round, the order rotating: drift in the
        # machine's load falls on all three alike, and each round gives paired differences.
        for i in range(-5, rounds):  # 5 rounds of warm-up
            k = i % len(variants)
            for label in variants[k:] + variants[:k]:
                d = models[label]
                t0 = time.perf_counter()
                F.mse_loss(d(x), y).backward()
                t = time.perf_counter() - t0
                for p in d.parameters():
                    p.grad = None
                if i >= 0:
                    times[label].append(t)
        nparams = sum(p.numel() for p in base.parameters())
        entry: dict[str, Any] = {"rounds": rounds, "buckets": buckets(mlp(features, hidden, layers)),
                                 "gradient_elements": nparams,
                                 "builtin_us": round(1e6 * statistics.median(times["builtin"]), 2)}
        for v in variants[1:]:
            diffs = [h - b for h, b in zip(times[v], times["builtin"], strict=True)]
            entry[f"{v}_us"] = round(1e6 * statistics.median(times[v]), 2)
            entry[f"{v}_diff_us"] = round(1e6 * statistics.median(diffs), 2)
            entry[f"{v}_diff_us_quartiles"] = [round(1e6 * q, 2) for q in statistics.quantiles(diffs, n=4)]
        # The hook's scaling pass alone: one in-place multiply over a buffer of the gradients' size.
        buf = torch.randn(nparams)
        scale = []
        for _ in range(50):
            t0 = time.perf_counter()
            buf.mul_(0.5)
            scale.append(time.perf_counter() - t0)
        entry["scaling_pass_us"] = round(1e6 * statistics.median(scale), 2)
        results[name] = entry
    if rank == 0:
        Path(os.environ["BENCH_HOOK_OUT"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_children() -> None:
    for p in _children:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
    _children.clear()


# --- the report ------------------------------------------------------------------------


def report(args: argparse.Namespace, workload: Workload, reps: list[dict[str, dict[str, Any]]],
           switched: dict[str, Any] | None, seams: dict[str, Any], hooks: dict[str, dict[str, Any]]
           ) -> dict[str, Any]:
    jobs = summarize_jobs(reps)
    off_ms = jobs["modes"]["off"]["step_ms"]
    off_path: dict[str, Any] = {"step_ms": off_ms}
    if off_ms:
        step_us = 1000 * off_ms
        off_path.update(seams_us=seams["off_us_per_step"],
                        seams_pct=round(100 * seams["off_us_per_step"] / step_us, 4),
                        on_seams_pct=round(100 * seams["on_us_per_step_with_writing"] / step_us, 4))
        for label, hook in hooks.items():
            wl = hook.get("workload")
            if not wl:
                continue
            # The hook's extra time per iteration on the workload's model, as a share of the 4-rank job's step.
            hook_us = wl["hook_diff_us"]
            off_path[f"hook_{label}"] = {
                "buckets_per_step": wl["buckets"], "us_per_step": hook_us,
                "pct": round(100 * hook_us / step_us, 3),
                "python_us": wl["hook_unscaled_diff_us"], "scaling_pass_us": wl["scaling_pass_us"],
            }
    return {
        "workload": {"ranks": RANKS, "features": workload.features, "hidden": workload.hidden,
                     "layers": workload.layers, "batch_size": workload.batch_size,
                     "samples": workload.samples, "epochs": workload.epochs, "steps": workload.total_steps,
                     "warmup": args.warmup, "repeats": args.repeats, "spares": args.spares},
        "targets_pct": TARGETS_PCT,
        "jobs": jobs,
        "switched": switched,
        "off_path": off_path,
        "micro_seams": seams,
        "micro_hook": hooks,
        "runs": reps,
    }


def render(result: dict[str, Any], out: TextIO) -> None:
    w, jobs = result["workload"], result["jobs"]
    print(f"\nworkload: {w['ranks']} ranks (gloo, CPU), MLP {w['features']}->{w['hidden']}x{w['layers']}->1, "
          f"batch {w['batch_size']}/rank, {w['steps']} steps, {w['repeats']} repetition(s), "
          f"first {w['warmup']} steps not timed", file=out)
    print(f"\n{'whole jobs':26} {'step ms (median)':>16} {'per repetition':>40} {'spread':>7} {'trace B/step':>12}",
          file=out)
    for mode in MODES:
        m = jobs["modes"][mode]
        label = "plain DDP (torchrun)" if mode == "plain" else f"undying --trace {mode}"
        each = " ".join(_f(v, "{:.2f}") for v in m["step_ms_each"])
        print(f"{label:26} {_f(m['step_ms'], '{:.2f}'):>16} {each:>40} {_f(m['spread_pct'], '{:.1f}%'):>7} "
              f"{m['trace_bytes_per_step'] or '-':>12}", file=out)
    print("\noverhead, within each repetition (median [min, max]) and target:", file=out)
    for name, target in (("on_vs_off", TARGETS_PCT["on"]), ("comm_vs_off", TARGETS_PCT["comm"]),
                         ("off_vs_plain", None)):
        o = jobs["overhead"][name]
        print(f"  {name:13} {_f(o['pct'], '{:+.2f}%'):>8} [{_f(o['min'], '{:+.2f}')}, {_f(o['max'], '{:+.2f}')}]"
              + (f"  target <= {target:g}%" if target is not None else ""), file=out)
    sw = result.get("switched")
    if sw:
        print(f"\nswitched job: {sw['steps']} steps, {sw['switches']} switches, steps timed "
              f"{sw['steps_timed']}, median step ms {sw['step_ms']}", file=out)
        for name, o in sw["overhead"].items():
            print(f"  {name:13} all steps {_f(o['pct_all_steps'], '{:+.2f}%')}, paired segments median "
                  f"{_f(o['pct_paired_median'], '{:+.2f}%')} (each {o['pct_paired_each']})", file=out)
    op, seams = result["off_path"], result["micro_seams"]
    print("\noff path, timed directly:", file=out)
    print(f"  step-loop seams: {seams['off_us_per_step']:.3f} us/step = {_f(op.get('seams_pct'), '{:.4f}')}% "
          f"of a {_f(op.get('step_ms'), '{:.1f}')} ms step", file=out)
    for label, hook in result["micro_hook"].items():
        if "error" in hook:
            print(f"  comm hook, {label}: {hook['error']}", file=out)
            continue
        for name in ("tiny", "workload"):
            h = hook[name]
            print(f"  comm hook, {label}, {name} model ({h['buckets']} bucket(s)/step, {h['rounds']} rounds): "
                  f"built-in {h['builtin_us']:.0f} us/iteration; traced hook (off) {h['hook_diff_us']:+.0f} us "
                  f"(quartiles {h['hook_diff_us_quartiles']}); without its scaling pass "
                  f"{h['hook_unscaled_diff_us']:+.0f} us; the scaling pass alone {h['scaling_pass_us']:.0f} us",
                  file=out)
        hp = op.get(f"hook_{label}")
        if hp:
            print(f"  => the hook's cost with comm markers on ({label}): {hp['us_per_step']:.0f} us/step = "
                  f"{hp['pct']:.2f}% of the 4-rank step [comm target <= {TARGETS_PCT['comm']:g}%]", file=out)
    print(f"  => off path: the seams only (no hook with comm off) = {_f(op.get('seams_pct'), '{:.4f}')}% "
          f"[target <= {TARGETS_PCT['off']:g}%]", file=out)
    print(f"  (on: the same seams with markers on cost {seams['on_us_per_step']:.1f} us/step on the "
          f"training thread, {seams['on_us_per_step_with_writing']:.1f} us/step with the writer's encoding "
          f"and writing = {_f(op.get('on_seams_pct'), '{:.3f}')}% of the step)", file=out)


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Tracing overhead: off, on, comm, against plain DDP",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="repetitions of the four whole jobs")
    add_workload_arguments(p, epochs=3)
    p.add_argument("--spares", type=int, default=0, help="undying's hot spares (not on the step path)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of a run not timed")
    p.add_argument("--ab-epochs", type=int, default=30, help="epochs of the switched job (0: skip it)")
    p.add_argument("--ab-segment", type=float, default=2.0, help="seconds between switches")
    p.add_argument("--ab-skip", type=int, default=3, help="steps after a switch not timed")
    p.add_argument("--micro-iterations", type=int, default=200_000)
    p.add_argument("--hook-rounds", type=int, default=300,
                   help="rounds of the hook benchmark on the workload's model (10x on the tiny one)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds for one run")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout, the report on stderr")
    p.add_argument("--out", type=Path, default=None, help="keep every run's logs, traces and result.json")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(args.epochs, args.samples, args.features, args.hidden, args.layers, args.batch_size)
    signal.signal(signal.SIGTERM, interrupt)
    text = sys.stderr if args.json else sys.stdout
    root = args.out or Path(tempfile.mkdtemp(prefix="undying-bench-trace-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        seams = micro_seams(args.micro_iterations, root)
        hooks = {"one_rank": micro_hook(args, workload, root, sys.stderr, 1),
                 "two_ranks": micro_hook(args, workload, root, sys.stderr, 2)}
        reps = whole_jobs(args, workload, root, sys.stderr)
        switched = ab_job(args, workload, root, sys.stderr) if args.ab_epochs > 0 else None
    except KeyboardInterrupt:
        print("interrupted; every process started was stopped", file=sys.stderr)
        return 130
    finally:
        _kill_children()
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    result = report(args, workload, reps, switched, seams, hooks)
    result["wall_s"] = round(time.monotonic() - started, 1)
    render(result, text)
    publish(result, args.out, args.json, text, "logs, traces and records")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == HOOK_WORKER_FLAG:
        hook_worker(int(sys.argv[2]))
    else:
        sys.exit(main())
