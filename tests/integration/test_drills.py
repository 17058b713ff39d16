"""The tutorial's drill, as a person runs it: armed before the run, it fires at its step; a drill
that could never fire as asked is refused while the job trains.

A real job (`undying run` of the demo script, 2 ranks) and a real `undying inject --wait` started
before it; the refusals (a step passed, past the job's end) go to the same manager's API while it
trains. The manager's rules alone are tests/unit/test_drills.py's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.jobs import events, manager_url, start_job, wait_running
from undying.cli.client import api_post
from undying.errors import ConflictError
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.tokens import find_token

# 1 epoch of 32 steps, slow enough that the job still trains when the refusals are asked for.
JOB_ARGS = ["--epochs", "1", "--step-seconds", "0.1"]
LAST = 32
AT_STEP = 8


def test_a_drill_armed_before_the_run_fires_at_its_step_and_a_late_one_is_refused(
        tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"
    drill = subprocess.Popen(
        [sys.executable, "-m", "undying", "inject", "crash", "--rank", "1", "--at-step", str(AT_STEP),
         "--wait", "120", "--job-dir", str(job_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    reap.append(drill.pid)
    launcher = start_job(job_dir, JOB_ARGS, ranks=2, reap=reap)
    out, err = drill.communicate(timeout=120)
    assert drill.returncode == 0, err
    assert out.startswith("armed: crash of rank 1") and out.endswith(f"at step {AT_STEP}, phase step\n"), out

    url = manager_url(job_dir)
    token = find_token(JobDir(job_dir).path, None)
    wait_running(url, min_step=AT_STEP + 4, timeout=120)
    for at_step, words in ((3, "step 3 has passed: rank 1 committed step"),
                           (LAST + 1, f"step {LAST + 1} is past the job's end: its last step is {LAST}")):
        with pytest.raises(ConflictError, match=words):
            api_post(url, "/api/inject", {"kind": "crash", "rank": 1, "at_step": at_step}, token=token)

    assert launcher.wait(timeout=180) == 0
    db = job_dir / "events.db"
    fired = [(e["kind"], e["step"]) for e in events(db, "fault_injected")]
    assert fired == [("crash", AT_STEP)]  # at the step asked, not late
    assert [(e["at_step"]) for e in events(db, "fault_armed")] == [AT_STEP]  # the refused ones armed nothing
