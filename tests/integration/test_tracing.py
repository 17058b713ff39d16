"""Tracing on a live job: the switch from the CLI and from a watched file, records on every rank,
and a slowed rank found online while the job trains on with identical losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.jobs import manager_url, start_job, status, wait_for, wait_running
from tests.oracle import Oracle, slow
from undying.demo.oracle import compare_runs, load_run
from undying.trace.files import is_trace_file


def _records(trace_dir: Path) -> list[dict[str, object]]:
    records = []
    for path in trace_dir.glob("*/*/*"):
        if is_trace_file(path.name):
            for line in path.read_text().splitlines():
                if line.strip():
                    records.append(json.loads(line))
    return records


def _undying(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "undying", *args], capture_output=True, text=True, timeout=30)


# The slowed-rank test's job, each step stretched by a sleep (which changes no number): its
# fault-free baseline serves both.
JOB = ["--epochs", "6", "--samples", "4096"]
SWITCHED_JOB = [*JOB, "--step-seconds", "0.08"]
# The switch is carried CLI -> manager -> agent -> worker and taken at a step's start: a rank
# has it within a step or two of the committed step the status shows after the CLI returned.
# The bound leaves room for a loaded machine, where the line's messages wait for a core too.
_SWITCH_STEPS = 5


def test_the_switch_reaches_every_rank_while_the_job_runs(oracle: Oracle, tmp_path: Path, reap: list[int]) -> None:
    """On, off, from the CLI and from a file, while the job trains: every loss stays what it is untraced."""
    job_dir = tmp_path / "job"
    switch_file = tmp_path / "switch.json"
    job_dir.mkdir()
    process = start_job(job_dir, SWITCHED_JOB, ranks=4, reap=reap,
                        run_args=["--spares", "0", "--trace-switch-file", str(switch_file)])
    url = manager_url(job_dir)
    wait_running(url, min_step=2)
    trace_dir = job_dir / "traces"
    assert _records(trace_dir) == [], "tracing is off by default"

    # The CLI: on with collectives; every rank writes step and comm records from a step or two
    # later (counted in steps, not seconds: a loaded machine slows both alike), not from a restart.
    on = _undying("trace", "on", "--comm", "--job-dir", str(job_dir))
    assert on.returncode == 0, on.stderr
    assert "step on, comm on" in on.stdout
    on_step = status(url)["step"]
    first_step: dict[tuple[object, object], int] = {}

    def every_rank_traces() -> bool:
        for r in _records(trace_dir):
            key = (r["rank"], r["kind"])
            first_step[key] = min(first_step.get(key, 1 << 30), int(r["step"]))  # type: ignore[call-overload]
        return all((rank, kind) in first_step for rank in range(4) for kind in ("step", "comm", "fp", "data"))

    wait_for(every_rank_traces, 10, "step, comm, fp and data records from every rank")
    for rank in range(4):
        assert first_step[(rank, "fp")] <= on_step + _SWITCH_STEPS, (on_step, first_step)
    trace = status(url)["trace"]
    assert (trace["step"], trace["comm"]) == (True, True) and trace["by"].startswith("cli ")

    # Off: comm goes with it (it needs the step markers), and no step after that writes a record.
    off = _undying("trace", "off", "--job-dir", str(job_dir))
    assert off.returncode == 0 and "comm markers turned off too" in off.stdout, off.stdout + off.stderr
    off_step = status(url)["step"]
    wait_for(lambda: status(url)["step"] > off_step + _SWITCH_STEPS + 2, 20, "the steps after the switch off")
    late = [r for r in _records(trace_dir) if int(r["step"]) > off_step + _SWITCH_STEPS]  # type: ignore[call-overload]
    assert late == [], late[:3]

    # The watched file (a ConfigMap's form): on, then a malformed one is reported and ignored.
    switch_file.write_text(json.dumps({"step": "on", "comm": "off"}))
    wait_for(lambda: status(url)["trace"]["step"], 5, "the switch file to turn tracing on")
    assert status(url)["trace"]["by"] == f"file {switch_file}"
    switch_file.write_text('{"step": "maybe"')
    error = wait_for(lambda: status(url)["trace"]["error"], 5, "the malformed switch file to be reported")
    assert str(switch_file) in error
    trace = status(url)["trace"]
    assert (trace["step"], trace["comm"]) == (True, False), "the last good setting stays"
    bad = _undying("trace", "on", "--comm", "--job-id", "no-such-job")
    assert bad.returncode == 2 and "no-such-job" in bad.stderr

    # Comm on and off again (each rebuilds every rank's DDP at one agreed step), then the job ends.
    assert _undying("trace", "on", "--comm", "--job-dir", str(job_dir)).returncode == 0
    wait_for(lambda: status(url)["step"] > status(url)["trace"]["comm_from_step"] + 5, 20, "the comm switch step")
    assert _undying("trace", "off", "--job-dir", str(job_dir)).returncode == 0
    assert process.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-3000:]
    comparison = compare_runs(oracle.baseline(JOB, 4), load_run(job_dir / "events.db"))
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons


@pytest.mark.alone
def test_a_slowed_rank_is_found_while_the_job_trains_on(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(
        tmp_path / "job", [slow(2, 10, "compute", 1.5)], script_args=JOB,
        extra_run_args=("--spares", "0", "--trace", "on"),
    )
    # Four ranks share two cores here, so a rank the scheduler starves for a while may be named
    # too (docs/diagnosis.md); the slowed one must be, from where it was slowed.
    found = [i for i in outcome.incidents if i["kind"] == "slow_rank" and i["rank"] == 2]
    assert found, outcome.incidents
    assert found[0]["detail"]["phase"] == "compute"
    assert 10 <= found[0]["step"] <= 70, found[0]


@pytest.mark.alone
def test_a_slowed_data_loader_is_diagnosed_and_the_trace_opens_in_perfetto(oracle: Oracle, tmp_path: Path) -> None:
    """2 ranks, every marker on (collectives too), saves every 8 steps, rank 1's data wait 1.5x from step 20.

    Online: an incident that says which rank, since which step, by how much (ms
    and factor) and in which phase. Offline: ``undying diagnose`` dates it to
    the step. ``undying trace export --perfetto``: valid trace-event JSON with
    every rank's steps, collectives, checkpoint saves and the incident.
    """
    start = 20
    outcome = oracle.assert_survives(
        tmp_path / "job", [slow(1, start, "data", 1.5)], ranks=2,
        extra_run_args=("--spares", "0", "--trace", "comm", "--save-every", "8"),
    )  # fmt: skip
    found = [i for i in outcome.incidents if i["kind"] == "slow_rank"]
    assert len(found) == 1, [i["error"] for i in found]
    incident = found[0]
    detail = incident["detail"]
    assert (incident["rank"], detail["phase"]) == (1, "data")
    assert start <= detail["since_step"] <= start + 10 and incident["step"] == detail["since_step"]
    assert detail["excess_s"] > 0 and detail["step_factor"] > 1 and detail["factor"] > 1
    job_dir = tmp_path / "job"

    diag = _undying("diagnose", str(job_dir / "traces"), "--json")
    assert diag.returncode == 0, diag.stderr
    [finding] = json.loads(diag.stdout)["findings"]
    assert (finding["rank"], finding["phase"]) == (1, "data")
    assert abs(finding["since_step"] - start) <= 5, finding

    out = tmp_path / "trace.json"
    exported = _undying("trace", "export", "--job-dir", str(job_dir), "--perfetto", str(out))
    assert exported.returncode == 0, exported.stderr
    events = json.loads(out.read_text())["traceEvents"]
    for e in events:
        assert isinstance(e["name"], str) and e["ph"] in ("X", "i", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert {(1, "rank 0"), (2, "rank 1")} <= {(p, n.split(" (")[0]) for p, n in names}
    kinds = {(e["pid"], e["cat"]) for e in events if e["ph"] == "X"}
    assert {(p, k) for p in (1, 2) for k in ("step", "fp", "data", "comm", "ckpt")} <= kinds
    marks = [e for e in events if e["ph"] == "i"]
    assert {e["pid"] for e in marks} == {0, 2} and all(e["args"]["kind"] == "slow_rank" for e in marks)
    # One time axis: rank 1's step records in order, in microseconds, the incident after the slowdown began.
    steps = sorted((e["args"]["step"], e["ts"], e["dur"]) for e in events if e["pid"] == 2 and e.get("cat") == "step")
    assert all(a[1] < b[1] for a, b in zip(steps, steps[1:], strict=False))
    began = next(ts for step, ts, _ in steps if step == start)
    assert all(e["ts"] > began for e in marks)
    assert 1e3 < steps[-1][1] - steps[0][1] < 600e6  # µs: more than a millisecond, less than 10 minutes
