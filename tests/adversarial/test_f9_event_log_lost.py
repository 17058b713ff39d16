"""Finding 9, "Stale and silent states": an event log deleted or corrupted under a running job is noticed.

Before: the manager wrote on into the deleted file's inode (or into a file it no
longer recognised) and nobody knew until the job's history was gone. Now the
log checks its file every second: one error line, a fresh log in its place
with the job's facts, incidents and ranks, and the job trains on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.jobs import events, manager_url, start_job, wait_running
from tests.oracle import Oracle
from undying.jobfiles.events import read_job

# 64 steps of 0.08 s: the log is lost at step 10 and checked every second, so ~40 steps are left to
# land in the fresh log. Two epochs on 2 ranks is the configuration other tests use (test_preempt,
# test_checkpoints, f3, f6, f7): the fault-free reference is theirs, not one run for this test only.
SCRIPT_ARGS = ["--epochs", "2", "--step-seconds", "0.08"]
RANKS = 2


@pytest.mark.parametrize("how", ["deleted", "overwritten"])
def test_a_lost_event_log_is_replaced_and_the_job_trains_on(
    oracle: Oracle, tmp_path: Path, reap: list[int], how: str
) -> None:
    job_dir = tmp_path / "job"
    job = start_job(job_dir, SCRIPT_ARGS, ranks=RANKS, reap=reap, run_args=["--spares", "0"])
    wait_running(manager_url(job_dir), min_step=10)
    db = job_dir / "events.db"
    if how == "deleted":
        db.unlink()
    else:
        with open(db, "r+b") as f:  # the same file, its header and first pages garbage
            f.write(b"\xff" * 8192)
    lost_t = time.time()
    assert job.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-3000:]

    log = (tmp_path / "job.log").read_text()
    said = "was deleted while the job ran" if how == "deleted" else "is corrupt"
    assert f"the event log {db} {said}" in log, log[-3000:]
    job_facts = read_job(db)
    assert job_facts["job"]["state"] == "succeeded" and job_facts["job"]["job_id"].startswith("job-")
    assert job_facts["job"]["world_size"] == RANKS and "started_at" in job_facts["job"]  # facts carried over
    (replaced,) = events(db, "event_log_replaced")
    assert said.split(" while")[0] in replaced["problem"]
    # The steps the fresh log holds were committed after the loss, and are the fault-free run's.
    reference = oracle.baseline(SCRIPT_ARGS, RANKS).losses
    fresh = {c["step"]: c["metrics"]["loss"] for c in job_facts["steps"] if c["rank"] == 0}
    assert fresh and max(fresh) == max(reference), sorted(fresh)[-3:]
    assert all(c["t"] >= lost_t - 1 for c in job_facts["steps"])
    assert all(fresh[s] == reference[s] for s in fresh)
    if how == "overwritten":
        (aside,) = job_dir.glob("events.lost-*.db")  # the corrupt file is kept for a post-mortem, never deleted
        assert aside.stat().st_size > 0
