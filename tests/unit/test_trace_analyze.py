"""load_trace over trace folders as the tracer leaves them, and the HTML report made from it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.unit.test_trace_summary import synth_job, write_trace
from undying.errors import UsageError
from undying.trace.analyze import TraceDirError, load_trace
from undying.trace.report import write_report


@pytest.fixture
def slow_job(tmp_path: Path) -> Path:
    """A 4-rank job whose rank 1 computes 20% of a step longer from step 31; saves every 20 steps."""
    write_trace(tmp_path / "traces", synth_job(ranks=4, steps=150, seed=21, save_every=20,
                                               slow={1: ("compute", 31, 0.2)}))  # fmt: skip
    return tmp_path / "traces"


def test_a_slow_rank_comes_first_in_the_table_and_in_the_findings(slow_job: Path) -> None:
    table = load_trace(slow_job)
    assert table.job == "J" and table.path == slow_job / "J" and table.other_jobs == []
    assert table.files == 8 and table.bad_lines == 0 and table.skipped == [] and table.comm_known
    assert [(f.kind, f.rank, f.phase) for f in table.findings] == [("slow_rank", 1, "compute")]
    top = table.ranks[0]
    assert top.rank == 1 and top.worst == "compute" and top.score > 0.1
    assert top.comm is not None and all(top.comm < r.comm for r in table.ranks[1:] if r.comm is not None)
    assert {r.rank for r in table.ranks} == {0, 1, 2, 3} and all(r.steps == 150 for r in table.ranks)
    assert all(r.score < 0.05 for r in table.ranks[1:])
    assert [len(rows) for rows in table.steps.values()] == [150] * 4
    data = table.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["findings"][0]["text"].startswith("rank 1 is compute-slow")


def test_pointed_at_a_job_folder_or_a_rank_folder_it_reads_the_whole_job(slow_job: Path) -> None:
    for where in (slow_job / "J", slow_job / "J" / "2"):
        table = load_trace(where)
        assert table.path == slow_job / "J" and len(table.ranks) == 4


def test_stray_files_truncated_lines_and_other_jobs(slow_job: Path, tmp_path: Path) -> None:
    (slow_job / "J" / "notes.txt").write_text("my notes\n")
    (slow_job / "J" / "2" / "debug.log").write_text("not a trace\n")
    (slow_job / "J" / "scratch").mkdir()
    newest = sorted((slow_job / "J" / "3").iterdir())[-1]
    with open(newest, "a") as f:
        f.write('{"v": 1, "kind": "step", "job": "J", "ra')  # the writer was cut off mid-line
    with open(sorted((slow_job / "J" / "0").iterdir())[0], "a") as f:
        f.write("[1, 2]\n\n")  # not a record; blank lines are nothing
    # an older job beside it
    write_trace(slow_job, synth_job(ranks=2, steps=30, seed=1, job="OLD"), job="OLD", files=1)
    old = slow_job / "OLD"
    for p in old.rglob("*.ndjson"):
        os.utime(p, (1, 1))
    table = load_trace(slow_job)
    assert table.job == "J" and table.other_jobs == ["OLD"]
    assert table.bad_lines == 2
    assert table.skipped == ["2/debug.log", "notes.txt", "scratch"]
    assert [(f.rank, f.phase) for f in table.findings] == [(1, "compute")]
    assert load_trace(old).job == "OLD"


def test_a_later_generation_replaces_the_steps_it_reran(tmp_path: Path) -> None:
    recs = synth_job(ranks=2, steps=40, seed=2)
    # rank 0's steps 21-25 ran once in generation 0 (slowly: the fault), then again in generation 1
    rerun = [dict(r, gen=1) for r in recs[0] if 21 <= r["step"] <= 25]
    failed = [dict(r, dur=r["dur"] * 10) for r in recs[0] if 21 <= r["step"] <= 25]
    later = [dict(r, gen=1) for r in recs[0] if r["step"] > 25]
    recs[0] = [r for r in recs[0] if r["step"] <= 20] + failed + later + rerun  # the re-run written last
    recs[1] = [dict(r, gen=1) if r["step"] > 20 else r for r in recs[1]]
    write_trace(tmp_path, recs, files=1)
    table = load_trace(tmp_path)
    assert table.rerun_steps == 5
    steps = {row.step: row for row in table.steps[0]}
    assert sorted(steps) == list(range(1, 41)) and steps[22].gen == 1
    assert steps[22].phases.step < 0.2  # the re-run's time, not the failed attempt's
    assert table.findings == []


def test_data_and_checkpoint_outliers_are_listed(tmp_path: Path) -> None:
    recs = synth_job(ranks=2, steps=100, seed=3, save_every=10)
    for r in recs[1]:
        if r["kind"] == "data" and r["step"] in (33, 77):
            r["dur"] += 0.2  # a long data-loader stall
        if r["kind"] == "ckpt" and r["part"] == "block" and r["step"] == 60:
            r["dur"] += 0.3  # one slow save
    write_trace(tmp_path, recs)
    table = load_trace(tmp_path)
    rank1 = next(r for r in table.ranks if r.rank == 1)
    assert 33 in rank1.outliers["data"] and 77 in rank1.outliers["data"]
    assert rank1.outliers["ckpt"] == [60] and rank1.outlier_counts["ckpt"] == 1
    rank0 = next(r for r in table.ranks if r.rank == 0)
    assert "ckpt" not in rank0.outliers


def test_bad_paths_are_usage_errors_that_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(TraceDirError, match="does not exist: pass the trace dir"):
        load_trace(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"no trace files under .*empty.*tracing on"):
        load_trace(tmp_path / "empty")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(TraceDirError, match="is a file"):
        load_trace(tmp_path / "f.txt")
    d = tmp_path / "t" / "J" / "0"
    d.mkdir(parents=True)
    (d / "20261123T101500.000000Z.ndjson").write_text('{"kind": "data", "step": 1, "dur": 0.1}\n')
    with pytest.raises(TraceDirError, match="no completed step"):
        load_trace(tmp_path / "t")


def test_the_report_is_one_self_contained_file(slow_job: Path, tmp_path: Path) -> None:
    table = load_trace(slow_job)
    path = write_report(table, table.findings, tmp_path / "out" / "report.html")
    text = path.read_text()
    assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # nothing fetched from elsewhere
    assert "<link" not in text and "<script" not in text
    # a heat map of every phase measured (the forward pass too), the stacked bars, the outliers
    assert text.count("data:image/png;base64,") == 8
    for phase in ("step", "fp", "compute", "comm", "data", "ckpt"):
        assert f"<img alt='{phase}: " in text, phase
    assert "rank 1 is compute-slow" in text and "Ranks, slowest first" in text
    assert [p.name for p in path.parent.iterdir()] == ["report.html"]  # no temporary file left
