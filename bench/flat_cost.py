"""Flat cost (issue #28): a long job costs the manager no more memory, and its log no more bytes, per step.

Method
------
One real ``undying manager`` (its own process, as ``bench/control_plane.py``
starts it: the shipped service under that bench's probe) and N simulated
agents in this process (``control_plane.Sim``: the real protocol on real TCP
sockets, the agent's own ``ManagerClient``, a node's commits of a step in one
``NodeStep`` line). Each size joins, spawns generation 0, then trains
``--steps`` synchronous steps: every rank commits each step, with a loss.

* ``--step-s 0`` (the default): steps as fast as the manager takes them. The
  sender keeps at most ``--in-flight`` steps unacknowledged per node (an ``Acked``
  comes after the manager's log committed them), so the manager is never
  handed a backlog that would measure the sender, not the manager.
* ``--step-s S``: a step every S seconds, all ranks at once (the burst a DDP
  job makes); the manager's probe then times every commit from the agent's
  write to the manager's handler returning, over the steps after the first
  tenth (``commit_ms``: p50, p99; the target is p99 under 100 ms).

Every ``--sample-every`` steps: the manager's resident memory (VmRSS from
``/proc``) and the log's bytes (``events.db`` after a passive WAL checkpoint
run from here, so the file holds every committed row). Reported: RSS at the
first sample at or after a tenth of the steps and at the end, and the growth
between them (the goal: within 10%); the log's bytes per step and per
node-step over the same span.

Run it from the repository root::

    python bench/flat_cost.py --nodes 64 --steps 100000            # the long run (hours on 2 busy cores)
    python bench/flat_cost.py --nodes 1024 --steps 2000 --step-s 1  # bytes per step and commit p99 at 8,192
    python bench/flat_cost.py --nodes 64 --steps 3000               # shortened

Both figures are also measured for the code before this change by running the
same script with ``PYTHONPATH`` set to that checkout's ``src``. With ``--json``
the report goes to stderr and the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from control_plane import (  # noqa: E402  (bench/ is a folder of scripts)
    ManagerProcess,
    Sim,
    kill_managers,
    load_average,
    raise_fd_limit,
    stop_job,
    wait_listening,
)
from recovery import interrupt, publish  # noqa: E402

import undying  # noqa: E402


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def log_bytes(events_db: Path) -> int:
    """The log's bytes with every committed row in the file (a passive checkpoint: the writer is never blocked)."""
    with contextlib.suppress(sqlite3.Error):
        db = sqlite3.connect(events_db, timeout=5)
        try:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            db.close()
    return events_db.stat().st_size


async def acknowledged(sim: Sim, manager: ManagerProcess, limit: int, timeout_s: float, step: int) -> None:
    """Until every node's reports made so far are acknowledged (the manager's log committed them) but the newest
    ``limit``. A report made while waiting does not count: a beat is written to no log, so it is acknowledged
    only with the next commit."""
    targets = [(node, node.seq - limit) for node in sim.nodes]
    deadline = time.monotonic() + timeout_s
    # (a node keeps what it sent until acknowledged, in order: the oldest kept is the first not acknowledged)
    while any(node.sent and node.sent[0][0] <= target for node, target in targets):
        if time.monotonic() > deadline or manager.process.poll() is not None:
            raise RuntimeError(f"the manager acknowledged nothing for {timeout_s:.0f}s at step {step} "
                               f"({manager.log_path})")
        await asyncio.sleep(0.005)


async def train(sim: Sim, manager: ManagerProcess, args: argparse.Namespace, text: TextIO) -> dict[str, Any]:
    """``args.steps`` steps of every rank; samples of the manager's RSS and the log's size."""
    samples: list[dict[str, Any]] = []
    pid = manager.process.pid
    sim.window.on = True  # (each node keeps what it sent until acknowledged: the pacing below reads it)
    probe_from = max(1, args.steps // 10)
    probing = False
    t0 = time.time()
    window_from = 0.0
    boundary = time.time()
    for step in range(1, args.steps + 1):
        if args.step_s > 0:
            boundary += args.step_s
            await asyncio.sleep(max(0.0, boundary - time.time()))
        else:
            await acknowledged(sim, manager, args.in_flight * sim.config.nproc_per_node, args.timeout_s, step)
        if args.step_s > 0 and step == probe_from:
            manager.begin_probe()
            probing = True
            window_from = time.time()
        for node in sim.nodes:
            node.commit(step, sim.generation)
        if step % 1000 == 0:
            sim.window.reset()  # (the sender's own figures: not kept for 100,000 steps)
        if step % args.sample_every == 0 or step == args.steps:
            await acknowledged(sim, manager, 0, args.timeout_s, step)  # (the manager took every step so far)
            samples.append({"step": step, "t": round(time.time() - t0, 2), "rss_kb": rss_kb(pid),
                            "log_bytes": log_bytes(manager.events_db), "load": load_average()[0]})
            last = samples[-1]
            print(f"  step {step:>7}: manager RSS {last['rss_kb'] / 1024:7.1f} MB, log {last['log_bytes'] / 1e6:9.2f} MB, "
                  f"{last['t']:7.1f}s, load {last['load']}", file=text, flush=True)
    out: dict[str, Any] = {"samples": samples, "wall_s": round(time.time() - t0, 1)}
    if probing:
        window_to = time.time()
        await asyncio.sleep(3.0)  # (the last commits drain)
        probe = await manager.end_probe(window_from, window_to)
        out["commit_ms"] = probe["latency_ms"].get("StepCommitted")
        out["flush_ms"] = probe["flush_ms"]
    return out


def summarize(out: dict[str, Any], nnodes: int, steps: int) -> dict[str, Any]:
    samples = out["samples"]
    start = next((s for s in samples if s["step"] >= max(1, steps // 10)), samples[0])
    end = samples[-1]
    span = max(1, end["step"] - start["step"])
    per_step = (end["log_bytes"] - start["log_bytes"]) / span
    return {"rss_from_mb": round(start["rss_kb"] / 1024, 1), "rss_to_mb": round(end["rss_kb"] / 1024, 1),
            "rss_growth_pct": round(100 * (end["rss_kb"] - start["rss_kb"]) / max(1, start["rss_kb"]), 2),
            "from_step": start["step"], "to_step": end["step"],
            "log_bytes_per_step": round(per_step), "log_bytes_per_node_step": round(per_step / nnodes, 1),
            "log_mb": round(end["log_bytes"] / 1e6, 2)}


async def run_size(nnodes: int, args: argparse.Namespace, root: Path, text: TextIO) -> dict[str, Any]:
    root.mkdir(parents=True)
    token = secrets.token_urlsafe(24)
    manager = ManagerProcess(root, args.nofile, False, token)
    sim = Sim(manager.port, token, nnodes, args.ranks_per_node, 0.0, 0.0)
    result: dict[str, Any] = {"nodes": nnodes, "ranks": nnodes * args.ranks_per_node, "steps": args.steps,
                              "step_s": args.step_s, "load_before": load_average()}
    pace = f"a step every {args.step_s:g}s" if args.step_s else "as fast as the manager takes them"
    print(f"\n{nnodes} nodes x {args.ranks_per_node} ranks, {args.steps} steps ({pace}; "
          f"load {result['load_before']})", file=text, flush=True)
    try:
        await wait_listening(manager, args.timeout_s)
        await sim.join_all()
        deadline = time.monotonic() + args.timeout_s
        while sim.spawned() < sim.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"generation 0 spawned {sim.spawned()} of {sim.world_size} ranks")
            await asyncio.sleep(0.05)
        out = await train(sim, manager, args, text)
        result.update(out, **summarize(out, nnodes, args.steps), load_after=load_average())
    finally:
        await stop_job(manager, sim)  # (the agents answer its StopNode: closed first, they would be lost nodes)
    return result


def render(result: dict[str, Any], text: TextIO) -> None:
    print(f"\nundying {result['undying']} on {result['cpus']} CPUs ({result['date']})", file=text)
    for size in result["sizes"]:
        if "error" in size:
            print(f"  {size['nodes']} x {result['ranks_per_node']}: failed: {size['error']}", file=text)
            continue
        line = (f"  {size['nodes']} x {result['ranks_per_node']} ({size['ranks']} ranks), {size['steps']} steps: "
                f"manager RSS {size['rss_from_mb']} MB at step {size['from_step']} -> {size['rss_to_mb']} MB at "
                f"step {size['to_step']} ({size['rss_growth_pct']:+.2f}%); log {size['log_bytes_per_step']} B/step "
                f"({size['log_bytes_per_node_step']} B per node-step)")
        commit = size.get("commit_ms")
        if commit:
            line += f"; commit p50 {commit['p50']} ms, p99 {commit['p99']} ms (n={commit['n']})"
        print(line + f"; load {size['load_before']} -> {size['load_after']}", file=text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="64", help="comma-separated node counts (default 64)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--step-s", type=float, default=0.0, help="seconds between steps (0: as fast as the manager "
                   "takes them)")
    p.add_argument("--in-flight", type=int, default=200, help="with --step-s 0: steps a node keeps unacknowledged "
                   "at most (default 200)")
    p.add_argument("--sample-every", type=int, default=0, help="steps between samples (default: a twentieth)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--nofile", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="keep the manager's logs and job dirs here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.node_counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    if args.steps < 20 or args.step_s < 0 or args.in_flight < 1 or not args.node_counts:
        p.error("--steps at least 20, --step-s 0 or more, --in-flight at least 1, --nodes not empty")
    args.sample_every = args.sample_every or max(1, args.steps // 20)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    random.seed(args.seed)
    text = sys.stderr if args.json else sys.stdout
    nofile = raise_fd_limit(args.nofile)
    root = args.out or Path(tempfile.mkdtemp(prefix="undying-bench-flat-"))
    root.mkdir(parents=True, exist_ok=True)
    sizes: list[dict[str, Any]] = []
    try:
        for nnodes in args.node_counts:
            try:
                sizes.append(asyncio.run(run_size(nnodes, args, root / f"n{nnodes}", text)))
            except RuntimeError as e:
                print(f"  {nnodes} nodes failed: {e}", file=text)
                sizes.append({"nodes": nnodes, "error": str(e)})
    except KeyboardInterrupt:
        print("interrupted; the manager was stopped", file=sys.stderr)
        return 130
    finally:
        kill_managers()
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {"date": time.strftime("%Y-%m-%d"), "host": socket.gethostname(), "cpus": os.cpu_count(),
              "undying": str(Path(undying.__file__).parent), "ranks_per_node": args.ranks_per_node,
              "nofile": nofile, "sizes": sizes}
    render(result, text)
    publish(result, args.out, args.json, text, "manager logs and job dirs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
