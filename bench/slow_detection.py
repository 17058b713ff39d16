"""Slow-rank detection accuracy: real jobs, real slowdowns, the incidents they raise.

Method
------
Every case is a real 4-rank job of the demo script (``undying/demo/train.py``,
DDP over gloo on CPU) under ``undying run --trace on`` (or ``--trace comm``),
sized so that a step is real compute of about 30 ms here (no ``--step-seconds``:
its padding sleep would swallow a compute slowdown, so the job would not really
be slower). At a known step S (``--at-step``, default 20) the bench arms a
slowdown with the real CLI, ``undying inject slow --rank R --factor F --phase P
--at-step S``, which makes the rank's steps F times as long (the extra time
slept in phase P). The incidents are read from the job's event log
(``events.db``) after it ends; the step the slowdown really started at comes
from the log's ``fault_injected`` event.

* slow rank, per phase (compute, data, ckpt) and factor (1.15 and 1.3): was a
  ``slow_rank`` incident raised naming that rank and that phase, and after how
  many steps? "Steps to detect" counts the slowed steps the whole job had
  completed when the manager raised the incident (every rank committed them).
  The ckpt cases run with ``--save-every 1`` (the slowdown sleeps in the
  training loop's checkpoint stall, which happens only at steps that save).
  Compute is run twice: with ``--trace on`` (no comm markers; the detector
  judges compute by the forward pass) and with ``--trace comm`` (compute is the
  step less data, checkpoint and collective wait, counted only when the rank
  also waits less than the others in the collectives; the forward pass is a
  second witness). Target: flagged within 50 steps, every phase, from 1.15 up.
* uniform: 1,000 steps with no slowdown (``--trace on --save-every 10``, and
  ``--trace comm``): the number of incidents. Target: 0.
* slow node: this machine is one host, so every record's ``node`` is its name
  and no node can be told from another online. The bench runs real jobs with
  ranks 2 and 3 both slowed (compute x1.3; once with ``--trace comm``, once
  with ``--trace on``), copies each job's real trace files changing only each
  record's ``node`` (labels the bench assigns: ranks 0-1 "node-a", 2-3
  "node-b"), and runs the offline analyzer
  (``undying.trace.analyze.load_trace``, what ``undying diagnose`` runs: the
  workers' window summaries, then ``SlowDetector``, the code the manager runs
  online) over the copy. Target: one ``slow_node`` finding for node-b, not two
  ``slow_rank``. What the online detector said about the same job (one host:
  two slow ranks, or one) is reported beside it.

Every case also runs the offline analyzer over its own trace files (real node
names): whether it found the slowed rank, and how far the start it gives
(``undying diagnose``'s, to the step) is from the step the slowdown really
began, with the size it gives in ms ("start off by", "diag ms"). It also reports per window the numbers the detector compared
(``SlowDetector.phase_excess``: the slowed rank's phase against the other
ranks' median, the excess as a share of the window's median step and in bars,
the detector's unit, 8% of the step by default), so that a miss can be tuned
from numbers. For the uniform jobs it lists the largest excesses any rank
showed in any window: how close noise came to the bar.

For the detector at several step times (short, long and padded steps, 2 and 4
ranks), over recordings replayed without processes, see bench/slow_traces.py.

Run it from the repository root::

    python bench/slow_detection.py            # every case, text report (about 5-8 min on 2 cores)
    python bench/slow_detection.py --json     # the same, one JSON object as the last stdout line
    python bench/slow_detection.py --cases data-1.15,uniform-comm --out /tmp/sd

Every process started is stopped on exit, Ctrl-C and SIGTERM included: the
launcher's process group with SIGTERM then SIGKILL, any worker it left with
SIGKILL by the PIDs its event log recorded. The bench reports; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery import (  # noqa: E402  (bench/ is a folder of scripts)
    RANKS,
    Workload,
    add_workload_arguments,
    bench_env,
    interrupt,
    launch,
    publish,
    stop,
    undying_worker_pids,
    wait_for,
)

from undying.cli.main import main as cli_main  # noqa: E402
from undying.demo import TRAIN_SCRIPT  # noqa: E402
from undying.jobfiles.events import read_job  # noqa: E402
from undying.jobfiles.jobdir import JobDir  # noqa: E402
from undying.trace.analyze import TraceDirError, load_trace  # noqa: E402
from undying.trace.detect import PHASES, SlowDetector  # noqa: E402

TARGET_STEPS = 50
NODE_LABELS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
INJECT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "slow_rank", "uniform" or "slow_node"
    trace: str  # "on" or "comm"
    phase: str | None = None
    factor: float | None = None
    ranks: tuple[int, ...] = ()
    save_every: int = 0
    min_steps: int = 96  # the job runs at least this many steps


def code_fingerprint() -> dict[str, str]:
    """Short hashes of the detection code the run used (it was being tuned while these ran)."""
    import undying.trace.detect
    import undying.trace.summary
    import undying.worker.tracing

    out = {}
    for module in (undying.trace.detect, undying.trace.summary, undying.worker.tracing):
        assert module.__file__ is not None
        out[module.__name__] = hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:12]
    return out


def all_cases(args: argparse.Namespace) -> list[Case]:
    r = args.rank
    detect_steps = args.at_step + TARGET_STEPS + 26
    cases = []
    for factor in args.factors:
        cases += [
            Case(f"compute-{factor:g}", "slow_rank", "on", "compute", factor, (r,), 0, detect_steps),
            Case(f"compute-comm-{factor:g}", "slow_rank", "comm", "compute", factor, (r,), 0, detect_steps),
            Case(f"data-{factor:g}", "slow_rank", "on", "data", factor, (r,), 0, detect_steps),
            Case(f"ckpt-{factor:g}", "slow_rank", "on", "ckpt", factor, (r,), 1, detect_steps),
        ]
    cases += [
        Case("uniform-on", "uniform", "on", save_every=10, min_steps=args.uniform_steps),
        Case("uniform-comm", "uniform", "comm", min_steps=args.uniform_steps),
        # A node gathers evidence as its least slow rank: give it longer than a rank.
        Case("node", "slow_node", "comm", "compute", args.node_factor, (2, 3), 0, detect_steps + 32),
        Case("node-on", "slow_node", "on", "compute", args.node_factor, (2, 3), 0, detect_steps + 32),
    ]
    return cases


# --- one job ---------------------------------------------------------------------


def run_case(case: Case, args: argparse.Namespace, root: Path, progress: TextIO) -> dict[str, Any]:
    base = Workload(1, args.samples, args.features, args.hidden, args.layers, args.batch_size)
    epochs = -(-case.min_steps // base.steps_per_epoch)
    workload = Workload(epochs, args.samples, args.features, args.hidden, args.layers, args.batch_size)
    run_dir = root / case.name
    run_dir.mkdir(parents=True)
    job_dir = run_dir / "job"
    argv = [sys.executable, "-m", "undying", "run", "-n", str(RANKS), "--port", "0",
            "--job-dir", str(job_dir), "--job-id", case.name, "--spares", "0", "--stop-grace", "3",
            "--trace", case.trace]
    if case.save_every:
        argv += ["--save-every", str(case.save_every)]
    argv += [str(TRAIN_SCRIPT), *workload.script_args()]
    events_db = job_dir / "events.db"
    print(f"{case.name}: {workload.total_steps} steps, --trace {case.trace}"
          + (f", x{case.factor} {case.phase} of rank(s) {list(case.ranks)} at step {args.at_step}"
             if case.ranks else "") + " ...", end=" ", file=progress, flush=True)
    started = time.monotonic()
    deadline = started + args.run_timeout
    process = launch(argv, bench_env(), run_dir / "undying.log")
    armed: list[dict[str, Any]] = []
    try:
        if case.ranks:
            armed = inject_slow(job_dir, process, case, args.at_step,
                                min(deadline, time.monotonic() + INJECT_TIMEOUT_S))
        rc = wait_for(process, deadline)
        wall_s = time.monotonic() - started
    finally:
        leftovers = stop(process, lambda: undying_worker_pids(events_db), str(TRAIN_SCRIPT))
    print(f"rc {rc}, {wall_s:.1f}s", file=progress, flush=True)
    result: dict[str, Any] = {**asdict(case), "steps": workload.total_steps, "rc": rc,
                              "wall_s": round(wall_s, 2), "armed": armed,
                              "leftover_workers_killed": leftovers}
    if not events_db.exists():
        return result
    job = read_job(events_db)
    done = step_done_times(job["steps"])
    injected = injected_steps(events_db)
    result["slowed_from"] = {str(r): injected.get(r) for r in case.ranks}
    result["incidents"] = [compact_incident(i, done) for i in job["incidents"]
                           if i["kind"] in ("slow_rank", "slow_node")]
    result["other_incidents"] = [i["kind"] for i in job["incidents"]
                                 if i["kind"] not in ("slow_rank", "slow_node")]
    start = min((s for s in injected.values() if s is not None), default=None)
    result["job_step_ms"] = step_ms_around(done, start)
    trace_root = job_dir / "traces" / case.name
    try:
        findings, summaries = offline(trace_root)
    except TraceDirError as e:
        result["offline_error"] = str(e)
        findings, summaries = [], []
    result["offline"] = findings
    if case.kind == "slow_rank":
        judge_slow_rank(result, case, start, summaries)
    elif case.kind == "uniform":
        result["incident_count"] = len(result["incidents"])
        result["largest_excess"] = largest_excess(summaries)
    else:
        judge_slow_node(result, case, trace_root, run_dir / "relabelled")
    return result


def inject_slow(job_dir: Path, process: subprocess.Popen[bytes], case: Case, at_step: int,
                deadline: float) -> list[dict[str, Any]]:
    """``undying inject slow`` for each slowed rank, retried until the manager takes it.

    The real command (``undying.cli.main.main``, argument parsing and all), run
    in this process as soon as the manager is up: a new interpreter takes
    seconds to start on 2 busy cores, and the job reaches step 20 within a
    second of its first step.
    """
    assert case.factor is not None and case.phase is not None
    answers: dict[int, dict[str, Any]] = {}
    errors = {r: "the manager never answered" for r in case.ranks}
    pending = list(case.ranks)
    while pending and time.monotonic() < deadline and process.poll() is None:
        if JobDir(job_dir).read_manager() is None:
            time.sleep(0.05)
            continue
        for rank in pending:
            argv = ["inject", "slow", "--rank", str(rank), "--factor", str(case.factor), "--phase",
                    str(case.phase), "--at-step", str(at_step), "--job-dir", str(job_dir), "--json"]
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = cli_main(argv)
                except SystemExit as e:  # argparse
                    rc = int(e.code or 0)
            if rc == 0:
                answers[rank] = json.loads(out.getvalue().strip().splitlines()[-1])
            else:
                errors[rank] = (err.getvalue() or out.getvalue()).strip()
        pending = [r for r in pending if r not in answers]
        if pending:
            time.sleep(0.2)
    for rank in pending:
        print(f"injection into rank {rank} failed: {errors[rank]}", file=sys.stderr)
    return [answers.get(r, {"rank": r, "error": errors[r]}) for r in case.ranks]


# --- what the event log says -----------------------------------------------------


def step_done_times(steps: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> when the last rank committed it (generation 0; no case recovers)."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        by_step[s["step"]].append(s["t"])
    return {step: max(ts) for step, ts in by_step.items() if len(ts) == RANKS}


def injected_steps(events_db: Path) -> dict[int, int | None]:
    """Rank -> the step its slowdown started at (the worker's ``fault_injected`` report)."""
    db = sqlite3.connect(f"file:{events_db}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT rank, data FROM events WHERE kind = 'fault_injected'").fetchall()
    finally:
        db.close()
    out: dict[int, int | None] = {}
    for rank, data in rows:
        d = json.loads(data)
        if d.get("kind") == "slow":
            out[int(rank)] = d.get("step")
    return out


def done_step_at(done: dict[int, float], t: float) -> int:
    """The last step every rank had committed by ``t``."""
    return max((s for s, ts in done.items() if ts <= t), default=0)


def step_ms_around(done: dict[int, float], start: int | None, skip: int = 5) -> dict[str, Any]:
    """The job's median step time before the slowdown and from a few steps after it."""
    times = {s: 1000 * (done[s] - done[s - 1]) for s in done if s - 1 in done and s > skip}
    if start is None:
        return {"all": _med(list(times.values()))}
    before = [v for s, v in times.items() if s < start]
    after = [v for s, v in times.items() if s >= start + skip]
    b, a = _med(before), _med(after)
    return {"before": b, "after": a,
            "ratio": round(a / b, 3) if a is not None and b else None}


def compact_incident(incident: dict[str, Any], done: dict[int, float]) -> dict[str, Any]:
    d = incident.get("detail") or {}
    return {
        "kind": incident["kind"], "rank": incident["rank"], "node": d.get("node"),
        "ranks": d.get("ranks"), "phase": d.get("phase"), "since_step": incident["step"],
        "raised_after_step": done_step_at(done, incident["fault_t"]),
        "factor": _r(d.get("factor")), "excess_ms": _r(1000 * d.get("excess_s", 0.0), 2),
        "step_factor": _r(d.get("step_factor")), "windows": (d.get("evidence") or {}).get("windows"), "error": incident.get("error"),
    }


def compact_finding(f: dict[str, Any]) -> dict[str, Any]:
    return {"kind": f["kind"], "rank": f["rank"], "node": f["node"], "ranks": f["ranks"],
            "phase": f["phase"], "since_step": f["since_step"], "factor": _r(f.get("factor")),
            "excess_ms": _r(1000 * f["excess_s"], 2), "step_factor": _r(f.get("step_factor"))}


# --- the trace files, offline ----------------------------------------------------


def offline(trace_root: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``undying diagnose``'s analyzer over a job's trace files: its findings and window summaries."""
    table = load_trace(trace_root)
    return [compact_finding(f.to_dict()) for f in table.findings], table.summaries


def relabel(trace_root: Path, nodes: dict[int, str], dest: Path) -> Path:
    """A copy of a job's trace files with each record's ``node`` set from ``nodes``, nothing else changed."""
    job = dest / trace_root.name
    for rank_dir in sorted(p for p in trace_root.iterdir() if p.is_dir() and p.name.isdigit()):
        rank = int(rank_dir.name)
        (job / rank_dir.name).mkdir(parents=True, exist_ok=True)
        for path in sorted(rank_dir.iterdir()):
            lines = []
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    lines.append(line)  # as it was: the analyzer counts it
                    continue
                if isinstance(record, dict):
                    record["node"] = nodes[rank]
                    line = json.dumps(record, separators=(",", ":"))
                lines.append(line)
            (job / rank_dir.name / path.name).write_text("".join(f"{x}\n" for x in lines))
    return job


def window_excess(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every (window, phase, rank): its value against the other ranks' median, as the detector compares them.

    ``SlowDetector.phase_excess`` gives the numbers: the excess (seconds per step)
    over the others' median and its evidence. For compute with comm markers
    on, the forward pass (the detector's second witness) is listed too, as basis
    "fp". ``bars`` is the excess over the detector's bar (``threshold`` x the
    window's median step).
    """
    det = SlowDetector(world_size=RANKS)
    slots: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for s in summaries:
        slots[s["window"]][s["rank"]] = s
    rows = []
    for window in sorted(slots):
        slot = {r: s for r, s in slots[window].items() if int(s.get("steps") or 0) >= det.min_steps}
        if len(slot) < 2:
            continue
        step = statistics.median(float(s["step"]) for s in slot.values())
        if step <= 0:
            continue
        comm = ({r: float(s["comm"]) for r, s in slot.items()}
                if all(s.get("comm") is not None for s in slot.values()) else {})
        comm_others = {r: statistics.median(c for q, c in comm.items() if q != r) for r in comm}
        first = min(int(s["first_step"]) for s in slot.values())
        for phase in PHASES:
            witnesses = [det.phase_excess(phase, slot, step, comm, comm_others)]
            if phase == "compute" and comm:
                witnesses.append(det.phase_excess(phase, slot, step, {}, {}))  # the forward pass
            for per_rank in witnesses:
                for rank, (x, ev) in per_rank.items():
                    bar = det.threshold * step
                    rows.append({
                        "window": window, "first_step": first, "phase": phase, "rank": rank,
                        "basis": ev.get("basis"), "step_ms": _r(1000 * step, 2),
                        "value_ms": _r(1000 * ev["value"], 2), "others_ms": _r(1000 * ev["others_median"], 2),
                        "comm_ms": _r(1000 * ev["comm"], 2) if ev.get("comm") is not None else None,
                        "others_comm_ms": (_r(1000 * ev["others_comm"], 2)
                                           if ev.get("others_comm") is not None else None),
                        "excess_pct": _r(100 * x / step, 1), "bars": _r(x / bar, 2),
                        "corroborated": ev.get("corroborated", True),
                    })  # fmt: skip
    return rows


def largest_excess(summaries: list[dict[str, Any]], n: int = 5) -> list[dict[str, Any]]:
    """The uniform job's closest calls: the largest excesses any rank showed in a window.

    Compute by collective time that is not corroborated (the rank also waited
    longer than the others) counts for nothing in the detector, so it is left out.
    """
    rows = [r for r in window_excess(summaries) if r["corroborated"]]
    return sorted(rows, key=lambda r: -(r["bars"] or 0.0))[:n]


# --- judging ---------------------------------------------------------------------


def judge_slow_rank(result: dict[str, Any], case: Case, start: int | None,
                    summaries: list[dict[str, Any]]) -> None:
    """Was a slow_rank incident raised for the slowed rank and phase, and after how many slowed steps?"""
    rank = case.ranks[0]
    right = [i for i in result["incidents"]
             if i["kind"] == "slow_rank" and i["rank"] == rank and i["phase"] == case.phase]
    result["detected"] = bool(right)
    if right and start is not None:
        first = right[0]
        result["raised_after_step"] = first["raised_after_step"]
        result["steps_to_detect"] = first["raised_after_step"] - start + 1
        result["within_target"] = result["steps_to_detect"] <= TARGET_STEPS
    else:
        result["steps_to_detect"] = None
        result["within_target"] = False
    result["wrong_incidents"] = [i for i in result["incidents"] if i not in right[:1]]
    offline_right = [f for f in result["offline"]
                     if f["kind"] == "slow_rank" and f["rank"] == rank and f["phase"] == case.phase]
    result["offline_detected"] = bool(offline_right)
    # Since which step and by how much, as `undying diagnose` says it (to the step) and online (a window).
    if offline_right and start is not None:
        result["diagnose_since_off_by"] = offline_right[0]["since_step"] - start
        result["diagnose_excess_ms"] = offline_right[0]["excess_ms"]
    if right and start is not None:
        result["online_since_off_by"] = right[0]["since_step"] - start
    result["windows"] = [r for r in window_excess(summaries)
                         if r["rank"] == rank and r["phase"] == case.phase]


def judge_slow_node(result: dict[str, Any], case: Case, trace_root: Path, scratch: Path) -> None:
    """The analyzer over the job's trace files relabelled: ranks 0-1 on node-a, 2-3 on node-b."""
    slowed = sorted(case.ranks)
    node = NODE_LABELS[slowed[0]]
    result["node_labels"] = {str(r): n for r, n in NODE_LABELS.items()}
    try:
        findings, labelled = offline(relabel(trace_root, NODE_LABELS, scratch))
    except (TraceDirError, OSError) as e:
        result["labelled_error"] = str(e)
        findings, labelled = [], []
    nodes = [f for f in findings if f["kind"] == "slow_node"]
    ranks = [f for f in findings if f["kind"] == "slow_rank"]
    result["labelled_findings"] = findings
    result["node_reported"] = (len(nodes) == 1 and nodes[0]["node"] == node
                               and sorted(nodes[0]["ranks"]) == slowed and nodes[0]["phase"] == case.phase)
    result["slowed_ranks_reported_as_ranks"] = sorted({f["rank"] for f in ranks if f["rank"] in slowed})
    result["windows"] = [r for r in window_excess(labelled)
                         if r["rank"] in slowed and r["phase"] == case.phase]


# --- the report ------------------------------------------------------------------


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    slow = [r for r in results if r["kind"] == "slow_rank"]
    uniform = [r for r in results if r["kind"] == "uniform"]
    node = [r for r in results if r["kind"] == "slow_node"]
    return {
        "workload": {"ranks": RANKS, "features": args.features, "hidden": args.hidden, "layers": args.layers,
                     "batch_size": args.batch_size, "samples": args.samples, "at_step": args.at_step,
                     "rank": args.rank},
        "targets": {"steps_to_detect_max": TARGET_STEPS, "uniform_incidents": 0, "node": "one slow_node"},
        "summary": {
            "slow_rank_detected": f"{sum(1 for r in slow if r.get('within_target'))}/{len(slow)} within "
                                  f"{TARGET_STEPS} steps",
            "slow_rank_misses": [r["name"] for r in slow if not r.get("within_target")],
            "slow_rank_wrong_incidents": sum(len(r.get("wrong_incidents", [])) for r in slow),
            "uniform_incidents": {r["name"]: r.get("incident_count") for r in uniform},
            "uniform_steps": {r["name"]: r["steps"] for r in uniform},
            "node_reported_as_node": {r["name"]: r.get("node_reported") for r in node},
        },
        "cases": results,
    }


def render(result: dict[str, Any], out: TextIO) -> None:
    w = result["workload"]
    print(f"\nworkload: {w['ranks']} ranks (gloo, CPU), MLP {w['features']}->{w['hidden']}x{w['layers']}->1, "
          f"batch {w['batch_size']}/rank; slowdowns armed at step {w['at_step']}", file=out)
    print(f"\n{'case':20} {'trace':5} {'job ms before->after':>21} {'slowed from':>11} {'incident':>22} "
          f"{'steps':>6} {'<=50':>5} {'others':>6} {'offline':>7} {'start off by':>12} {'diag ms':>7}", file=out)
    for r in result["cases"]:
        if r["kind"] != "slow_rank":
            continue
        js = r.get("job_step_ms", {})
        ms = f"{_f(js.get('before'), '{:.1f}')} -> {_f(js.get('after'), '{:.1f}')}"
        right = [i for i in r.get("incidents", []) if i not in r.get("wrong_incidents", [])]
        inc = f"{right[0]['kind']} r{right[0]['rank']} {right[0]['phase']}" if right else "none"
        slowed = ",".join(str(v) for v in r.get("slowed_from", {}).values())
        print(f"{r['name']:20} {r['trace']:5} {ms:>21} {slowed:>11} {inc:>22} "
              f"{_f(r.get('steps_to_detect'), '{:d}'):>6} {'yes' if r.get('within_target') else 'NO':>5} "
              f"{len(r.get('wrong_incidents', [])):>6} {'yes' if r.get('offline_detected') else 'no':>7} "
              f"{_f(r.get('diagnose_since_off_by'), '{:+d}'):>12} {_f(r.get('diagnose_excess_ms'), '{:.1f}'):>7}",
              file=out)
        for i in r.get("wrong_incidents", []):
            print(f"    other incident: {i['error']}", file=out)
        if not r.get("within_target"):
            print("    windows (the rank's phase vs the others' median, excess as % of the window's step "
                  "and in bars):", file=out)
            for row in r.get("windows", []):
                print(f"    {_window_row(row)}", file=out)
    for r in result["cases"]:
        if r["kind"] == "uniform":
            saves = f", --save-every {r['save_every']}" if r["save_every"] else ""
            print(f"\n{r['name']}: {r['steps']} uniform steps, --trace {r['trace']}{saves}: "
                  f"{r.get('incident_count')} incident(s) online, {len(r.get('offline', []))} offline",
                  file=out)
            for i in r.get("incidents", []):
                print(f"    incident: {i['error']}", file=out)
            closest = r.get("largest_excess", [])[:3]
            if closest:
                print("    closest calls (largest excess of any rank in any window):", file=out)
                for c in closest:
                    print(f"    rank {c['rank']} {c['phase']}: {_window_row(c)}", file=out)
        elif r["kind"] == "slow_node":
            print(f"\nslow node: ranks {r['ranks']} x{r['factor']} {r['phase']} from step(s) "
                  f"{list(r.get('slowed_from', {}).values())}, --trace {r['trace']}", file=out)
            print("    online (one host, every rank's node is its name): "
                  + ("; ".join(f"{i['kind']} rank {i['rank']} {i['phase']} since step {i['since_step']}"
                               for i in r.get("incidents", [])) or "no incident"), file=out)
            print(f"    offline, ranks labelled {r.get('node_labels')}: "
                  + ("; ".join(f"{f['kind']} {f['node'] if f['kind'] == 'slow_node' else 'rank ' + str(f['rank'])}"
                               f" {f['phase']} since step {f['since_step']}" for f in r.get("labelled_findings", []))
                     or "no finding"), file=out)
            print(f"    reported as one node: {'yes' if r.get('node_reported') else 'NO'}", file=out)
            if not r.get("node_reported"):
                start = min((v for v in r.get("slowed_from", {}).values() if v is not None), default=0)
                for row in r.get("windows", []):
                    if row["first_step"] >= start - 10:
                        print(f"    rank {row['rank']}: {_window_row(row)}", file=out)
    s = result["summary"]
    print(f"\nslow ranks flagged: {s['slow_rank_detected']} (misses: {', '.join(s['slow_rank_misses']) or 'none'}); "
          f"wrong incidents in those jobs: {s['slow_rank_wrong_incidents']}", file=out)
    print(f"uniform jobs, incidents: {s['uniform_incidents']} [0]", file=out)
    print(f"slow node reported as a node: {s['node_reported_as_node']}", file=out)


def _window_row(row: dict[str, Any]) -> str:
    comm = (f", comm wait {row['comm_ms']:.2f} vs {row['others_comm_ms']:.2f} ms"
            if row.get("comm_ms") is not None and row.get("others_comm_ms") is not None else "")
    return (f"steps {row['first_step']:>4}+ step {row['step_ms']:6.1f} ms, {row['basis']} "
            f"{row['value_ms']:6.2f} vs {row['others_ms']:6.2f} ms: excess {row['excess_pct']:5.1f}% = "
            f"{row['bars']:5.2f} bars{comm}{'' if row['corroborated'] else ' (not corroborated)'}")


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _r(value: Any, digits: int = 3) -> Any:
    return round(value, digits) if isinstance(value, float) else value


def _med(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Slow-rank detection accuracy on real jobs",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")], default=[1.15, 1.3],
                   help="slowdown factors, comma-separated")
    p.add_argument("--rank", type=int, default=2, help="the rank slowed in the slow-rank cases")
    p.add_argument("--at-step", type=int, default=20, help="the slowdowns start at this step")
    p.add_argument("--node-factor", type=float, default=1.3, help="the slow-node case's factor")
    p.add_argument("--uniform-steps", type=int, default=1000, help="steps of the uniform jobs (at least)")
    p.add_argument("--cases", default="", help="run only these cases (comma-separated names)")
    add_workload_arguments(p, epochs=None, hidden=512, layers=3)
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds for one job")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout, the report on stderr")
    p.add_argument("--out", type=Path, default=None, help="keep every job's logs, traces and result.json")
    args = p.parse_args(argv)
    if not 0 <= args.rank < RANKS:
        p.error(f"--rank must be in 0..{RANKS - 1}")
    if args.at_step < 5:
        p.error("--at-step must be >= 5 (the slowdown is sized from the rank's recent steps)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = all_cases(args)
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c.name for c in cases}
        if unknown:
            sys.exit(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c.name for c in cases)}")
        cases = [c for c in cases if c.name in wanted]
    signal.signal(signal.SIGTERM, interrupt)
    text = sys.stderr if args.json else sys.stdout
    root = args.out or Path(tempfile.mkdtemp(prefix="undying-bench-slow-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    code_before = code_fingerprint()
    try:
        results = [run_case(c, args, root, sys.stderr) for c in cases]
    except KeyboardInterrupt:
        print("interrupted; every process started was stopped", file=sys.stderr)
        return 130
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    result = report(args, results)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["code"] = code_before
    if code_fingerprint() != code_before:
        result["code_changed_during_run"] = True
        print("warning: the detection code changed on disk while the benchmark ran", file=text)
    render(result, text)
    publish(result, args.out, args.json, text, "logs, traces and records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
