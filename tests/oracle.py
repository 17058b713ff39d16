"""The oracle for "no work lost": run the same seeded job with and without a fault.

``Oracle.assert_survives`` runs the demo job with the given faults and asserts
that every per-step loss is bit-identical to the fault-free run of the same
arguments, that the final model and optimizer state are identical, that no step
completed twice, and that each injected fault was recorded and recovered.
Every fault the project claims to survive has a test built on this.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from undying.cli.demo import FaultPlan, run_job
from undying.demo import TRAIN_SCRIPT
from undying.demo.oracle import Comparison, RunRecord, compare_runs, load_run
from undying.jobfiles.events import connect_readonly, read_job

__all__ = ["Oracle", "Outcome", "crash", "hang", "comm_error", "slow"]


def crash(rank: int, at_step: int, phase: str = "step") -> FaultPlan:
    return FaultPlan(kind="crash", rank=rank, at_step=at_step, phase=phase)


def hang(rank: int, at_step: int, phase: str = "step", how: str | None = None) -> FaultPlan:
    return FaultPlan(kind="hang", rank=rank, at_step=at_step, phase=phase, how=how)


def comm_error(rank: int, at_step: int, phase: str = "step") -> FaultPlan:
    return FaultPlan(kind="comm-error", rank=rank, at_step=at_step, phase=phase)


def slow(rank: int, at_step: int, phase: str = "compute", factor: float = 1.5) -> FaultPlan:
    """A slowdown is found (a slow_rank incident), not recovered: the job trains on."""
    return FaultPlan(kind="slow", rank=rank, at_step=at_step, phase=phase, factor=factor, expect="slow_rank")


@dataclass(frozen=True)
class Outcome:
    comparison: Comparison
    run: RunRecord
    job_dir: Path
    returncode: int

    @property
    def incidents(self) -> list[dict[str, Any]]:
        return self.run.incidents

    def events(self, kind: str) -> list[dict[str, Any]]:
        db = connect_readonly(self.job_dir / "events.db")
        try:
            return [
                {"rank": rank, "generation": generation, **json.loads(data)}
                for rank, generation, data in db.execute(
                    "SELECT rank, generation, data FROM events WHERE kind = ? ORDER BY id", (kind,)
                )
            ]
        finally:
            db.close()

    def log(self) -> str:
        path = self.job_dir.parent / f"{self.job_dir.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


class Oracle:
    """Fault-free references, each computed once per test session and configuration.

    ``root`` may be shared by several pytest processes (pytest-xdist workers):
    each reference lives in a folder named by its configuration, made under a
    file lock and marked complete last, so the first worker to need it runs it
    and the others wait for it and read it.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._root.mkdir(parents=True, exist_ok=True)
        self._baselines: dict[tuple[Any, ...], RunRecord] = {}

    def shared(self, name: str, key: tuple[Any, ...], make: Any) -> Path:
        """The folder of the reference ``key``: made by ``make(folder)`` once, by whichever process comes first."""
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        folder = self._root / f"{name}-{digest}"
        done = folder / "complete"
        with FileLock(str(folder) + ".lock", timeout=600):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # a process that died half-way left it
                folder.mkdir(parents=True)
                make(folder)
                done.write_text(repr(key))
        return folder

    def baseline(self, script_args: Sequence[str], ranks: int, *, script: Path | None = None,
                 run_args: Sequence[str] = ()) -> RunRecord:
        """The fault-free record of the demo job (or ``script``, run with ``run_args``) on ``ranks`` ranks.

        ``--step-seconds`` only makes a step last longer (the losses are the same):
        the reference runs at full speed, and a paced job and an unpaced one of
        the same arguments share it.
        """
        script_args = _without_option(_without_option(script_args, "--step-seconds"), "--env-out")  # (nor env dumps)
        key = (ranks, tuple(script_args), *((str(script), tuple(run_args)) if script or run_args else ()))
        if key not in self._baselines:
            def make(folder: Path) -> None:
                job_dir = folder / "job"
                rc = run_job(job_dir, list(script_args), ranks=ranks, timeout_s=180,
                             extra_run_args=["--spares", "0", *run_args], script=script or TRAIN_SCRIPT)
                assert rc == 0, f"the fault-free run failed ({rc}); log: {job_dir}.log"
            folder = self.shared("baseline", key, make)
            self._baselines[key] = load_run(folder / "job" / "events.db")
        return self._baselines[key]

    def regrouped(self, script_args: Sequence[str], *, ranks: int, then: int, at_step: int) -> RunRecord:
        """The fault-free record of a job that moves from ``ranks`` to ``then`` ranks after step ``at_step``.

        A job of ``ranks`` saves step ``at_step`` (``--save-every``), and a job of
        ``then`` ranks resumes from that checkpoint: the steps up to ``at_step``
        are the first's, the rest the second's. A regroup (a node lost or joining)
        must match it bit for bit: the state the survivors saved is the state of
        that step, and the data goes on where it stood.
        """
        # --step-seconds only makes a step last longer (the losses are the same): the references run at full speed.
        script_args = _without_option(script_args, "--step-seconds")

        def make(folder: Path) -> None:
            first = folder / "from" / f"regroup-{at_step}"
            first.parent.mkdir(parents=True)
            rc = run_job(first, list(script_args), ranks=ranks, timeout_s=180,
                         extra_run_args=["--spares", "0", "--save-every", str(at_step), "--keep", "1000"])
            assert rc == 0, f"the fault-free run of {ranks} ranks failed ({rc}); log: {first}.log"
            saved = first / "checkpoints" / f"step-{at_step:09d}"
            assert saved.is_dir(), f"no checkpoint of step {at_step} in {first / 'checkpoints'}"
            # Same job id (the folder's name), another folder: the resume takes the checkpoint as this job's.
            second = folder / "to" / first.name
            checkpoints = second.parent / "checkpoints"
            shutil.copytree(saved, checkpoints / saved.name)
            rc = run_job(second, list(script_args), ranks=then, timeout_s=180,
                         extra_run_args=["--spares", "0", "--checkpoint-dir", str(checkpoints)])
            assert rc == 0, f"the resume on {then} ranks failed ({rc}); log: {second}.log"

        folder = self.shared("regroup", (ranks, then, at_step, tuple(script_args)), make)
        first, second = folder / "from" / f"regroup-{at_step}", folder / "to" / f"regroup-{at_step}"
        before, after = load_run(first / "events.db"), load_run(second / "events.db")
        assert min(after.losses) == at_step + 1, f"the resume started at step {min(after.losses)}, not {at_step + 1}"
        return dataclasses.replace(
            after, losses={**{s: v for s, v in before.losses.items() if s <= at_step}, **after.losses},
            inconsistent_steps=sorted(set(before.inconsistent_steps) | set(after.inconsistent_steps)))

    def run(self, job_dir: Path, script_args: Sequence[str], ranks: int,
            faults: Sequence[FaultPlan] = (), extra_run_args: Sequence[str] = ("--spares", "0"),
            when_warm: bool = False) -> Outcome:
        rc = run_job(job_dir, list(script_args), ranks=ranks, faults=faults, timeout_s=180,
                     extra_run_args=list(extra_run_args), when_warm=when_warm)
        run = load_run(job_dir / "events.db")
        return Outcome(compare_runs(self.baseline(script_args, ranks), run), run, job_dir, rc)

    def assert_survives(self, job_dir: Path, faults: Sequence[FaultPlan], *,
                        script_args: Sequence[str] = ("--epochs", "2"), ranks: int = 4,
                        extra_run_args: Sequence[str] = ("--spares", "0"),
                        when_warm: bool = False) -> Outcome:
        """Run with ``faults`` (cold replacements unless ``extra_run_args`` asks for spares)."""
        outcome = self.run(job_dir, script_args, ranks, faults, extra_run_args, when_warm)
        return self._survived(outcome, faults)

    def shared_survival(self, faults: Sequence[FaultPlan], *, script_args: Sequence[str], ranks: int,
                        extra_run_args: Sequence[str]) -> Outcome:
        """``assert_survives`` of a job several tests only read: run once per session, not per worker.

        A module-scoped fixture runs once per pytest-xdist worker that runs one of the module's
        tests: up to four times the same job. This one is made like a reference (under a file
        lock, by the first worker to need it), and every caller checks the same survival.
        The job's folder is shared: read it, never write to it.
        """
        key = (tuple(faults), ranks, tuple(script_args), tuple(extra_run_args))
        folder = self.shared("survival", key, lambda folder: self.assert_survives(
            folder / "job", faults, script_args=script_args, ranks=ranks, extra_run_args=extra_run_args))
        job_dir = folder / "job"
        run = load_run(job_dir / "events.db")
        # (the job exited 0: the folder is complete only once assert_survives has passed)
        return self._survived(Outcome(compare_runs(self.baseline(script_args, ranks), run), run, job_dir, 0),
                              faults)

    @staticmethod
    def _survived(outcome: Outcome, faults: Sequence[FaultPlan]) -> Outcome:
        log_tail = outcome.log()[-3000:]
        assert outcome.returncode == 0, f"the run with faults exited {outcome.returncode}\n{log_tail}"
        assert outcome.comparison.identical, f"{outcome.comparison.reasons}\n{log_tail}"
        assert outcome.comparison.lost_steps == 0
        for fault in faults:
            assert any(i["kind"] == fault.incident_kind and i["rank"] == fault.rank for i in outcome.incidents), (
                f"no {fault.incident_kind} incident of rank {fault.rank}: {outcome.incidents}"
            )
        for incident in outcome.incidents:
            # A slow rank or node is observed and reported; every fault is recovered.
            expected = "observed" if incident["kind"] in ("slow_rank", "slow_node") else "recovered"
            assert incident["status"] == expected, incident
        injected = {(e["rank"], e["step"], e["phase"]) for e in outcome.events("fault_injected")}
        for fault in faults:
            assert any(r == fault.rank and p == fault.phase and s >= fault.at_step for r, s, p in injected), (
                f"fault {fault} did not fire: {injected}"
            )
        return outcome


def _without_option(args: Sequence[str], name: str) -> list[str]:
    """``args`` without ``name VALUE``."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        else:
            out.append(arg)
    return out


def job_summary(job_dir: Path) -> dict[str, Any]:
    return read_job(job_dir / "events.db")
