"""``--trackers tensorboard,wandb,mlflow``: each committed step's values reach each tracker once (#29).

Before: TensorBoard logged inside ``with step:`` recorded step 40 twice after a
fault, and W&B opened a second run when rank 0 was replaced. Here the real
libraries, offline (TensorBoard's event files, W&B's offline mode, MLflow's
file store), take a 2-rank job through a SIGKILL of rank 0, a SIGTERM of the
launcher, and a relaunch of the same job id that re-runs steps the first
launch committed: each tracker holds each step once, in one run, and the
values are the oracle's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from tests.integration.jobs import alive, events, manager_url, start_job, wait_for, wait_running
from tests.oracle import Oracle
from undying.checkpoint import scan
from undying.cli.client import api_post
from undying.cli.demo import load_preempted
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.tokens import find_token

# The losses do not depend on --step-seconds: the baseline is test_checkpoints.py's (cached).
BASELINE_ARGS = ["--epochs", "2", "--step-seconds", "0.05"]
SCRIPT_ARGS = ["--epochs", "2", "--step-seconds", "0.1"]
STEPS = 64  # 1024 samples, batch 16, 2 ranks, 2 epochs
JOB_ID = "tracked"


def _children(pid: int) -> dict[int, str]:
    """The launcher's child processes: pid -> command line."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError):
                found[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def _tensorboard_steps(folder: Path) -> tuple[Counter[tuple[str, int]], dict[int, float], int]:
    """Every (tag, step) in every event file, counted; the loss per step; how many files."""
    counts: Counter[tuple[str, int]] = Counter()
    losses: dict[int, float] = {}
    files = sorted(folder.glob("events.out.tfevents.*"))
    for path in files:
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                counts[(value.tag, event.step)] += 1
                if value.tag == "loss":
                    losses[event.step] = value.simple_value or value.tensor.float_val[0]
    return counts, losses, len(files)


def test_each_tracker_takes_each_committed_step_once_through_a_crash_of_rank_0_and_a_relaunch(
    tmp_path: Path, reap: list[int], oracle: Oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3's file store opts in)
    (tmp_path / "wandb-dir").mkdir()
    ckpts, job_dir = tmp_path / "ckpts", tmp_path / "job"
    args = ["--spares", "0", "--job-id", JOB_ID, "--checkpoint-dir", str(ckpts), "--save-every", "4",
            "--trackers", "tensorboard,wandb,mlflow"]
    first = start_job(job_dir, SCRIPT_ARGS, ranks=2, reap=reap, run_args=args)
    url = manager_url(job_dir)
    api_post(url, "/api/inject", {"kind": "crash", "rank": 0, "at_step": 8, "phase": "backward"},
             token=find_token(job_dir, None))
    wait_running(url, min_step=30, timeout=120)
    # W&B's service runs beside the launcher while its run is open; it ends with the job.
    wandb_service = wait_for(lambda: [p for p, cmd in _children(first.pid).items() if "wandb" in cmd], 60,
                             "W&B's service process")
    os.kill(first.pid, signal.SIGTERM)
    rc = first.wait(timeout=90)
    log = (tmp_path / "job.log").read_text(errors="replace")
    assert rc in (0, 75, 76), f"exit {rc}\n{log[-3000:]}"
    wait_for(lambda: not any(alive(p) for p in wandb_service), 30, "W&B's service to end")
    db = job_dir / "events.db"
    assert not events(db, "tracker_dropped"), events(db, "tracker_dropped")

    # The newest checkpoints gone: the relaunch resumes from an older one and re-runs steps the trackers took.
    found = [c for c in scan(ckpts) if c.valid]
    assert len(found) >= 3, [c.name for c in scan(ckpts)]
    for gone in found[-2:]:
        shutil.rmtree(gone.path)
    sent = json.loads((job_dir / "trackers.json").read_text())
    assert {name: entry["step"] for name, entry in sent.items()}.keys() == {"tensorboard", "wandb", "mlflow"}
    assert min(entry["step"] for entry in sent.values()) > found[-3].step, (sent, found[-3].step)
    relaunch = start_job(job_dir, ["--epochs", "2", "--step-seconds", "0.02"], ranks=2, reap=reap, run_args=args)
    assert relaunch.wait(timeout=180) == 0, (tmp_path / "job.log").read_text(errors="replace")[-3000:]
    (resumed,) = events(db, "resumed")
    assert resumed["rerun"]["steps"] > 0, resumed  # (steps the first launch committed, run again)
    assert not events(db, "tracker_dropped"), events(db, "tracker_dropped")

    # The oracle: the two launches together are the fault-free run, step for step.
    merged, _ = load_preempted(job_dir, 0.0)
    baseline = oracle.baseline(BASELINE_ARGS, 2)
    comparison = compare_runs(baseline, merged)
    assert comparison.mismatched_steps == [] and comparison.missing_steps == [], comparison.reasons
    assert [(i["kind"], i["rank"], i["status"]) for i in _first_launch_incidents(job_dir)
            if i["kind"] == "crash"] == [("crash", 0, "recovered")], "rank 0's crash, recovered"

    # TensorBoard: every tag and step exactly once across the launches' event files.
    counts, tb_losses, files = _tensorboard_steps(job_dir / "tensorboard")
    assert files >= 2, "each launch writes its own event file"
    assert [key for key, n in counts.items() if n != 1] == []
    assert sorted(tb_losses) == list(range(1, STEPS + 1))
    assert all(abs(tb_losses[s] - baseline.losses[s]) <= 1e-6 * max(1.0, abs(baseline.losses[s]))
               for s in tb_losses)  # (TensorBoard keeps float32)

    # MLflow: one run for the job, each step once, the oracle's values exactly.
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("undying")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.data.tags.get("undying.job_id") for r in runs] == [JOB_ID]
    assert runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert {m.step: m.value for m in history} == {s: baseline.losses[s] for s in range(1, STEPS + 1)}

    # W&B offline: one run id, the job's, resumed by the relaunch (a folder per launch, never a second id).
    runs_dir = tmp_path / "wandb-dir" / "wandb"
    offline = sorted(p.name for p in runs_dir.glob("offline-run-*"))
    assert len(offline) == 2 and {name.rpartition("-")[2] for name in offline} == {JOB_ID}, offline
    assert all((runs_dir / name / f"run-{JOB_ID}.wandb").stat().st_size > 0 for name in offline)
    sent = json.loads((job_dir / "trackers.json").read_text())
    assert {name: entry["step"] for name, entry in sent.items()} == dict.fromkeys(("mlflow", "tensorboard", "wandb"), STEPS)
    assert sent["wandb"]["run_id"] == JOB_ID and sent["mlflow"]["run_id"] == runs[0].info.run_id


def _first_launch_incidents(job_dir: Path) -> list[dict[str, Any]]:
    """The first launch's incidents (its log, set aside by the relaunch)."""
    older = sorted(job_dir.glob("events.*.db"), key=lambda p: p.stat().st_mtime)
    return load_run(older[-1]).incidents if older else []
