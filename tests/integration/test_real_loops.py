"""The loops people write, under real faults: identical recovery where it holds, a `diverged` incident where not.

Each job is ``loops/loop.py`` on 2 ranks (CPU, gloo), a dozen steps. Two
habits break identical recovery: a dataset from an unseeded generator, and a
batch fetched at the end of the previous step (prefetch). After a SIGKILL of
one rank, each ends with a ``diverged`` incident naming the rank, the step
and the fingerprint, never with the crash merely "recovered"; so does a
layer whose ``load_state_dict`` restores nothing (the replacement's state is
not its donor's). Their fixed
versions (the dataset built after ``undying.init()``, which seeds it; the
batch drawn inside the step) recover with every loss identical, bit for bit,
to the run without the fault: the fixed draw loop with gradient accumulation
(``no_sync``), autocast with a GradScaler and a step it skips, LR from the
step, clipping, an EMA copy, evaluation outside the steps, logging on rank 0
and plain variables in job.state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.oracle import crash
from undying.cli.demo import FaultPlan, run_job
from undying.demo.oracle import RunRecord, compare_runs, load_run
from undying.jobfiles.events import LogReader

LOOP = Path(__file__).resolve().parent / "loops" / "loop.py"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "tokens.bin"
    np.random.default_rng(0).integers(0, 64, 20_000).astype(np.uint16).tofile(path)
    return path


def _run(job_dir: Path, args: Sequence[str], faults: Sequence[FaultPlan] = (),
         extra: Sequence[str] = (), timeout_s: float = 170) -> tuple[RunRecord, str]:
    rc = run_job(job_dir, list(args), ranks=2, script=LOOP, faults=faults, timeout_s=timeout_s,
                 extra_run_args=["--spares", "0", *extra])
    log = (job_dir.parent / f"{job_dir.name}.log").read_text(errors="replace")
    assert rc == 0, f"the job exited {rc}\n{log[-3000:]}"
    return load_run(job_dir / "events.db"), log


def _kinds(run: RunRecord) -> list[tuple[str, int, str]]:
    return [(i["kind"], i["rank"], i["status"]) for i in run.incidents]


def _diverged(run: RunRecord) -> dict[str, Any]:
    found = [i for i in run.incidents if i["kind"] == "diverged"]
    assert found, f"no diverged incident: {_kinds(run)}"
    return found[0]


def test_an_unseeded_dataset_ends_in_a_diverged_incident(tmp_path: Path) -> None:
    run, log = _run(tmp_path / "job", ["--batches", "loader", "--data", "unseeded"], [crash(1, 5, "backward")])
    incident = _diverged(run)
    # The run's last word is a warning, not a plain "succeeded": its losses are not the fault-free run's.
    assert "warning: the run diverged after a fault" in log.strip().splitlines()[-1], log[-2000:]
    assert (incident["rank"], incident["detail"]["fingerprint"]) == (1, "batch")
    assert incident["step"] >= 5 and "another batch" in incident["error"]
    assert ("crash", 1, "recovered") in _kinds(run)
    with LogReader(tmp_path / "job" / "events.db") as reader:
        assert "warning: the run diverged after a fault (rank 1 at step" in reader.job()["exit_reason"]


def test_a_prefetching_loop_ends_in_a_diverged_incident(tmp_path: Path, tokens: Path) -> None:
    run, _ = _run(tmp_path / "job", ["--tokens", str(tokens), "--fetch", "prefetch"], [crash(0, 5, "backward")])
    incident = _diverged(run)
    assert (incident["rank"], incident["step"], incident["detail"]["fingerprint"]) == (0, 5, "batch")


def test_a_state_that_does_not_load_back_ends_in_a_diverged_incident(tmp_path: Path, tokens: Path) -> None:
    run, _ = _run(tmp_path / "job", ["--tokens", str(tokens), "--lossy-load"], [crash(1, 5, "backward")])
    incident = _diverged(run)
    assert (incident["rank"], incident["detail"]["fingerprint"]) == (1, "state")
    assert "loaded from a peer, is not the state it was sent" in incident["error"]


@pytest.mark.parametrize("args", [
    pytest.param(["--batches", "loader"], id="seeded-dataset"),
    pytest.param(["--accum", "2", "--amp", "--inf-at", "3", "--eval-every", "4"], id="draw-accum-amp-eval"),
])
def test_the_fixed_loops_recover_identically(tmp_path: Path, tokens: Path, args: list[str]) -> None:
    args = ["--tokens", str(tokens), *args]
    baseline, _ = _run(tmp_path / "base", args)
    # Rank 0 dies: its replacement logs what it restored (the scaler's scale, the EMA's best validation
    # loss, the plain variables' token count), each compared with the run without the fault.
    faulty, log = _run(tmp_path / "job", args, [crash(0, 6, "backward")])
    comparison = compare_runs(baseline, faulty)
    assert comparison.identical, f"{comparison.reasons}\n{log[-2000:]}"
    assert _kinds(faulty) == [("crash", 0, "recovered")]
    commits = {c["step"]: c["metrics"] for c in _commits(tmp_path / "job") if c["rank"] == 0}
    assert commits == {c["step"]: c["metrics"] for c in _commits(tmp_path / "base") if c["rank"] == 0}
    if "--amp" in args:
        assert commits[3]["loss"] == float("inf") and commits[4]["scale"] == commits[2]["scale"] / 2, \
            "the step the scaler skipped is counted, and the scaler's state carried"
        assert len(commits) == 12 and commits[12]["best_val"] < 1e9  # evaluation ran, outside the 12 steps


def _commits(job_dir: Path) -> list[dict[str, Any]]:
    with LogReader(job_dir / "events.db") as reader:
        return [c.to_dict() for c in reader.commits()]


@pytest.mark.skipif(os.environ.get("UNDYING_SLOW_TESTS") != "1",
                    reason="torch.compile takes about a minute per process on a 2-core machine (the job, its "
                    "replacement and the fault-free reference each compile): run with UNDYING_SLOW_TESTS=1")
@pytest.mark.timeout(1200)
def test_a_compiled_model_recovers_identically(tmp_path: Path, tokens: Path) -> None:
    args = ["--tokens", str(tokens), "--compile", "--steps", "6"]
    extra = ["--init-timeout", "400"]
    baseline, _ = _run(tmp_path / "base", args, extra=extra, timeout_s=500)
    faulty, log = _run(tmp_path / "job", args, [crash(1, 4, "backward")], extra=extra, timeout_s=500)
    comparison = compare_runs(baseline, faulty)
    assert comparison.identical, f"{comparison.reasons}\n{log[-2000:]}"
    assert _kinds(faulty) == [("crash", 1, "recovered")]
