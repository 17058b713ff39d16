"""The project's oracle for "no work lost": compare a run with a fault to one without.

Reads two jobs' event logs and checks that every step's logged loss is the
same, bit for bit, and that no rank completed a step twice. Used by
``undying demo``, the benchmarks and the test suite.

It judges whole jobs from the outside, so it sits on top with the demo and
reads the logs only through the event log's own reader (``LogReader``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undying.jobfiles.events import LogReader

__all__ = ["RunRecord", "Comparison", "load_run", "compare_runs", "merge_runs", "final_losses",
           "rolled_back_steps"]


@dataclass(frozen=True)
class RunRecord:
    state: str
    losses: dict[int, float]  # step -> the job's logged loss
    inconsistent_steps: list[int]  # steps where ranks logged different values
    rerun_steps: list[int]  # steps some rank completed more than once
    digests: dict[int, str]  # rank -> fingerprint of its final state
    incidents: list[dict[str, Any]]
    commits: int


@dataclass(frozen=True)
class Comparison:
    identical: bool
    steps: int
    lost_steps: int
    mismatched_steps: list[int] = field(default_factory=list)
    missing_steps: list[int] = field(default_factory=list)
    digests_equal: bool = True
    reasons: list[str] = field(default_factory=list)


def load_run(events_db: Path, metric: str = "loss") -> RunRecord:
    with LogReader(events_db) as reader:
        job, commits, incidents, done = (reader.job(), reader.commits(), reader.incidents(),
                                         reader.events("done"))
    values: dict[int, set[float]] = defaultdict(set)
    completed: dict[tuple[int, int], int] = defaultdict(int)
    for commit in commits:
        completed[(commit.rank, commit.step)] += 1
        if metric in commit.metrics:
            values[commit.step].add(commit.metrics[metric])
    losses, inconsistent = _agreed(values)
    digests = {event.rank: event.data["digest"] for event in done if event.rank is not None}
    return RunRecord(
        state=str(job.get("state")),
        losses=losses,
        inconsistent_steps=inconsistent,
        rerun_steps=sorted({step for (_, step), n in completed.items() if n > 1}),
        digests=digests,
        incidents=incidents,
        commits=len(commits),
    )


def compare_runs(baseline: RunRecord, faulty: RunRecord) -> Comparison:
    reasons: list[str] = []
    steps = sorted(baseline.losses)
    missing = [s for s in steps if s not in faulty.losses]
    mismatched = [s for s in steps if s in faulty.losses and faulty.losses[s] != baseline.losses[s]]
    extra = sorted(set(faulty.losses) - set(baseline.losses))
    if baseline.state != "succeeded":
        reasons.append(f"the fault-free run ended {baseline.state}")
    if faulty.state != "succeeded":
        reasons.append(f"the run with the fault ended {faulty.state}")
    if not steps:
        reasons.append("the fault-free run logged no loss")
    if missing:
        reasons.append(f"steps missing from the run with the fault: {missing[:10]}")
    if extra:
        reasons.append(f"steps only in the run with the fault: {extra[:10]}")
    if mismatched:
        reasons.append(f"losses differ at steps {mismatched[:10]}")
    for run, name in ((baseline, "fault-free"), (faulty, "faulty")):
        if run.inconsistent_steps:
            reasons.append(f"ranks of the {name} run logged different losses at steps "
                           f"{run.inconsistent_steps[:10]}")
    digests_equal = bool(baseline.digests) and baseline.digests == faulty.digests
    if not digests_equal:
        reasons.append(f"the final model/optimizer state differs between the runs"
                       f"{_digests_apart(baseline.digests, faulty.digests)}")
    if faulty.rerun_steps:
        reasons.append(f"completed steps were re-run: {faulty.rerun_steps[:10]}")
    return Comparison(
        identical=not reasons,
        steps=len(steps),
        lost_steps=len(faulty.rerun_steps),
        mismatched_steps=mismatched,
        missing_steps=missing,
        digests_equal=digests_equal,
        reasons=reasons,
    )


def _digests_apart(baseline: dict[int, str], faulty: dict[int, str]) -> str:
    """Which ranks' final states differ, and which no run reported (a rank's ``done``)."""
    differ = sorted(r for r in set(baseline) & set(faulty) if baseline[r] != faulty[r])
    parts = [f"ranks {differ} ended in different states"] if differ else []
    for run, name in ((baseline, "fault-free"), (faulty, "faulty")):
        if unreported := sorted((set(baseline) | set(faulty)) - set(run)):
            parts.append(f"the {name} run reported no final state for ranks {unreported}")
    return f" ({'; '.join(parts)})" if parts else ""


def merge_runs(first: RunRecord, second: RunRecord) -> RunRecord:
    """One record of a job run in two launches (preempted, then resumed with the same command).

    A step logged by both launches was completed twice: its work was lost and
    re-run, and it counts in ``rerun_steps``. The final state is the second's.
    """
    losses = dict(first.losses)
    inconsistent = set(first.inconsistent_steps) | set(second.inconsistent_steps)
    for step, loss in second.losses.items():
        if step in losses and losses[step] != loss:
            inconsistent.add(step)
        losses[step] = loss
    for step in inconsistent:
        losses.pop(step, None)
    return RunRecord(
        state=second.state,
        losses=losses,
        inconsistent_steps=sorted(inconsistent),
        rerun_steps=sorted(set(first.rerun_steps) | set(second.rerun_steps)
                           | (set(first.losses) & set(second.losses))),
        digests=second.digests,
        incidents=[*first.incidents, *second.incidents],
        commits=first.commits + second.commits,
    )


def final_losses(events_dbs: list[Path],
                 metric: str = "loss") -> tuple[dict[int, float], list[int]]:
    """Each step's loss as every rank's last commit of it logged it, across the launches'
    logs (oldest first), and the steps where those last commits disagree.

    After a ``--verify-every`` roll-back a step's first run trained on the corrupt
    state and logged other numbers; its re-run is the one that counts. The
    strict oracle (``load_run``) sees both runs; this sees the one that stands.
    """
    last: dict[tuple[int, int], float] = {}
    for path in events_dbs:
        with LogReader(path) as reader:
            for commit in reader.iter_commits():  # time order: a re-run after what it replaces
                if metric in commit.metrics:
                    last[(commit.rank, commit.step)] = commit.metrics[metric]
    by_step: dict[int, set[float]] = defaultdict(set)
    for (_, step), value in last.items():
        by_step[step].add(value)
    return _agreed(by_step)


def _agreed(values: dict[int, set[float]]) -> tuple[dict[int, float], list[int]]:
    """Each step's value where every rank logged the same one, and the steps where they differ."""
    return ({step: next(iter(v)) for step, v in values.items() if len(v) == 1},
            sorted(step for step, v in values.items() if len(v) > 1))


def rolled_back_steps(incidents: list[dict[str, Any]]) -> set[int]:
    """The steps that ``sdc`` incidents' roll-backs re-ran (the verified step after the one rolled
    back to, and as many as the incident counts)."""
    steps: set[int] = set()
    for incident in incidents:
        detail = incident.get("detail") or {}
        if incident.get("kind") != "sdc" or incident.get("action") != "rolled_back":
            continue
        start, count = detail.get("rolled_back_to"), detail.get("rerun_steps")
        if isinstance(start, int) and isinstance(count, int):
            steps.update(range(start + 1, start + 1 + count))
    return steps
