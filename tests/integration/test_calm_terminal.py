"""A fault the job handles is one line on the launcher's terminal and its recovery one more; the
details (the survivors' lines, gloo's words) are in the event log, and on the terminal with -v."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path
from typing import Any

from tests.oracle import crash
from undying.cli.demo import run_job

FAULT = re.compile(r"WARNING\] job \S+ gen \d+: crash of rank 1 at step \d+ -> replace \(")
RECOVERY = re.compile(r"INFO\] job \S+ gen \d+: recovered from crash of rank 1 in \d+\.\d+ s, restored step \d+$")
DETAILS = ("collective failed", "leaving generation", "GLHF", "Traceback", "pair.cc")


def _launch(job_dir: Path, *, verbose: bool) -> list[str]:
    """The launcher's output (stdout and stderr) of a 2-rank demo job whose rank 1 dies in step 5's
    all-reduce."""
    rc = run_job(job_dir, ["--epochs", "1", "--samples", "512"], ranks=2, fault=crash(1, 5, "backward"),
                 timeout_s=120, extra_run_args=["--spares", "0"], verbose=verbose)
    text = (job_dir.parent / f"{job_dir.name}.log").read_text(errors="replace")
    assert rc == 0, text[-3000:]
    return text.splitlines()


def _comm_failures(job_dir: Path) -> list[dict[str, Any]]:
    """The job's comm_failure events, each with its rank."""
    con = sqlite3.connect(job_dir / "events.db")
    try:
        return [{"rank": rank, **json.loads(data)} for rank, data in
                con.execute("SELECT rank, data FROM events WHERE kind = 'comm_failure' ORDER BY id")]
    finally:
        con.close()


def test_a_handled_crash_is_one_fault_line_and_one_recovery_line_and_v_shows_the_details(tmp_path: Path) -> None:
    calm = _launch(tmp_path / "calm", verbose=False)
    text = "\n".join(calm)
    assert len([line for line in calm if FAULT.search(line)]) == 1, text
    assert len([line for line in calm if RECOVERY.search(line)]) == 1, text
    # The fault is the one warning; nothing of the survivor's, nor gloo's words, reaches the terminal.
    assert [line for line in calm if "WARNING" in line] == [line for line in calm if FAULT.search(line)], text
    assert not [word for word in DETAILS if word in text], text
    # ... they are in the job's log: the survivor's failed collective, with the error's words.
    failures = _comm_failures(tmp_path / "calm")
    assert [f["rank"] for f in failures] == [0] and failures[0]["error"], failures

    loud = _launch(tmp_path / "loud", verbose=True)
    text = "\n".join(loud)
    assert len([line for line in loud if FAULT.search(line)]) == 1, text
    assert len([line for line in loud if RECOVERY.search(line)]) == 1, text
    (failure,) = _comm_failures(tmp_path / "loud")
    # The survivor's own line, with the error as the event log holds it (gloo's words).
    said = [line for line in loud if "collective failed" in line]
    assert len(said) == 1 and f"rank 0 step {failure['step']}: collective failed" in said[0], text
    assert failure["error"].splitlines()[0] in said[0], (failure, said)
