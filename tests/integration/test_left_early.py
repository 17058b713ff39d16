"""A rank that leaves early (exit 0 before its last step while the others go on) is an incident, never success.

With the oracle (tests/oracle.py): rank 1's script exits 0 (``sys.exit(0)``,
``undying inject leave``) inside a step, or at a step's start as a script that
returns after step 4 does; either is a ``left-early`` incident, recovered like
a crash, with every loss the fault-free run's and no step completed twice. A
script whose rank 1 always stops early fails the job at the second time, with
the reason in one line.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.integration.jobs import job_table
from tests.oracle import Oracle
from undying.cli.demo import FaultPlan


def leave(rank: int, at_step: int, phase: str) -> FaultPlan:
    return FaultPlan(kind="leave", rank=rank, at_step=at_step, phase=phase, expect="left-early")


# sys.exit(0) inside a step's forward; and at a step's start (the script ends after the step before).
# Both in one job, one after the other: the first's recovery is over long before the second's step.
LEAVES = [leave(1, 5, "forward"), leave(2, 9, "step")]


def test_a_rank_that_leaves_early_is_recovered_with_identical_losses(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", LEAVES)
    assert [(i["kind"], i["rank"], i["step"], i["action"]) for i in outcome.incidents] == [
        ("left-early", f.rank, f.at_step, "replace") for f in LEAVES], outcome.incidents
    for fault, incident in zip(LEAVES, outcome.incidents, strict=True):
        assert f"exited 0 at step {fault.at_step} before finishing its steps" in incident["error"], incident
        assert incident["detail"]["injected"] is True
        exits = [e for e in outcome.events("exited") if e["rank"] == fault.rank]
        assert exits[0]["returncode"] == 0  # the leaver's own exit: clean, and still no success


# Rank 1 stops after step 4 of 32 (its loop ends, its script returns): every time, a replacement too.
STOPS_EARLY = textwrap.dedent("""
    import torch, torch.nn.functional as F
    import undying

    job = undying.init()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = job.ddp(model)
    for step in job.steps(job.state(model=model, optimizer=opt), total=32):
        with step:
            x = torch.randn(8, 4)
            loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True))
            opt.zero_grad(); loss.backward(); opt.step()
        if job.rank == 1 and step.index >= 4:
            break
""")


def test_a_rank_that_keeps_leaving_early_fails_the_job_with_the_reason(tmp_path: Path) -> None:
    script = tmp_path / "stops_early.py"
    script.write_text(STOPS_EARLY)
    job_dir = tmp_path / "job"
    run = subprocess.run([sys.executable, "-m", "undying", "run", "-n", "2", "--port", "0", "--spares", "0",
                          "--job-dir", str(job_dir), str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    reason = job_table(job_dir / "events.db")["exit_reason"]
    assert reason.startswith("rank 1 left the job early again at step 6"), reason
    assert "replaced for it at step 5" in reason and "make every rank run the same steps" in reason, reason
    assert "\n" not in reason
    assert "succeeded" not in run.stdout + run.stderr
