"""Honest restarts, with real processes: a script whose every rank raises at start runs twice, not
--max-restarts + 1 times, and the launcher's last line quotes the exception.

The rule alone, and on a real Manager fed exits: tests/unit/test_honest_restarts.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.jobs import events, job_table

REPO = Path(__file__).resolve().parents[2]

# A script written for torchrun (it does not import undying), whose every rank raises before doing
# anything: each says its own rank, the same error all the same.
RAISES_AT_START = textwrap.dedent("""
    import os
    raise FileNotFoundError(f"no dataset at /data/shard-{os.environ['RANK']}.bin")
""")

# A script run with an argument it does not know: argparse prints its usage and exits 2 on every
# rank, before any step.
REFUSES_ITS_ARGUMENTS = textwrap.dedent("""
    import argparse
    argparse.ArgumentParser().parse_args()
""")


@pytest.mark.parametrize(("source", "args", "words"), [
    (RAISES_AT_START, [], "FileNotFoundError: no dataset at /data/shard-"),
    (REFUSES_ITS_ARGUMENTS, ["--epochs", "3"], "SystemExit: 2"),
], ids=["raises", "usage-error"])
def test_every_rank_failing_at_start_ends_the_job_after_two_starts_quoting_the_exception(
        tmp_path: Path, reap: list[int], source: str, args: list[str], words: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    job_dir, log = tmp_path / "job", tmp_path / "job.log"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "undying", "run", "--job-dir", str(job_dir), "--port", "0",
             "--spares", "0", "--stop-grace", "3", "--nproc-per-node", "2", "--max-restarts", "5",
             str(script), *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    reap.append(process.pid)
    assert process.wait(timeout=120) == 1, log.read_text()[-3000:]
    output = log.read_text()
    db = job_dir / "events.db"
    assert len(events(db, "spawned")) == 4, "two starts of two ranks, not six of them (--max-restarts 5)"
    assert [e["kind"] for e in events(db, "restarted")] == ["whole-group"]
    last = output.rstrip().splitlines()[-1]
    assert f"FAILED: every rank raised the same error, twice in a row: {words}" in last, output[-3000:]
    reason = job_table(db)["exit_reason"]
    assert reason.startswith(f"every rank raised the same error, twice in a row: {words}"), reason
    if source is RAISES_AT_START:  # (an exit's has none: its words are the script's, above)
        assert "Traceback (most recent call last)" in reason, "the traceback rides along, below the line"
