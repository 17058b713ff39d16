"""Offline diagnosis: read a job's trace files, find slow ranks and nodes, rank the ranks.

``load_trace`` reads every rank folder of a job (``<trace dir>/<job>/<rank>/``),
rebuilds each (rank, step)'s phases with the worker's own code
(``StepAccumulator``: the latest generation of a step wins, as a step re-run
after a recovery replaces the first attempt), makes the same window summaries
the workers send the manager (``window_summary``) and runs the same detector
(``SlowDetector``) over them, so the offline findings are the ones the
manager raised online, or would have. It adds what only the files can give:
a table of the ranks ranked by how far each is from the others, and the steps
whose data-loader wait or checkpoint stall stood far above that rank's usual.

Trace files are read as they are: a file still being written ends in a
partial line, a disk that filled may have cut one short; such lines are
counted, not fatal. Files not named like trace files (a user's notes, a
report written into the folder) are skipped and listed. What is found in the
per-step rows once they are read is ``step_rows`` (``find_slow``, ``rank_rows``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undying.errors import UsageError
from undying.trace.detect import Finding
from undying.trace.files import is_trace_file
from undying.trace.step_rows import RankRow, StepRow, find_slow, rank_rows
from undying.trace.summary import StepAccumulator

__all__ = ["TraceDirError", "TraceTable", "load_trace", "find_job_dir"]


class TraceDirError(UsageError):
    """The path given does not hold a job's trace files."""


@dataclass
class TraceTable:
    """What ``load_trace`` found: per-step rows, per-rank rows (ranked), findings and reading
    stats."""

    path: Path  # the job folder read
    job: str
    other_jobs: list[str]  # further job folders under the path given, not read
    steps: dict[int, list[StepRow]]  # rank -> its steps in order
    ranks: list[RankRow]  # highest score first
    findings: list[Finding]
    summaries: list[dict[str, Any]]  # the window summaries the detector was given
    files: int = 0
    records: int = 0
    bad_lines: int = 0
    rerun_steps: int = 0  # (rank, step)s whose first run a later generation's replaced
    skipped: list[str] = field(default_factory=list)  # files that are not trace files
    window: int = 10
    threshold: float = 0.08
    patience: int = 2

    @property
    def comm_known(self) -> bool:
        return any(r.comm is not None for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, without the per-step rows (``diagnose --json``)."""
        return {
            "path": str(self.path),
            "job": self.job,
            "other_jobs": self.other_jobs,
            "findings": [f.to_dict() | {"text": f.describe()} for f in self.findings],
            "ranks": [r.to_dict() for r in self.ranks],
            "files": self.files,
            "records": self.records,
            "bad_lines": self.bad_lines,
            "rerun_steps": self.rerun_steps,
            "skipped_files": self.skipped,
            "window": self.window,
            "threshold": self.threshold,
            "patience": self.patience,
        }


def _rank_dirs(job_dir: Path) -> dict[int, Path]:
    """The rank folders of a job folder (named by a rank number, holding at least one trace
    file)."""
    out: dict[int, Path] = {}
    try:
        children = sorted(job_dir.iterdir())
    except OSError:
        return out
    for child in children:
        if (child.is_dir() and child.name.isdigit()
                and any(is_trace_file(p.name) for p in child.iterdir())):
            out[int(child.name)] = child
    return out


def _newest(job_dir: Path) -> float:
    return max((p.stat().st_mtime for d in _rank_dirs(job_dir).values() for p in d.iterdir()),
               default=0.0)


def find_job_dir(path: Path) -> tuple[Path, dict[int, Path], list[str]]:
    """The job folder ``path`` points at, its rank folders, and other jobs' names beside it.

    ``path`` may be a rank folder (its job is read whole), a job folder, or a
    trace dir holding job folders (the one written most recently is read).
    """
    path = Path(path)
    if not path.exists():
        raise TraceDirError(f"{path} does not exist: pass the trace dir (the job's --trace-dir, "
                            "by default <job dir>/traces), a job folder in it, or a rank folder")
    if not path.is_dir():
        raise TraceDirError(f"{path} is a file, not a folder: pass the folder that holds the job's "
                            "rank folders (<trace dir>/<job id>), or the trace dir")
    if path.name.isdigit() and any(is_trace_file(p.name) for p in path.iterdir()):
        path = path.parent  # a rank folder: read its whole job
    ranks = _rank_dirs(path)
    if ranks:
        return path, ranks, []
    jobs = [d for d in sorted(path.iterdir()) if d.is_dir() and _rank_dirs(d)]
    if not jobs:
        raise TraceDirError(
            f"no trace files under {path}: expected <job id>/<rank>/<timestamp>.ndjson below "
            "it. Was the job run with tracing on (undying run --trace on, or undying trace on "
            "while it runs)?"
        )
    jobs.sort(key=_newest)
    chosen = jobs[-1]
    return chosen, _rank_dirs(chosen), [d.name for d in jobs[:-1]]


def _read_lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from f


def load_trace(
    trace_dir: Path,
    *,
    window: int = 10,
    threshold: float = 0.08,
    patience: int = 2,
) -> TraceTable:
    """Read a job's traces and diagnose them (see the module doc). ``TraceDirError`` for bad
    paths."""
    job_dir, rank_dirs, others = find_job_dir(Path(trace_dir))
    files = records = bad = rerun = 0
    skipped: list[str] = []
    accs: dict[int, dict[int, StepAccumulator]] = {}
    nodes: dict[int, str] = {}
    job = job_dir.name
    for rank, rdir in sorted(rank_dirs.items()):
        steps = accs.setdefault(rank, {})
        for p in sorted(rdir.iterdir()):
            if not p.is_file() or not is_trace_file(p.name):
                skipped.append(str(p.relative_to(job_dir)))
                continue
            files += 1
            for line in _read_lines(p):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    bad += 1  # a partial last line, or a line cut short by a full disk
                    continue
                if not isinstance(record, dict):
                    bad += 1
                    continue
                records += 1
                step = record.get("step")
                if isinstance(step, bool) or not isinstance(step, int):
                    continue
                gen = record.get("gen", 0)
                gen = gen if isinstance(gen, int) and not isinstance(gen, bool) else 0
                node = record.get("node")
                if isinstance(node, str) and node:
                    nodes[rank] = node
                acc = steps.get(step)
                if acc is None or gen > acc.gen:
                    if acc is not None:
                        rerun += 1  # the step was run again in a later generation: that run counts
                    acc = steps[step] = StepAccumulator(gen)
                elif gen < acc.gen:
                    continue  # a record of a run that a later generation replaced
                acc.add(record)
    # Anything else in the job folder: a user's notes, a report written there.
    read = {d.name for d in rank_dirs.values()}
    skipped += [p.name for p in sorted(job_dir.iterdir()) if p.name not in read]
    skipped = sorted(set(skipped))
    step_rows: dict[int, list[StepRow]] = {}
    for rank, steps in accs.items():
        step_rows[rank] = [
            StepRow(rank, s, a.gen, a.t, a.values()) for s, a in sorted(steps.items()) if a.done
        ]
    if not any(step_rows.values()):
        raise TraceDirError(
            f"the trace files under {job_dir} hold no completed step (no 'step' records): "
            "were the step markers on (undying trace on)?"
        )
    findings, summaries = find_slow(step_rows, nodes, window=window, threshold=threshold,
                                    patience=patience)
    ranks = rank_rows(step_rows, nodes)
    return TraceTable(
        path=job_dir, job=job, other_jobs=others, steps=step_rows, ranks=ranks, findings=findings,
        summaries=summaries, files=files, records=records, bad_lines=bad, rerun_steps=rerun,
        skipped=skipped, window=window, threshold=threshold, patience=patience,
    )  # fmt: skip


