"""``undying trace export --perfetto``: a job's trace files as Chrome trace-event JSON (a real process, real files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_trace_summary import synth_job, write_trace
from undying.trace.perfetto import THREADS, chrome_trace


def export(*argv: str) -> subprocess.CompletedProcess[str]:
    # Run as the CLI runs, and say whether torch was imported on the way (it must not be).
    code = ("import sys, runpy; sys.argv = ['undying', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('undying', run_name='__main__')\n"
            "finally:\n    print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")  # fmt: skip
    return subprocess.run([sys.executable, "-c", code, "trace", "export", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "200"})  # fmt: skip


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export") / "traces"
    write_trace(root, synth_job(ranks=3, steps=40, seed=4, save_every=10))
    return root


def check_format(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace-event rules a viewer relies on; returns the non-metadata events."""
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    for e in events:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert e["ph"] in ("X", "i", "M"), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "i":
            assert isinstance(e["ts"], (int, float)) and e["s"] in ("g", "p", "t"), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index"), e
    return [e for e in events if e["ph"] != "M"]


def test_every_rank_and_kind_on_one_axis_in_microseconds(traces: Path, tmp_path: Path) -> None:
    incidents = [{"id": 1, "kind": "crash", "rank": 1, "step": 20, "action": "recover", "status": "recovered",
                  "fault_t": 1795600000.0 + 1.0, "mttr_s": 0.8, "phases": {"detected": 0.01}, "error": "SIGKILL"},
                 {"id": 2, "kind": "preempt", "rank": -1, "step": 30, "fault_t": 1795600000.0 + 1.5}]  # fmt: skip
    trace = chrome_trace(traces, incidents)
    events = check_format(trace)
    records = [json.loads(line) for p in sorted((traces / "J").glob("*/*.ndjson")) for line in p.read_text().splitlines()]
    t0 = min([r["t"] for r in records] + [i["fault_t"] for i in incidents])
    assert trace["otherData"]["t0_unix"] == t0 and min(e["ts"] for e in events) == 0
    x = [e for e in events if e["ph"] == "X" and e["cat"] != "incident"]
    assert len(x) == len(records)  # every record, one event each
    # Each record where it happened: ts and dur are its t and dur in microseconds.
    by_key = {(e["pid"] - 1, e["cat"], e["args"]["step"], e["ts"]): e for e in x}
    for r in records[:200]:
        e = by_key[(r["rank"], r["kind"], r["step"], round((r["t"] - t0) * 1e6, 3))]
        assert e["dur"] == pytest.approx(r["dur"] * 1e6, abs=1e-3)
    kinds = {(e["pid"], e["cat"]) for e in x}
    assert kinds == {(r + 1, k) for r in range(3) for k in ("step", "fp", "data", "comm", "ckpt")}
    tids = {e["cat"]: e["tid"] for e in x if e["cat"] != "comm"}
    assert tids["step"] == THREADS["step"][0] and tids["fp"] == THREADS["fp"][0]
    assert {e["tid"] for e in x if e["cat"] == "comm"} >= {THREADS["comm"][0]}
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "job J"), (1, "rank 0 (a)"), (2, "rank 1 (a)"), (3, "rank 2 (a)")}
    # Incidents: instants on the job's process, and on the rank's; a recovery slice when it has an MTTR.
    marks = [e for e in events if e["cat"] == "incident"]
    assert sorted((e["pid"], e["ph"], e["name"]) for e in marks) == [
        (0, "X", "incident #1: crash rank 1: recovery"), (0, "i", "incident #1: crash rank 1"),
        (0, "i", "incident #2: preempt"), (2, "X", "incident #1: crash rank 1: recovery"),
        (2, "i", "incident #1: crash rank 1")]  # fmt: skip
    crash = next(e for e in marks if e["ph"] == "i" and e["pid"] == 2)
    assert crash["ts"] == pytest.approx((incidents[0]["fault_t"] - t0) * 1e6)
    assert crash["tid"] not in {tid for tid, _ in THREADS.values()}  # its own thread, not the steps'


def test_the_cli_writes_the_file_without_torch(traces: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "trace.json"
    p = export("--traces", str(traces), "--perfetto", str(out))
    assert p.returncode == 0, p.stderr
    assert "NO-TORCH" in p.stderr
    assert f"to {out}" in p.stdout and "3 ranks" in p.stdout
    check_format(json.loads(out.read_text()))
    p = export("--traces", str(traces / "J" / "1"), "--perfetto", str(out), "--json")  # a rank folder: its job
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["ranks"] == [0, 1, 2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--traces", "{tmp}/missing", "--perfetto", "{tmp}/o.json"], "missing does not exist: pass the trace dir"),
        (["--traces", "{tmp}"], "trace export needs --perfetto OUT.json"),
        (["--manager", "127.0.0.1:1", "--perfetto", "{tmp}/o.json"], "trace export reads files, not a manager"),
        (["--job-dir", "{tmp}/nojob", "--perfetto", "{tmp}/o.json"], "job dir {tmp}/nojob does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, argv: list[str], message: str) -> None:
    p = export(*[a.format(tmp=tmp_path) for a in argv])
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert message.format(tmp=tmp_path) in p.stderr
    assert "Traceback" not in p.stderr


def test_switch_commands_refuse_export_options(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "undying", "trace", "on", "--perfetto", str(tmp_path / "o.json")],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and "--perfetto and --traces go with `undying trace export`" in p.stderr
