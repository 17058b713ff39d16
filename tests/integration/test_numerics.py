"""Numeric faults in a real 4-rank DDP job: found before the step commits, replayed in place, attributed.

Each test runs the seeded demo job with numeric checks on (``--numerics``) and
real drills (``/api/inject`` nan and bitflip, armed in the rank's own process),
and compares it with a fault-free run (tests/oracle.py).
"""

from __future__ import annotations

from pathlib import Path

from tests.oracle import Oracle
from undying.cli.demo import FaultPlan
from undying.demo.oracle import compare_runs
from undying.jobfiles.events import LogReader

CHECKED = ("--epochs", "2", "--numerics", "skip")


def test_transient_nan_is_replayed_and_names_its_rank(oracle: Oracle, tmp_path: Path) -> None:
    nan = FaultPlan("nan", rank=2, at_step=5, phase="backward", how="once", expect="numeric")
    outcome = oracle.assert_survives(tmp_path / "job", [nan], script_args=CHECKED)
    (incident,) = outcome.incidents
    assert incident["step"] == 5 and incident["rank"] == 2 and incident["action"] == "replayed"
    detail = incident["detail"]
    assert detail["verdict"] == "transient" and detail["suspects"] == [2], detail
    assert detail["first"]["grad_norm"] == "nan" and detail["replay"]["grad_norm"] == detail["replay"]["grad_norm"]
    assert 0 < incident["mttr_s"] < 10, incident  # from the failed check to the replay's commit
    # The checks and the fingerprint hook change no bit: the same as the job without them.
    unchecked = compare_runs(oracle.baseline(("--epochs", "2"), 4), outcome.run)
    assert unchecked.identical, unchecked.reasons


def test_a_gradient_bit_flip_that_overflows_is_caught_at_its_step(oracle: Oracle, tmp_path: Path) -> None:
    flip = FaultPlan("bitflip", rank=1, at_step=9, phase="backward", how="grad", expect="numeric")
    outcome = oracle.assert_survives(tmp_path / "job", [flip], script_args=CHECKED)
    (incident,) = outcome.incidents
    assert (incident["step"], incident["rank"], incident["detail"]["verdict"]) == (9, 1, "transient"), incident


def test_a_bad_batch_is_skipped_and_the_rest_is_a_run_that_skips_it(oracle: Oracle, tmp_path: Path) -> None:
    bad = 300  # a sample whose features are NaN: its batch fails every time it runs
    args = (*CHECKED, "--bad-sample", str(bad))
    outcome = oracle.run(tmp_path / "job", args, 4)
    assert outcome.returncode == 0, outcome.log()[-3000:]
    incidents = outcome.incidents
    assert len(incidents) == 2, incidents  # once in each epoch
    for incident in incidents:
        detail = incident["detail"]
        assert incident["kind"] == "numeric" and incident["action"] == "skip" and detail["verdict"] == "persistent"
        holder = [int(r) for r, indices in detail["batches"].items() if bad in indices]
        assert [incident["rank"]] == holder, detail  # named: the rank whose batch holds the sample
    skipped = ",".join(str(i["step"]) for i in incidents)
    twin = oracle.baseline(("--epochs", "2", "--skip-steps", skipped), 4)
    comparison = compare_runs(twin, outcome.run)
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons
    assert sorted(set(oracle.baseline(("--epochs", "2"), 4).losses) - set(outcome.run.losses)) == \
        sorted(i["step"] for i in incidents)


def test_a_persistent_nan_with_stop_ends_the_job_with_a_report(oracle: Oracle, tmp_path: Path) -> None:
    nan = FaultPlan("nan", rank=3, at_step=4, phase="backward", how="persistent")
    outcome = oracle.run(tmp_path / "job", ("--epochs", "1", "--numerics", "stop"), 4, [nan])
    assert outcome.returncode != 0
    assert outcome.run.state == "failed"
    (numeric,) = [i for i in outcome.incidents if i["kind"] == "numeric"]
    assert numeric["step"] == 4 and numeric["action"] == "stop" and numeric["rank"] == 3, numeric
    # The report is the job's failure reason (the ranks' own copies of it may arrive after the job stopped them).
    with LogReader(outcome.job_dir / "events.db") as reader:
        reason = str(reader.job()["exit_reason"])
    assert "step 4" in reason and "bit for bit" in reason and "batches rank 0:" in reason and "values first" in reason, \
        reason
    errors = [e["error"] for e in outcome.events("user_error")]
    assert all("step 4" in e and "bit for bit" in e and "batches rank 0:" in e for e in errors), errors
    assert not [e for e in outcome.events("spawned") if e["joining"]], "a stopped job replaces no rank"
    assert "numeric fault, stopped by policy" in outcome.log(), outcome.log()[-2000:]
