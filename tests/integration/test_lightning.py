"""Lightning's own BoringModel under ``undying run``, through a SIGKILL, with UndyingStrategy.

One job of 2 ranks (CPU, gloo), 2 epochs of 8 steps: rank 0 is killed in the backward of step
11, in the second epoch. The survivor keeps its process and state and re-runs the step; the
replacement starts the script again, passes the first ten batches untrained (Lightning's loop,
its epoch end and its LR scheduler's step included), loads the state rank 1 sent, and trains
step 11 with it. The losses are the fault-free run's (the oracle's reference of the same
script), bit for bit, and no step ran twice to completion.

The same job checks the two things a library that owns logging needs (the script sets up its
root logger as hydra does): no line of undying's reaches the root logger's handler in a rank,
while the job's log still has them; and each rank's process title names the job and the rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.oracle import Oracle, crash
from undying.cli.demo import run_job
from undying.demo.oracle import compare_runs, load_run

pytest.importorskip("lightning")

SCRIPT = Path(__file__).resolve().parent / "loops" / "boring_lightning.py"


def test_a_lightning_module_recovers_a_killed_rank_in_place(tmp_path: Path, oracle: Oracle) -> None:
    out = tmp_path / "out"
    baseline = oracle.baseline(["--out", str(tmp_path / "base-out")], 2, script=SCRIPT)
    job_dir = tmp_path / "job"
    rc = run_job(job_dir, ["--out", str(out)], ranks=2, script=SCRIPT, timeout_s=170,
                 faults=[crash(0, 11, "backward")], extra_run_args=["--spares", "0"], verbose=True)
    log = (tmp_path / "job.log").read_text(errors="replace")
    assert rc == 0, log[-3000:]
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(baseline, run)
    assert comparison.identical, f"{comparison.reasons}\n{log[-3000:]}"
    assert comparison.lost_steps == 0
    assert sorted(run.losses) == list(range(1, 17))
    assert [(i["kind"], i["rank"], i["status"]) for i in run.incidents] == [("crash", 0, "recovered")]
    assert "recovered from crash of rank 0" in log and "restored step 10" in log, log[-2000:]

    # Three processes: the two ranks and rank 0's replacement, each with its title and root log.
    titles = {p.name: p.read_bytes().split(b"\0")[0].decode() for p in out.glob("title-*")}
    assert len(titles) == 3, titles
    for name, title in titles.items():
        rank = name.split("-")[1]
        assert title == f"undying: job {job_dir.name} rank {rank}: {SCRIPT.name}", title
    roots = {p.name: p.read_text() for p in out.glob("root-*.log")}
    assert len(roots) == 3 and any("lightning" in text for text in roots.values()), roots
    assert not [line for text in roots.values() for line in text.splitlines()
                if line.startswith("undying")], roots
    # ... while undying's own lines of the ranks are in the job's log (-v: their INFO lines).
    assert "rank 0: tracing off" in log and "rank 1: tracing off" in log, log[-2000:]
