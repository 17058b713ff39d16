"""``bench/recovery.py --ranks 2,4,8,16``: recovery time as the world grows, undying against torchrun.

Method
------
The recovery bench's fault (a SIGKILL of one rank at the start of step S) on
the same two systems, at each world size of ``--ranks``. The workload is the
demo job made small so that 16 ranks fit on 2 cores: by default 2 hidden
layers of 64, batch 32 per rank, and ``--steps`` steps in one epoch at every
size (the samples are ``ranks x batch x steps``, so every rank runs the same
steps at every size). Every step is paced to last at least
``--step-seconds`` (a sleep after its work, the demo's own option, and the
same in bench/plain_ddp.py), so the machine is not saturated and what grows
is the recovery, not a queue of runnable processes.

Only runs with the fault are timed (the fault-free runs and the no-spare run
of the 4-rank bench are left out: they measure other things). One repetition
runs, for each size in turn, both systems (torchrun first in odd repetitions,
undying first in even ones), so the sizes and the two systems are interleaved
over the machine's changing load; ``--repeats`` repetitions. Reported per size and system: the median recovery (kill to every
rank's first step after it) with its minimum and maximum, and the phase
timeline (undying: the manager's incident phases; torchrun: every new worker
started, group up and checkpoint loaded, first step), as the median of each
phase's own length (from the phase before it, the kill for the first). The
slope is the median at the largest size over the median at 4 ranks (or the
smallest), minus 1; the phase that grew is the one whose length grew most
between those two sizes.

Pure helpers (``sweep_workload``, ``phase_lengths``, ``summarize_sizes``) are
unit-tested in tests/unit/test_goodput_bench_ranks.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from recovery import (
    TORCHRUN_PHASES,
    UNDYING_PHASES,
    Fault,
    Workload,
    run_metrics,
    run_torchrun,
    run_undying,
)

__all__ = ["parse_ranks", "sweep_workload", "phase_lengths", "summarize_sizes", "run_sweep",
           "render_sweep", "SWEEP_DEFAULTS"]

TARGET_SLOPE = 0.25  # the goal: undying within +25% from 4 to 16 ranks
# The sweep's own defaults for the recovery bench's options (a small, paced job).
SWEEP_DEFAULTS = {"hidden": 64, "layers": 2, "epochs": 1, "kill_step": 20, "kill_rank": 1, "step_seconds": 0.2,
                  "run_timeout": 240.0}


def parse_ranks(text: str) -> list[int]:
    """``"2,4,8,16"`` -> [2, 4, 8, 16]; ValueError naming the bad input otherwise."""
    sizes = []
    for part in text.split(","):
        if not part.strip().isdigit() or not 2 <= int(part) <= 64:
            raise ValueError(f"--ranks {text!r}: give world sizes from 2 to 64, comma-separated")
        sizes.append(int(part))
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--ranks {text!r}: a size is given twice")
    return sorted(sizes)


def sweep_workload(ranks: int, steps: int, args: argparse.Namespace) -> Workload:
    """The same ``steps`` steps at every size: ``ranks x batch x steps`` samples, one epoch each."""
    return Workload(args.epochs, ranks * args.batch_size * steps, args.features, args.hidden,
                    args.layers, args.batch_size, ranks=ranks, step_seconds=args.step_seconds)


def phase_lengths(phases: dict[str, float], names: Sequence[str]) -> dict[str, float]:
    """Cumulative phase times (seconds after the kill) -> each phase's own length.

    A phase missing from the timeline is left out; the next one's length runs
    from the last phase present (the kill for the first).
    """
    lengths, previous = {}, 0.0
    for name in names:
        if name in phases:
            lengths[name] = max(0.0, phases[name] - previous)
            previous = phases[name]
    return lengths


def _spread(values: Sequence[float | None]) -> dict[str, Any]:
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "each": list(values)}
    return {"median": round(statistics.median(present), 4), "min": round(min(present), 4),
            "max": round(max(present), 4), "each": list(values)}


def summarize_sizes(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per system and size: recovery's median [min, max], phase lengths' medians; the slope and
    the phase that grew most from 4 ranks (or the smallest size) to the largest.

    ``runs[system][ranks]`` is the list of that size's faulty runs (``run_metrics`` views).
    """
    out: dict[str, Any] = {}
    for system, by_size in runs.items():
        names = UNDYING_PHASES if system == "undying" else TORCHRUN_PHASES
        sizes: dict[int, Any] = {}
        for ranks, metrics in sorted(by_size.items()):
            lengths = [phase_lengths(m.get("phases", {}), names) for m in metrics]
            sizes[ranks] = {
                "recovery_s": _spread([m.get("recovery_s") for m in metrics]),
                "phase_lengths_s": {p: _spread([ln.get(p) for ln in lengths])["median"]
                                    for p in names},
                "failed_runs": sum(1 for m in metrics if m.get("rc") != 0),
                "lost_steps": [m.get("lost_steps") for m in metrics],
            }
        out[system] = {"sizes": sizes, **_growth(sizes, names)}
    return out


def _growth(sizes: dict[int, Any], names: Sequence[str]) -> dict[str, Any]:
    if len(sizes) < 2:
        return {"slope": None, "from": None, "to": None, "grew_most": None}
    low = 4 if 4 in sizes and max(sizes) > 4 else min(sizes)
    high = max(sizes)
    a, b = sizes[low]["recovery_s"]["median"], sizes[high]["recovery_s"]["median"]
    slope = round(b / a - 1, 4) if a and b is not None else None
    deltas = {p: round(sizes[high]["phase_lengths_s"][p] - sizes[low]["phase_lengths_s"][p], 4)
              for p in names
              if sizes[high]["phase_lengths_s"].get(p) is not None
              and sizes[low]["phase_lengths_s"].get(p) is not None}
    grew = max(deltas, key=lambda p: deltas[p]) if deltas else None
    return {"slope": slope, "from": low, "to": high, "phase_growth_s": deltas, "grew_most": grew}


def run_sweep(args: argparse.Namespace, sizes: list[int], root: Path,
              progress: TextIO) -> dict[str, Any]:
    """Every repetition: each size in turn, both systems with the fault (torchrun first in odd
    repetitions, undying first in even ones, so neither always follows the other's load)."""
    fault = Fault(rank=args.kill_rank, step=args.kill_step)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {"torchrun": {}, "undying": {}}
    loads: list[tuple[float, float]] = []
    for index in range(1, args.repeats + 1):
        for ranks in sizes:
            workload = sweep_workload(ranks, args.steps, args)
            order = ("torchrun", "undying") if index % 2 else ("undying", "torchrun")
            for system in order:
                run_dir = root / f"rep{index}-{ranks}ranks-{system}"
                print(f"[{index}/{args.repeats}] {ranks} ranks, {system} with the fault ...",
                      end=" ", file=progress, flush=True)
                load = _load()
                if system == "torchrun":
                    run = run_torchrun(workload, fault, run_dir, args.checkpoint_every,
                                       args.run_timeout)
                else:
                    run = run_undying(workload, fault, run_dir, args.run_timeout, args.spares)
                metrics = run_metrics(run, fault, args.warmup, ranks)
                metrics["load_1min"] = load
                loads.append((time.time(), load))
                runs[system].setdefault(ranks, []).append(metrics)
                print(f"rc {run.rc}, {run.wall_s:.1f}s, recovery {metrics.get('recovery_s')} s "
                      f"(load {load:.1f})", file=progress, flush=True)
    workload = sweep_workload(sizes[0], args.steps, args)
    return {
        "sweep": {"ranks": sizes, "steps": args.steps, "step_seconds": args.step_seconds,
                  "hidden": args.hidden, "layers": args.layers, "features": args.features,
                  "batch_size": args.batch_size, "kill_rank": fault.rank,
                  "kill_step": fault.step, "checkpoint_every": args.checkpoint_every,
                  "spares": args.spares, "repeats": args.repeats,
                  "steps_per_size": workload.total_steps,
                  "load_1min": {"min": min(v for _, v in loads), "max": max(v for _, v in loads)}},
        **summarize_sizes(runs),
        "target_slope_max": TARGET_SLOPE,
        "runs": {s: {str(k): v for k, v in by.items()} for s, by in runs.items()},
    }


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1.0


def render_sweep(result: dict[str, Any], out: TextIO) -> None:
    w = result["sweep"]
    print(f"\nrecovery vs world size: MLP {w['features']}->{w['hidden']}x{w['layers']}->1, batch "
          f"{w['batch_size']}/rank, {w['steps_per_size']} steps paced to {w['step_seconds']} s; "
          f"SIGKILL of rank {w['kill_rank']} at step {w['kill_step']}; torchrun checkpoints every "
          f"{w['checkpoint_every']}; {w['repeats']} repetition(s); load {w['load_1min']['min']:.1f}"
          f"-{w['load_1min']['max']:.1f}", file=out)
    print(f"\n{'ranks':>5}  {'undying median [min-max] s':>28}  {'torchrun median [min-max] s':>28}",
          file=out)
    for ranks in w["ranks"]:
        cells = []
        for system in ("undying", "torchrun"):
            r = result[system]["sizes"].get(ranks, result[system]["sizes"].get(str(ranks)))
            rec = r["recovery_s"]
            cells.append("-" if rec["median"] is None else
                         f"{rec['median']:.2f} [{rec['min']:.2f}-{rec['max']:.2f}]")
        print(f"{ranks:>5}  {cells[0]:>28}  {cells[1]:>28}", file=out)
    for system in ("undying", "torchrun"):
        s = result[system]
        slope = "-" if s["slope"] is None else f"{100 * s['slope']:+.0f}%"
        print(f"\n{system}: {s['from']} -> {s['to']} ranks {slope}; grew most: {s['grew_most']} "
              f"({s.get('phase_growth_s', {})})", file=out)
        for ranks, r in s["sizes"].items():
            phases = ", ".join(f"{p} {v:.3f}" for p, v in r["phase_lengths_s"].items()
                               if v is not None)
            print(f"  {ranks} ranks, phase lengths (s): {phases}", file=out)
    print(f"\ngoal: undying's slope <= +{100 * TARGET_SLOPE:.0f}%", file=out)
