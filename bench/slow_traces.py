"""Record real per-rank step phases of small real jobs, for testing the slow-rank detector as a pure function.

Each case is a real ``undying run --trace on`` job of the demo script
(``undying/demo/train.py``, DDP over gloo on CPU), fault-free or with one rank
slowed by the real ``undying inject slow``, at a chosen step time: the demo's
own small model (steps of about 10 ms on an idle 2-core machine, far longer
under load), the same padded to a long step (``--step-seconds``: the forward
pass then a tiny share of the step, as the demo's is on a loaded machine), a
larger model whose step is real compute, or the demo's model under ``--trace
comm`` (compute judged as the step less the collective wait). The slowdown
starts at, or off, a window boundary (``AT_STEP``). The recording keeps what the
detector and the offline diagnosis read: every (rank, step)'s phases as
``undying.trace.analyze.load_trace`` rebuilds them from the trace files, where
the slowdown really started (the worker's ``fault_injected`` event) and how long
the worker says it sleeps per step (its log line).

The files land in ``tests/unit/data/slow_traces/`` (one small gzipped JSON per case),
where tests/unit/test_detect_recorded.py replays them through
``SlowDetector`` (no processes, no timings asserted)::

    python bench/slow_traces.py                      # every case (about 6-8 min on 2 busy cores)
    python bench/slow_traces.py --cases r4-long-compute,r2-short-uniform
    python bench/slow_traces.py --out /tmp/traces    # somewhere else
    python bench/slow_traces.py --replay             # the detector over the recordings: a table

``--replay`` records nothing: it runs the detector over every recording, as
the manager would online and as ``undying diagnose`` does offline, and prints
per case the job's step time, where the slowdown began and how large it was
(what the worker says it slept), when it was found, and the start and size
each reported; the fault-free cases' findings are false alarms.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from undying.cli.demo import FaultPlan, run_job
from undying.trace.analyze import load_trace
from undying.trace.step_rows import StepRow, find_slow
from undying.trace.summary import StepPhases

OUT = Path(__file__).resolve().parent.parent / "tests" / "unit" / "data" / "slow_traces"
# Where the slowdown starts, per phase: at, and off, window boundaries (windows are steps 1-10, 11-20, ...).
AT_STEP = {"compute": 37, "data": 44, "ckpt": 46}
FACTOR = 1.5

# Step-time regimes: name -> (script args, what it stands for).
REGIMES: dict[str, tuple[list[str], str]] = {
    "short": ([], "the demo's model: ~10 ms steps on an idle 2-core machine, forward ~4% of it"),
    "long": (["--step-seconds", "0.06"], "padded to 60 ms: the forward pass ~1% of the step (a loaded machine)"),
    "big": (["--hidden", "384", "--layers", "3"], "a larger model: the step is mostly real compute"),
    "comm": ([], "the demo's model with comm markers on too (--trace comm): compute less collective wait"),
}
PHASE_CASES = ("uniform", "compute", "data", "ckpt")


@dataclass(frozen=True)
class Case:
    ranks: int
    regime: str
    phase: str  # "uniform" for a fault-free job

    @property
    def name(self) -> str:
        return f"r{self.ranks}-{self.regime}-{self.phase}"


def all_cases() -> list[Case]:
    return [Case(r, g, p) for r in (4, 2) for g in REGIMES for p in PHASE_CASES]


def injected(events_db: Path) -> dict[str, Any] | None:
    """The slowdown the worker reported starting: rank, step, phase."""
    db = sqlite3.connect(f"file:{events_db}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT rank, data FROM events WHERE kind = 'fault_injected'").fetchall()
    finally:
        db.close()
    for rank, data in rows:
        d = json.loads(data)
        if d.get("kind") == "slow":
            return {"rank": int(rank), "step": d.get("step"), "phase": d.get("phase")}
    return None


def record(case: Case, scratch: Path, steps: int) -> dict[str, Any]:
    args, about = REGIMES[case.regime]
    # 16-sample batches, so an epoch is samples / ranks / 16 steps.
    script_args = [*args, "--samples", str(steps * case.ranks * 16), "--epochs", "1"]
    run_args = ["--spares", "0", "--trace", "comm" if case.regime == "comm" else "on"]
    faults: list[FaultPlan] = []
    if case.phase == "ckpt":
        run_args += ["--save-every", "1"]
    if case.phase != "uniform":
        rank = case.ranks - 1 if case.ranks == 2 else 2
        at = AT_STEP[case.phase] + (3 if case.ranks == 2 else 0)
        faults.append(FaultPlan("slow", rank=rank, at_step=at, phase=case.phase, factor=FACTOR, expect="slow_rank"))
    job_dir = scratch / case.name
    started = time.monotonic()
    rc = run_job(job_dir, script_args, ranks=case.ranks, faults=faults, timeout_s=240, extra_run_args=run_args)
    wall = time.monotonic() - started
    table = load_trace(job_dir / "traces")
    # The worker says what it slept: "rank 2: slowed from step 40: +7.7 ms in compute (...)".
    said = re.search(r"slowed from step (\d+): \+([0-9.]+) ms", (scratch / f"{case.name}.log").read_text(errors="replace"))
    rows = {
        str(rank): [[r.step, r.gen, r.t, *(round(v, 6) if v is not None else None for v in r.phases)]
                    for r in rs]
        for rank, rs in table.steps.items()
    }  # fmt: skip
    return {
        "name": case.name, "ranks": case.ranks, "regime": case.regime, "about": about, "phase": case.phase,
        "script_args": script_args, "run_args": run_args, "rc": rc, "wall_s": round(wall, 1),
        "factor": FACTOR if faults else None, "injected": injected(job_dir / "events.db") if faults else None,
        "extra_ms": float(said.group(2)) if said else None,
        "columns": ["step", "gen", "t", "step_s", "fp", "data", "ckpt", "comm", "compute"], "rows": rows,
        "recorded": time.strftime("%Y-%m-%d"),
    }  # fmt: skip


def replay(folder: Path) -> list[dict[str, Any]]:
    """The detector over every recording in ``folder``: one row per case (see the module doc)."""
    out = []
    for path in sorted(folder.glob("*.json.gz")):
        rec = json.loads(gzip.decompress(path.read_bytes()))
        rows = {int(r): [StepRow(int(r), x[0], x[1], x[2], StepPhases(*x[3:])) for x in xs]
                for r, xs in rec["rows"].items()}  # fmt: skip
        nodes = {r: "vm" for r in rows}
        online = find_slow(rows, nodes, refine=False)[0]
        offline = find_slow(rows, nodes)[0]
        inj = rec["injected"] or {}
        row: dict[str, Any] = {
            "case": rec["name"], "ranks": rec["ranks"],
            "step_ms": round(1000 * median(r.phases.step for rs in rows.values() for r in rs), 1),
            "slowed": f"rank {inj['rank']} {inj['phase']}" if inj else "-", "from_step": inj.get("step"),
            "slept_ms": rec.get("extra_ms"), "findings": len(online),
        }  # fmt: skip
        hit = [f for f in online if inj and (f.rank, f.phase) == (inj["rank"], inj["phase"])]
        off = [f for f in offline if inj and (f.rank, f.phase) == (inj["rank"], inj["phase"])]
        if hit:
            row |= {"found_after": hit[0].evidence["found_at_step"] - inj["step"],
                    "online_since": hit[0].since_step, "online_ms": round(1000 * hit[0].excess_s, 1)}
        if off:
            row |= {"diagnose_since": off[0].since_step, "diagnose_ms": round(1000 * off[0].excess_s, 1),
                    "step_factor": off[0].step_factor}
        out.append(row)
    return out


def render(rows: list[dict[str, Any]]) -> str:
    cols = ["case", "step_ms", "slowed", "from_step", "slept_ms", "findings", "found_after", "online_since",
            "online_ms", "diagnose_since", "diagnose_ms", "step_factor"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in cols) + " |" for r in rows]
    uniform = [r for r in rows if r["slowed"] == "-"]
    slowed = [r for r in rows if r["slowed"] != "-"]
    found = [r for r in slowed if r.get("found_after") is not None and r["found_after"] <= 50 and r["findings"] == 1]
    lines.append(f"\nfault-free jobs: {len(uniform)}, false alarms: {sum(r['findings'] for r in uniform)}; "
                 f"slowed jobs: {len(slowed)}, found within 50 steps with no other finding: {len(found)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="", help="comma-separated case names (default: all): "
                   + ", ".join(c.name for c in all_cases()))
    p.add_argument("--steps", type=int, default=120, help="steps per job (default 120)")
    p.add_argument("--out", type=Path, default=OUT, help=f"where the JSON files go (default {OUT})")
    p.add_argument("--replay", action="store_true", help="record nothing: the detector over the recordings in --out")
    args = p.parse_args(argv)
    if args.replay:
        print(render(replay(args.out)))
        return 0
    cases = all_cases()
    if args.cases:
        wanted = set(args.cases.split(","))
        if unknown := wanted - {c.name for c in cases}:
            p.error(f"unknown case(s) {sorted(unknown)}")
        cases = [c for c in cases if c.name in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="undying-slow-traces-") as tmp:
        for case in cases:
            rec = record(case, Path(tmp), args.steps)
            data = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
            (args.out / f"{case.name}.json.gz").write_bytes(gzip.compress(data, mtime=0))
            print(f"{case.name}: rc {rec['rc']}, {rec['wall_s']} s, injected {rec['injected']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
