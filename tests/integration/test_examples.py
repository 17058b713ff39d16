"""The example pair: adoption costs about ten lines, and the adapted script survives a crash."""

from __future__ import annotations

import difflib
from pathlib import Path

from tests.oracle import crash
from undying.cli.demo import run_job
from undying.demo.oracle import load_run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
