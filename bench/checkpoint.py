"""Checkpoint benchmark: the training-loop stall of a save, and write throughput against the raw disk.

Method
------
For each state size (``--sizes``, default 10MB,100MB,500MB,2GB; MB and GB are
MiB and GiB), a dict of float32 tensors stands in for model + optimizer state
(tensors of 16 MiB and one remainder, random values). In one run, on the disk
of ``--dir``, and interleaved (each repetition runs every method once, so a
drift in machine load hits all of them alike; the order rotates from one
repetition to the next, since each method inherits the allocator and page
cache state the previous one left; files are deleted and ``sync`` run between
methods, so none pays for another's cleanup):

* copy: ``{k: v.clone()}`` of every tensor, the reference the stall targets.
* undying: ``AsyncCheckpointer.save`` — the stall is the wall time until the
  call returns (the CPU copy plus starting the writer thread); then ``wait``
  for the write, whose throughput is the checkpoint file's bytes over the
  writer's own time (temp folder, torch.save while checksumming, fsync,
  rename, manifest).
* torch.save: a synchronous ``torch.save`` to a file on the same disk, then
  flush and fsync; the stall is all of it.
* DCP: ``torch.distributed.checkpoint.async_save`` in one process
  (``no_dist=True``; no process group is needed) with a ``FileSystemWriter``
  that fsyncs; the stall is the wall time until the call returns (it stages a
  CPU copy first); its total is until the returned future is done.
* dd: ``dd if=/dev/zero of=<dir>/ddtest bs=1M count=N conv=fsync`` for the
  same number of MiB: the raw disk speed the write throughput is held against.

Every figure is the median over ``--repeats`` repetitions, after ``--warmup``
untimed rounds (the first allocation of a state-sized buffer pays page faults
that later ones, reusing freed memory, do not; every method gets the same). Targets (issue 5):
undying's stall <= 1.5 x the copy; its write throughput >= 70 % of dd's. The
1-minute load average before and after each size is reported too: on a
shared machine every figure depends on it. A
size is skipped with a message when the disk or memory cannot hold it (the
state, one copy of it, and the file). Files are removed as soon as each
measurement ends, and the folder at exit.

    python bench/checkpoint.py
    python bench/checkpoint.py --sizes 10MB,100MB --repeats 5 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from undying.checkpoint import AsyncCheckpointer

MiB = 1 << 20
TENSOR_BYTES = 16 * MiB
STALL_TARGET = 1.5  # x the in-memory copy
THROUGHPUT_TARGET = 0.70  # x dd
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": MiB, "MB": MiB, "MIB": MiB,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'10MB' -> 10 MiB in bytes (binary units: what ``dd bs=1M`` and RAM are counted in)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 10MB, 0.5GB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.3g} GiB" if nbytes >= 1 << 30 else f"{nbytes / MiB:.3g} MiB"


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    """float32 tensors of 16 MiB (and one remainder) adding up to ``nbytes``."""
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    left, i = nbytes, 0
    while left > 0:
        chunk = min(TENSOR_BYTES, left)
        state[f"layer{i:04d}.weight"] = torch.rand(max(1, chunk // 4), generator=gen)
        left -= chunk
        i += 1
    return state


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def loadavg() -> float | None:
    """The 1-minute load average: how busy the shared machine was (the numbers depend on it)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    total = 0
    try:
        with open("/proc/meminfo") as f:
            total = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return f"{os.cpu_count()} CPUs ({cpu}), {total / (1 << 30):.0f} GiB RAM, torch {torch.__version__}"


def clear(path: Path) -> None:
    """Remove a measurement's files and let the filesystem settle before the next one is timed.

    Deleting a big file frees (and, on a disk mounted with ``discard``, trims)
    its blocks at the next journal commit; without the sync here the next
    method's fsync would pay for the previous method's cleanup.
    """
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
    os.sync()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the methods: each returns a dict of seconds (and bytes) for one repetition -----


def run_copy(state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    copy = {k: v.clone() for k, v in state.items()}
    elapsed = time.perf_counter() - t0
    del copy
    return {"copy_s": elapsed}


def run_undying(state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    root = work / "undying"
    ckpt = AsyncCheckpointer(root, job_id="bench")
    t0 = time.perf_counter()
    ticket = ckpt.save(1, state)
    stall = time.perf_counter() - t0
    result = ckpt.close()
    assert result is not None
    clear(root)
    return {
        "undying_stall_s": stall,
        "undying_copy_s": ticket.blocking_s,
        "undying_write_s": result.write_s,
        "undying_bytes": float(result.bytes),
    }


def run_torch_save(state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    path = work / "torch_save.pt"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    size = path.stat().st_size
    clear(path)
    return {"torch_save_s": elapsed, "torch_save_bytes": float(size)}


def run_dcp(state: dict[str, torch.Tensor], work: Path) -> dict[str, float]:
    path = work / "dcp"
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        future: Any = dcp.async_save(state, storage_writer=FileSystemWriter(str(path), sync_files=True), no_dist=True)
    stall = time.perf_counter() - t0
    waitable = getattr(future, "upload_completion", future)  # AsyncSaveResponse or a Future
    waitable.result()
    total = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    clear(path)
    return {"dcp_stall_s": stall, "dcp_total_s": total, "dcp_bytes": float(size)}


def run_dd(nbytes: int, work: Path) -> dict[str, float]:
    count = max(1, nbytes // MiB)
    path = work / "ddtest"
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fsync"],
        capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}, check=False,
    )
    wall = time.perf_counter() - t0
    clear(path)
    if proc.returncode != 0:
        raise RuntimeError(f"dd failed ({proc.returncode}): {proc.stderr.strip()}")
    # GNU dd: "524288000 bytes (524 MB, 500 MiB) copied, 0.898 s, 584 MB/s"
    m = re.search(r"^(\d+) bytes.*copied, ([\d.]+) s", proc.stderr, re.MULTILINE)
    written, seconds = (int(m.group(1)), float(m.group(2))) if m else (count * MiB, wall)
    return {"dd_s": seconds, "dd_bytes": float(written)}


def measure(nbytes: int, work: Path, repeats: int, warmup: int, log: Callable[[str], None]) -> dict[str, Any]:
    state = make_state(nbytes)
    runs: dict[str, list[float]] = {}
    load_before = loadavg()
    methods = (("copy", run_copy), ("undying", run_undying), ("torch.save", run_torch_save), ("dcp", run_dcp))
    for rep in range(warmup + repeats):
        timed = rep >= warmup  # the first rounds fault the allocator's memory in for every method alike
        # Rotate the order each round: a method's speed depends on what the one before it left
        # (freed memory the allocator reuses without page faults, dirty pages, a pending trim).
        for name, fn in methods[rep % len(methods):] + methods[: rep % len(methods)]:
            gc.collect()
            for key, value in fn(state, work).items():
                if timed:
                    runs.setdefault(key, []).append(value)
            log(f"  {human(nbytes)} {'rep' if timed else 'warm-up'} {rep - warmup + 1 if timed else rep + 1}: {name} done")
        for key, value in run_dd(nbytes, work).items():
            if timed:
                runs.setdefault(key, []).append(value)
    del state
    gc.collect()
    med = {key: statistics.median(values) for key, values in runs.items()}
    undying_bps = med["undying_bytes"] / med["undying_write_s"]
    dcp_bps = med["dcp_bytes"] / (med["dcp_total_s"] - med["dcp_stall_s"])
    dd_bps = med["dd_bytes"] / med["dd_s"]
    out: dict[str, Any] = {"size_bytes": nbytes, "repeats": repeats, "warmup": warmup,
                           "loadavg_before": load_before, "loadavg_after": loadavg(), **med}
    out.update(
        undying_write_bytes_per_s=undying_bps,
        dcp_write_bytes_per_s=dcp_bps,
        torch_save_bytes_per_s=med["torch_save_bytes"] / med["torch_save_s"],
        dd_bytes_per_s=dd_bps,
        undying_stall_over_copy=med["undying_stall_s"] / med["copy_s"],
        torch_save_over_copy=med["torch_save_s"] / med["copy_s"],
        dcp_stall_over_copy=med["dcp_stall_s"] / med["copy_s"],
        undying_write_over_dd=undying_bps / dd_bps,
        stall_target_met=med["undying_stall_s"] <= STALL_TARGET * med["copy_s"],
        throughput_target_met=undying_bps >= THROUGHPUT_TARGET * dd_bps,
        runs=runs,
    )
    return out


def table(results: list[dict[str, Any]]) -> str:
    head = ("size", "copy", "undying stall", "torch.save", "DCP async stall", "undying write", "DCP write",
            "dd", "write/dd", "load")
    rows = [head]
    for r in results:
        rows.append((
            human(r["size_bytes"]),
            f"{r['copy_s']:.3f} s",
            f"{r['undying_stall_s']:.3f} s ({r['undying_stall_over_copy']:.2f}x)",
            f"{r['torch_save_s']:.3f} s ({r['torch_save_over_copy']:.2f}x)",
            f"{r['dcp_stall_s']:.3f} s ({r['dcp_stall_over_copy']:.2f}x)",
            f"{r['undying_write_bytes_per_s'] / MiB:.0f} MiB/s",
            f"{r['dcp_write_bytes_per_s'] / MiB:.0f} MiB/s",
            f"{r['dd_bytes_per_s'] / MiB:.0f} MiB/s",
            f"{r['undying_write_over_dd']:.0%}",
            f"{r['loadavg_before']:.1f}-{r['loadavg_after']:.1f}" if r["loadavg_before"] is not None else "?",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Checkpoint stall and throughput: undying vs torch.save vs DCP vs dd",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="10MB,100MB,500MB,2GB",
                   help="comma-separated state sizes (binary units: MB = MiB)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions per size (medians are reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of every method first, per size")
    p.add_argument("--dir", type=Path, default=None,
                   help="where files are written (a fresh folder under it; default: the system temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = p.parse_args(argv)
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="undying-bench-ckpt-", dir=base))
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    started = time.time()
    try:
        fsync_dir(work)
        for nbytes in args.size_list:
            free = shutil.disk_usage(work).free
            need_disk = int(nbytes * 1.1) + 512 * MiB
            need_mem = int(nbytes * 2.2) + 1024 * MiB
            avail = mem_available()
            if free < need_disk or avail < need_mem:
                why = (f"needs {human(need_disk)} of disk ({human(free)} free) and "
                       f"{human(need_mem)} of memory ({human(avail)} available)")
                log(f"skipping {human(nbytes)}: {why}")
                skipped.append({"size_bytes": nbytes, "reason": why})
                continue
            log(f"measuring {human(nbytes)} ({args.repeats} repetitions) under {work}")
            results.append(measure(nbytes, work, args.repeats, args.warmup, log))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "benchmark": "checkpoint",
        "date": time.strftime("%Y-%m-%d", time.localtime(started)),
        "machine": machine(),
        "dir": str(base),
        "targets": {"stall_over_copy_max": STALL_TARGET, "write_over_dd_min": THROUGHPUT_TARGET},
        "results": results,
        "skipped": skipped,
        "elapsed_s": time.time() - started,
    }
    out = sys.stderr if args.json else sys.stdout
    print(f"\n{report['machine']}; files under {base}; medians of {args.repeats}", file=out)
    if results:
        print(table(results), file=out)
        for r in results:
            print(f"{human(r['size_bytes'])}: stall {r['undying_stall_over_copy']:.2f}x copy "
                  f"(target <= {STALL_TARGET}x: {'met' if r['stall_target_met'] else 'MISSED'}), "
                  f"write {r['undying_write_over_dd']:.0%} of dd "
                  f"(target >= {THROUGHPUT_TARGET:.0%}: {'met' if r['throughput_target_met'] else 'MISSED'})",
                  file=out)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
