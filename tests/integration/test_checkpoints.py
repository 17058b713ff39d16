"""Persistent checkpoints end to end: periodic async saves, resume, the dying gasp on SIGTERM, restart.

Real launchers, real SIGTERM and SIGKILL, real files; every run is compared
with the fault-free run of the same arguments (the oracle).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.integration.jobs import (
    alive,
    events,
    job_table,
    manager_url,
    start_job,
    status,
    wait_for,
    wait_running,
)
from tests.oracle import Oracle
from undying.checkpoint import Manifest, scan
from undying.cli.demo import load_preempted, run_job, run_preempted
from undying.config import EXIT_PREEMPTED
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.events import LogReader

# 2 ranks, 32 steps an epoch; steps of at least 50 ms so a SIGTERM lands mid-run.
ARGS = ["--epochs", "2", "--step-seconds", "0.05"]


def _first_launch_db(job_dir: Path) -> Path:
    return sorted(job_dir.glob("events.*.db"), key=lambda p: p.stat().st_mtime)[-1]


def test_periodic_checkpoints_then_sigterm_dying_gasp_then_resume_bit_identical(tmp_path: Path, oracle: Oracle) -> None:
    job_dir = tmp_path / "job"
    run_args = ["--spares", "0", "--save-every", "5", "--keep", "2"]
    rc, sigterm_t = run_preempted(job_dir, ARGS, at_step=12, ranks=2, extra_run_args=run_args)
    assert rc == EXIT_PREEMPTED, (tmp_path / "job.preempted.log").read_text()[-3000:]
    first = job_dir / "events.db"
    saved = events(first, "checkpoint_saved")
    periodic = [e for e in saved if e["kind"] == "periodic"]
    steps = [e["step"] for e in periodic]
    assert steps[:1] == [5] and all(step % 5 == 0 for step in steps), steps
    if 10 not in steps:
        # A save due while the one before is still being written is skipped (never queued behind
        # it): on a loaded machine step 5's write can outlast five 50 ms steps. Then, and only then.
        with LogReader(first) as reader:
            written = {e.data["step"]: e.t for e in reader.events("checkpoint_saved")}
            step_10 = min(t for rank, step, t in reader.commit_times() if step == 10)
        assert written[5] > step_10, f"step 10 was not saved though step 5's write ended before it: {steps}"
    assert all(e["blocking_s"] > 0 and e["write_s"] > 0 and e["bytes"] > 0 for e in periodic)
    (gasp,) = [e for e in saved if e["kind"] == "dying-gasp"]
    job = job_table(first)
    assert job["state"] == "preempted"
    assert job["exit_reason"].startswith(f"preempted, checkpoint at step {gasp['step']}")
    assert job["preemption"]["checkpoint_step"] == gasp["step"] >= 12
    assert job["preemption"]["grace_period_s"] >= 5
    # The dying gasp is on disk, valid, and retention kept --keep 2 (the newest is always kept).
    found = scan(job_dir / "checkpoints")
    assert all(c.valid for c in found) and len(found) <= 2
    assert found[-1].step == gasp["step"] and found[-1].kind == "dying-gasp"
    manifest = Manifest.from_json((Path(found[-1].path) / "manifest.json").read_bytes())
    assert manifest.world_size == 2 and manifest.job_id == "job"

    # The same command again resumes from the dying gasp: nothing lost, every loss identical.
    assert run_job(job_dir, ARGS, ranks=2, extra_run_args=run_args) == 0
    (resumed,) = events(job_dir / "events.db", "resumed")
    assert resumed["step"] == gasp["step"] and resumed["kind"] == "dying-gasp" and resumed["skipped"] == []
    merged, incident = load_preempted(job_dir, sigterm_t)
    comparison = compare_runs(oracle.baseline(ARGS, 2), merged)
    assert comparison.identical, comparison.reasons
    assert comparison.lost_steps == 0
    assert incident["kind"] == "preempt" and incident["action"] == "dump" and incident["status"] == "recovered"
    assert incident["mttr_s"] > incident["phases"]["checkpoint_written"] > 0


def test_a_corrupt_newest_checkpoint_is_skipped_on_resume(tmp_path: Path, oracle: Oracle) -> None:
    job_dir = tmp_path / "job"
    run_args = ["--spares", "0", "--save-every", "4"]
    rc, _ = run_preempted(job_dir, ARGS, at_step=10, ranks=2, extra_run_args=run_args)
    assert rc == EXIT_PREEMPTED
    found = scan(job_dir / "checkpoints")
    newest, previous = found[-1], found[-2]
    # The newest is the dying gasp, or the periodic checkpoint of the stop step when one was due there.
    assert newest.valid and previous.valid and newest.step > previous.step
    state = Path(newest.path) / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, wrong checksum
    state.write_bytes(bytes(data))

    assert run_job(job_dir, ARGS, ranks=2, extra_run_args=run_args) == 0
    db = job_dir / "events.db"
    (skipped,) = events(db, "checkpoint_skipped")
    assert skipped["name"] == newest.name and "sha256" in skipped["reason"]  # a job checksums with SHA-256 (its MAC vouches for it)
    (resumed,) = events(db, "resumed")
    assert resumed["step"] == previous.step
    assert resumed["skipped"] == [{"name": newest.name, "reason": skipped["reason"]}]
    # The resume says it re-runs steps the last launch committed, and why (#25 item 13).
    rerun = resumed["rerun"]
    assert rerun["first"] == previous.step + 1 and rerun["last"] >= newest.step
    assert rerun["why"] == f"the last launch's checkpoint of step {newest.step} was rejected (said above)"
    merged, _ = load_preempted(job_dir, 0.0)
    comparison = compare_runs(oracle.baseline(ARGS, 2), merged)
    # Every loss is identical; the steps after the older checkpoint were run twice, and counted.
    assert comparison.mismatched_steps == [] and comparison.missing_steps == [] and comparison.digests_equal
    assert comparison.lost_steps == newest.step - previous.step


def test_sigterm_to_a_workers_process_group_takes_the_same_dying_gasp(tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, ["--epochs", "50", "--step-seconds", "0.05"], ranks=2,
                         run_args=["--spares", "0", "--job-id", "job"], reap=reap)
    url = manager_url(job_dir)
    wait_running(url, min_step=3)
    workers = [r["pid"] for r in status(url)["ranks"]]
    reap.extend(workers)
    os.killpg(workers[1], signal.SIGTERM)  # the worker's own session: as `kill -TERM -<pgid>` would
    assert launcher.wait(timeout=45) == EXIT_PREEMPTED
    wait_for(lambda: not any(alive(p) for p in workers), 10, "every worker to exit")
    db = job_dir / "events.db"
    assert events(db, "sigterm")
    (preempted,) = events(db, "preempted")
    found = scan(job_dir / "checkpoints")
    assert found[-1].valid and found[-1].kind == "dying-gasp" and found[-1].step == preempted["step"] >= 3
    assert job_table(db)["preemption"]["reason"] == "SIGTERM to rank 1"


def test_a_second_sigterm_soon_after_reuses_the_dying_gasp(tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"
    rc, _ = run_preempted(job_dir, ARGS, at_step=5, ranks=2, extra_run_args=["--spares", "0"])
    assert rc == EXIT_PREEMPTED
    before = [(c.name, c.manifest.created_at if c.manifest else 0) for c in scan(job_dir / "checkpoints")]
    launcher = start_job(job_dir, ARGS, ranks=2, run_args=["--spares", "0", "--job-id", "job"], reap=reap)
    manager_url(job_dir)
    wait_for(lambda: events(job_dir / "events.db", "resumed"), 30, "the resume")
    os.kill(launcher.pid, signal.SIGTERM)
    assert launcher.wait(timeout=45) == EXIT_PREEMPTED
    (reused,) = events(job_dir / "events.db", "dying_gasp_reused")
    assert reused["path"].endswith(before[-1][0])
    after = [(c.name, c.manifest.created_at if c.manifest else 0) for c in scan(job_dir / "checkpoints")]
    assert after == before  # nothing written again
    assert "reused the dying gasp" in job_table(job_dir / "events.db")["exit_reason"]


def test_every_rank_killed_at_once_restarts_the_job_from_the_checkpoint(tmp_path: Path, reap: list[int],
                                                                       oracle: Oracle) -> None:
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, ARGS, ranks=2, reap=reap,
                         run_args=["--spares", "0", "--job-id", "job", "--save-every", "5", "--max-restarts", "2"])
    url = manager_url(job_dir)
    wait_for(lambda: (status(url).get("checkpoints") or {}).get("last") and status(url)["step"] >= 12, 60,
             "a checkpoint and step 12")
    workers = [r["pid"] for r in status(url)["ranks"]]
    reap.extend(workers)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    assert launcher.wait(timeout=60) == 0, (tmp_path / "job.log").read_text()[-3000:]
    run = load_run(job_dir / "events.db")
    restarts = [i for i in run.incidents if i["action"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["status"] == "recovered", run.incidents
    detail = restarts[0]["detail"]
    assert f"rolls back to step {detail['checkpoint_step']}" in detail["restore_plan"], detail
    (restarted,) = events(job_dir / "events.db", "restarted")
    assert restarted["step"] == detail["checkpoint_step"] and detail["checkpoint_step"] % 5 == 0
    comparison = compare_runs(oracle.baseline(ARGS, 2), run)
    assert comparison.mismatched_steps == [] and comparison.missing_steps == [] and comparison.digests_equal
    # The steps since the checkpoint were re-run: lost, and said so.
    assert comparison.lost_steps == len(run.rerun_steps) == detail["lost_steps"]
    assert run.rerun_steps == list(range(detail["checkpoint_step"] + 1, detail["checkpoint_step"] + 1 + detail["lost_steps"]))


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path: Path) -> None:
    """Resuming a job dir whose checkpoint holds other tensor shapes: the job fails and names the mismatch."""
    job_dir = tmp_path / "job"
    run_args = ["--spares", "0", "--save-every", "5", "--max-restarts", "1"]
    assert run_job(job_dir, ["--epochs", "1"], ranks=2, extra_run_args=run_args) == 0
    latest = [c for c in scan(str(job_dir / "checkpoints")) if c.valid][-1]
    rc = run_job(job_dir, ["--epochs", "1", "--hidden", "32"], ranks=2, extra_run_args=run_args)
    assert rc == 1
    reason = job_table(job_dir / "events.db")["exit_reason"]
    assert f"{latest.name} does not fit this model" in reason, reason
    assert "model/0.weight has shape [64, 32] there, [32, 32] here" in reason, reason
    # Nothing was loaded or written over: the refused checkpoint is still the latest valid one.
    assert [c.name for c in scan(str(job_dir / "checkpoints")) if c.valid][-1] == latest.name
