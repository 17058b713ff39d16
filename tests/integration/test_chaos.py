"""`undying chaos` against a running job: every random fault is an incident, nothing is lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.jobs import manager_url, start_job, wait_running
from tests.oracle import Oracle
from undying.demo.oracle import compare_runs, load_run

ARGS = ["--epochs", "24", "--samples", "1024"]
# The run with faults is paced so it outlasts the chaos (three faults 2.25-6.75 s
# apart, each found and recovered) on a fast machine too; pacing does not change
# the losses, so the reference runs at full speed. 768 steps of at least 0.03 s:
# seed 8's third fault lands near step 250 on an idle 2-core machine and near
# step 380 on a loaded one (`undying chaos` itself starts slower there), which
# leaves the job 12-15 s after it. (It was 1,024 steps: 24 s trained on after the
# last fault; 512 left only 4 s under load.)
PACED = [*ARGS, "--step-seconds", "0.03"]


def test_chaos_faults_are_all_recovered_with_identical_losses(
    oracle: Oracle, tmp_path: Path, reap: list[int]
) -> None:
    baseline = oracle.baseline(ARGS, ranks=2)
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, PACED, ranks=2, reap=reap,
                         run_args=["--spares", "1", "--heartbeat-timeout", "2"])
    wait_running(manager_url(job_dir), min_step=50)
    chaos = subprocess.run(
        [sys.executable, "-m", "undying", "chaos", "--every", "4.5", "--count", "3", "--seed", "8",
         "--kinds", "crash,hang,comm-error", "--json", "--job-dir", str(job_dir)],
        capture_output=True, text=True, timeout=120,
    )
    assert chaos.returncode == 0, chaos.stderr
    faults = [json.loads(line) for line in chaos.stdout.splitlines()]
    assert len(faults) == 3, chaos.stdout + chaos.stderr
    # Seed 8 draws one of each kind; 2.25-6.75 s apart, each fault is found (hangs after the
    # 2 s heartbeat timeout) and recovered before the next, so none absorbs another.
    assert {f["kind"] for f in faults} <= {"crash", "hang", "comm-error"}
    assert launcher.wait(timeout=180) == 0, (tmp_path / "job.log").read_text()[-3000:]
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(baseline, run)
    assert comparison.identical, comparison.reasons
    assert len(run.incidents) == 3 and all(i["status"] == "recovered" for i in run.incidents), run.incidents
    assert sorted((i["kind"], i["rank"]) for i in run.incidents) == sorted((f["kind"], f["rank"]) for f in faults)
