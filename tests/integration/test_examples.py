"""The example pairs: what adoption costs in lines, and that the adapted scripts survive faults.

Four pairs, each a plain script and its adapted twin: the DDP example, the
DDP tutorial's pattern (a Trainer class, a snapshot per epoch), a small
GPT written nanoGPT-style and an HF accelerate loop. The GPT's losses under a
crash, a hang and a preemption, and the accelerate loop's under a SIGKILL, are
compared bit for bit with their runs without faults.
"""

from __future__ import annotations

import csv
import difflib
import io
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.oracle import crash, hang
from undying.cli.demo import load_preempted, run_job, run_preempted
from undying.config import EXIT_PREEMPTED
from undying.demo.oracle import compare_runs, load_run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _status(job_dir: Path, *argv: str) -> str:
    """``undying status --job-dir JOB_DIR ARGV`` as a person runs it at an 80-column terminal."""
    p = subprocess.run([sys.executable, "-m", "undying", "status", "--job-dir", str(job_dir), *argv],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "80"})
    assert p.returncode == 0, p.stderr
    return p.stdout


def assert_the_loss_was_logged(job_dir: Path, log: Path, steps: int, ranks: int = 2) -> None:
    """The example called ``step.log(loss=...)`` at every step: the summary, ``status`` and its
    ``--steps`` CSV have the values (the page's "Logged values" chart reads the same); ``status``
    fits 80 columns."""
    rows = list(csv.DictReader(io.StringIO(_status(job_dir, "--steps"))))
    assert {(int(r["step"]), int(r["rank"])) for r in rows} == {
        (s, r) for s in range(1, steps + 1) for r in range(ranks)}
    assert all(float(r["loss"]) >= 0 for r in rows)
    assert re.search(rf"last values \(step {steps}\b.*: loss \d", log.read_text())  # the end summary
    shown = _status(job_dir)
    assert re.search(r"loss \d", shown), shown
    assert [line for line in shown.splitlines() if len(line) > 80] == []


def test_adapting_a_plain_ddp_script_changes_about_ten_lines() -> None:
    plain = (EXAMPLES / "plain_ddp.py").read_text().splitlines()[1:]  # past the docstring line
    adapted = (EXAMPLES / "undying_ddp.py").read_text().splitlines()[1:]
    changed = [
        line for line in difflib.unified_diff(plain, adapted, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---")) and line[1:].strip()
    ]
    removed = sum(1 for line in changed if line.startswith("-"))
    added = sum(1 for line in changed if line.startswith("+"))
    assert max(removed, added) <= 12, changed


def test_the_adapted_example_survives_a_crash(tmp_path: Path) -> None:
    rc = run_job(tmp_path / "job", [], ranks=2, script=EXAMPLES / "undying_ddp.py",
                 faults=[crash(1, 40, "backward")], extra_run_args=["--spares", "0"], timeout_s=150)
    assert rc == 0, (tmp_path / "job.log").read_text()[-3000:]
    run = load_run(tmp_path / "job" / "events.db")
    assert [(i["kind"], i["rank"], i["status"]) for i in run.incidents] == [("crash", 1, "recovered")]
    assert run.rerun_steps == []
    assert len(set(run.digests.values())) == 1, "every rank ends with the same model"
    assert_the_loss_was_logged(tmp_path / "job", tmp_path / "job.log", steps=160)  # 2048 / 32 / 2 x 5


def changed_lines(plain: str, adapted: str) -> int:
    """Lines changed to adopt undying: a replaced line counts once, re-indentation and blank lines not at all.

    Past each file's docstring line (which says how to run it). Per hunk of
    the diff, the larger of the lines removed and the lines added.
    """
    def lines(name: str) -> list[str]:
        return [line.strip() for line in (EXAMPLES / name).read_text().splitlines()[1:] if line.strip()]

    matcher = difflib.SequenceMatcher(None, lines(plain), lines(adapted), autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in matcher.get_opcodes() if op != "equal")


def test_adopting_the_ddp_tutorial_changes_at_most_15_lines_and_the_gpt_loop_at_most_20() -> None:
    assert changed_lines("tutorial_plain.py", "tutorial_undying.py") <= 15
    assert changed_lines("gpt_plain.py", "gpt_undying.py") <= 20
    docs = (EXAMPLES.parent / "docs" / "adopting.md").read_text()
    assert changed_lines("accelerate_plain.py", "accelerate_undying.py") <= 15
    for plain, adapted in (("tutorial_plain.py", "tutorial_undying.py"), ("gpt_plain.py", "gpt_undying.py"),
                           ("accelerate_plain.py", "accelerate_undying.py")):
        assert f"{changed_lines(plain, adapted)} changed lines" in docs, f"docs/adopting.md's count for {adapted}"


def test_the_adapted_tutorial_recovers_a_crash_in_place(tmp_path: Path) -> None:
    rc = run_job(tmp_path / "job", ["3", "1", "--snapshot_path", str(tmp_path / "snapshot.pt")], ranks=2,
                 script=EXAMPLES / "tutorial_undying.py", faults=[crash(1, 40, "backward")],
                 extra_run_args=["--spares", "0"], timeout_s=150)
    assert rc == 0, (tmp_path / "job.log").read_text()[-3000:]
    run = load_run(tmp_path / "job" / "events.db")
    # The dataset is built after undying.init(), which seeds it: no diverged incident, the crash recovered.
    assert [(i["kind"], i["rank"], i["status"]) for i in run.incidents] == [("crash", 1, "recovered")]
    assert run.rerun_steps == [] and len(set(run.digests.values())) == 1
    assert (tmp_path / "snapshot.pt").exists()
    assert_the_loss_was_logged(tmp_path / "job", tmp_path / "job.log", steps=96)  # 2048 / 32 / 2 x 3


def test_the_adapted_gpt_survives_a_crash_a_hang_and_a_preemption_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("GPT_MAX_ITERS", "24")
    gpt, run_args = EXAMPLES / "gpt_undying.py", ["--spares", "0", "--heartbeat-timeout", "3"]
    assert run_job(tmp_path / "base", [], ranks=2, script=gpt, extra_run_args=run_args, timeout_s=150) == 0
    baseline = load_run(tmp_path / "base" / "events.db")
    assert sorted(baseline.losses) == list(range(1, 26))

    rc = run_job(tmp_path / "faults", [], ranks=2, script=gpt, extra_run_args=run_args, timeout_s=170,
                 faults=[crash(1, 5, "backward"), hang(0, 12, "forward")])
    assert rc == 0, (tmp_path / "faults.log").read_text()[-3000:]
    faulty = load_run(tmp_path / "faults" / "events.db")
    comparison = compare_runs(baseline, faulty)
    assert comparison.identical, comparison.reasons
    assert [(i["kind"], i["rank"], i["status"]) for i in faulty.incidents] == [
        ("crash", 1, "recovered"), ("hang", 0, "recovered")]

    job_dir = tmp_path / "preempted"
    rc, sigterm_t = run_preempted(job_dir, [], at_step=8, ranks=2, script=gpt, extra_run_args=run_args,
                                  timeout_s=150)
    assert rc == EXIT_PREEMPTED, (tmp_path / "preempted.log").read_text()[-3000:]
    assert run_job(job_dir, [], ranks=2, script=gpt, extra_run_args=run_args, timeout_s=150) == 0
    merged, _ = load_preempted(job_dir, sigterm_t)
    comparison = compare_runs(baseline, merged)
    assert comparison.identical, comparison.reasons


def test_the_adapted_accelerate_loop_survives_a_sigkill_bit_for_bit(tmp_path: Path) -> None:
    """HF accelerate itself (CPU, gloo): its optimizer wrapper given to job.state, its prepared loader
    (a BatchSamplerShard over a shuffling sampler with its own generator, and a synchronisation of the
    ranks' random states in its iterator) replayed by the replacement to the step, losses identical."""
    pytest.importorskip("accelerate")
    script, run_args = EXAMPLES / "accelerate_undying.py", ["--spares", "0"]
    # the two runs side by side (most of a job's time is its start): step 20 is mid-epoch (16 steps
    # each), so the replacement replays the epoch's first 3 batches
    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(run_job, tmp_path / "base", [], ranks=2, script=script, extra_run_args=run_args,
                           timeout_s=150)
        faulty_rc = pool.submit(run_job, tmp_path / "crash", [], ranks=2, script=script,
                                faults=[crash(1, 20, "backward")], extra_run_args=run_args, timeout_s=150)
        assert base.result() == 0, (tmp_path / "base.log").read_text()[-3000:]
        assert faulty_rc.result() == 0, (tmp_path / "crash.log").read_text()[-3000:]
    baseline = load_run(tmp_path / "base" / "events.db")
    assert sorted(baseline.losses) == list(range(1, 49))
    faulty = load_run(tmp_path / "crash" / "events.db")
    comparison = compare_runs(baseline, faulty)
    assert comparison.identical, comparison.reasons
    assert [(i["kind"], i["rank"], i["status"]) for i in faulty.incidents] == [("crash", 1, "recovered")]
    assert faulty.rerun_steps == []
