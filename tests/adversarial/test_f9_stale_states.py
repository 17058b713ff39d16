"""Finding 9, "Stale and silent states": every way a job ended, or could not start, is told in a few lines.

Before: a SyntaxError or ImportError in the script printed a 44-line traceback
through undying's frames and was "recovered" by replacements that hit it again;
a job that had already succeeded trained again after its last checkpoint when
its command was re-run; with every checkpoint broken the job silently started
from step 1; incidents of a failed job stayed open. (The launcher-SIGKILL
"interrupted" state is in test_f5_relaunch_log.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.jobs import events, start_job
from undying.jobfiles.events import read_job

RANKS = 2


def _undying_lines(log: Path) -> list[str]:
    """The log's lines after the start banner (the job's id, folder, page and status command), which any run
    prints first and which says nothing of the error."""
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    if lines and re.match(r"undying: job \S+ started, ", lines[0]):
        lines = lines[1:]
        while lines and lines[0].startswith("  "):
            lines = lines[1:]
    return lines


@pytest.mark.parametrize(("source", "expected"), [
    ("import torch\nx = (\n", "line 2: SyntaxError: '(' was never closed"),
    ("import torch\nimport no_such_module_here\n", "line 2: ModuleNotFoundError: No module named 'no_such_module_here'"),
], ids=["syntax", "import"])
def test_an_error_in_the_script_is_told_in_a_few_lines_and_exits_1(
    tmp_path: Path, reap: list[int], source: str, expected: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    job = start_job(tmp_path / "job", [], ranks=RANKS, reap=reap, script=script, run_args=["--spares", "1"])
    assert job.wait(timeout=120) == 1
    lines = _undying_lines(tmp_path / "job.log")
    assert len(lines) <= 5, "\n".join(lines)
    assert any(f"{script}, {expected}" in line for line in lines), "\n".join(lines)
    assert not any("Traceback" in line for line in lines)
    if "SyntaxError" not in expected:  # an import error is found by a rank: no replacement was tried
        db = tmp_path / "job" / "events.db"
        assert not [e for e in events(db, "spawned") if e["joining"]]
        (incident,) = read_job(db)["incidents"]
        assert incident["kind"] == "script-error" and incident["status"] == "failed"


def test_rerunning_a_job_that_succeeded_says_so_and_trains_nothing_unless_forced(
    tmp_path: Path, reap: list[int]
) -> None:
    args = ["--spares", "0", "--job-id", "done-once", "--save-every", "16"]
    first = start_job(tmp_path / "job", ["--epochs", "1"], ranks=RANKS, reap=reap, run_args=args)
    assert first.wait(timeout=120) == 0
    commits = len(read_job(tmp_path / "job" / "events.db")["steps"])

    again = start_job(tmp_path / "job", ["--epochs", "1"], ranks=RANKS, reap=reap, run_args=args)
    assert again.wait(timeout=60) == 0
    text = (tmp_path / "job.log").read_text()
    assert "job done-once already succeeded" in text and "--force" in text, text[-2000:]
    assert not list((tmp_path / "job").glob("events.*.db")), "the log of the success was set aside"
    assert len(read_job(tmp_path / "job" / "events.db")["steps"]) == commits, "it trained again"

    forced = start_job(tmp_path / "job", ["--epochs", "1"], ranks=RANKS, reap=reap, run_args=[*args, "--force"])
    assert forced.wait(timeout=120) == 0
    assert list((tmp_path / "job").glob("events.*.db")), "--force ran a new launch"


def test_when_every_checkpoint_is_broken_the_job_stops_with_the_reasons_unless_told_to_start_fresh(
    tmp_path: Path, reap: list[int]
) -> None:
    ckpts = tmp_path / "ckpts"
    args = ["--spares", "0", "--job-id", "broken", "--checkpoint-dir", str(ckpts), "--save-every", "8"]
    first = start_job(tmp_path / "a", ["--epochs", "1"], ranks=RANKS, reap=reap, run_args=args)
    assert first.wait(timeout=120) == 0
    found = sorted(ckpts.glob("step-*"))
    assert found
    for folder in found:  # every one torn: a byte flipped in its state
        state = folder / "state.pt"
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))

    refused = start_job(tmp_path / "b", ["--epochs", "2"], ranks=RANKS, reap=reap, run_args=args)
    assert refused.wait(timeout=60) == 2
    errors = [line for line in (tmp_path / "b.log").read_text().splitlines() if line.startswith("undying: error")]
    assert len(errors) == 1, (tmp_path / "b.log").read_text()[-3000:]
    assert "every checkpoint in" in errors[0] and "--start-fresh" in errors[0]
    for folder in found:
        assert f"{folder.name}: file state.pt has sha256" in errors[0]
    assert not (tmp_path / "b").exists(), "the refused run left its job dir behind"  # (issue 25: nothing created)
    assert sorted(ckpts.glob("step-*")) == found, "the refusal removed checkpoints"

    torn = {f.name: (f / "state.pt").read_bytes() for f in found}
    fresh = start_job(tmp_path / "c", ["--epochs", "2"], ranks=RANKS, reap=reap, run_args=[*args, "--start-fresh"])
    assert fresh.wait(timeout=120) == 0, (tmp_path / "c.log").read_text()[-3000:]
    steps = {c["step"] for c in read_job(tmp_path / "c" / "events.db")["steps"]}
    assert min(steps) == 1 and max(steps) == 64
    # The rejected ones were set aside whole before step 1 (#25 item 10: the new saves at the same steps
    # overwrote them, and pruning removed the rest), and nothing touched them since.
    (aside,) = events(tmp_path / "c" / "events.db", "checkpoints_set_aside")
    assert sorted(aside["names"]) == sorted(torn)
    kept = {f.name: (f / "state.pt").read_bytes() for f in Path(aside["path"]).glob("step-*")}
    assert kept == torn, "a rejected checkpoint was changed or lost"
    assert Path(aside["path"]).parent == ckpts / "rejected"
