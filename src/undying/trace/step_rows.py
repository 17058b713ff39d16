"""A job's per-step phases judged: its slow ranks and nodes, the ranks ranked, the steps far
above usual.

Pure functions over the per-step rows that ``analyze.load_trace`` rebuilds from
the trace files (and tests and benches build by hand): ``find_slow`` runs the
window summaries the workers send the manager (``window_summary``) through the
same detector (``SlowDetector``), then makes each finding's onset and size exact
to the step; ``rank_rows`` ranks the ranks by how far each is from the others
and lists the steps whose data-loader wait or checkpoint stall stood far above
that rank's usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

from undying.trace.detect import PHASES, Finding, SlowDetector
from undying.trace.summary import StepPhases, robust_mean, window_summary

__all__ = ["StepRow", "RankRow", "find_slow", "rank_rows", "OUTLIER_LIST_MAX"]

# At most this many outlier steps are listed per rank and kind (the count says how many in all).
OUTLIER_LIST_MAX = 50


@dataclass(frozen=True)
class StepRow:
    """One step of one rank: when it started (wall clock) and its phases in seconds."""

    rank: int
    step: int
    gen: int
    t: float | None
    phases: StepPhases


@dataclass
class RankRow:
    """One rank over the whole trace: its typical phases and how far it stands from the others.

    Phase values are robust means over all its steps (``comm`` None without
    comm records). ``score`` is its largest excess over the other ranks'
    median in any phase, as a fraction of the median step time (0.2: a fifth of
    a step slower than the others there), and ``worst`` that phase. ``outliers``
    lists steps whose data wait or checkpoint stall stood far above the rank's
    own usual (``outlier_counts`` says how many in all).
    """

    rank: int
    node: str
    steps: int
    first_step: int
    last_step: int
    step: float
    compute: float
    fp: float
    data: float
    ckpt: float
    comm: float | None
    score: float = 0.0
    worst: str = ""
    outliers: dict[str, list[int]] = field(default_factory=dict)
    outlier_counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "node": self.node, "steps": self.steps,
            "first_step": self.first_step, "last_step": self.last_step,
            "step_s": self.step, "compute_s": self.compute, "fp_s": self.fp,
            "data_s": self.data, "ckpt_s": self.ckpt, "comm_wait_s": self.comm,
            "score": self.score, "worst_phase": self.worst,
            "outliers": self.outliers, "outlier_counts": self.outlier_counts,
        }  # fmt: skip



def find_slow(
    step_rows: dict[int, list[StepRow]],
    nodes: dict[int, str],
    *,
    window: int = 10,
    threshold: float = 0.08,
    patience: int = 2,
    refine: bool = True,
) -> tuple[list[Finding], list[dict[str, Any]]]:
    """The findings in a job's per-step phases, and the window summaries the detector was given.

    A pure function (what ``load_trace`` runs once the files are read): the
    manager's window summaries and detector, then, with ``refine``, each
    finding's onset and size made exact to the step from the per-step rows
    (``_refine``); without, the findings are the manager's own. Each
    finding's evidence says at which step it was made (``found_at_step``: the
    last step of the window that completed it; None when only the end did).
    """
    summaries = _summaries(step_rows, nodes, window)
    world_size = sum(1 for rows in step_rows.values() if rows)
    detector = SlowDetector(threshold, patience, world_size=world_size)
    findings: list[Finding] = []
    for s in summaries:
        for f in detector.add(s):
            f.evidence["found_at_step"] = s["last_step"]
            findings.append(f)
    for f in detector.flush():
        f.evidence["found_at_step"] = None
        findings.append(f)
    return ([_refine(f, step_rows, window) for f in findings] if refine else findings), summaries


def _summaries(
    step_rows: dict[int, list[StepRow]], nodes: dict[int, str], window: int
) -> list[dict[str, Any]]:
    """Every rank's window summaries, window by window (all ranks' window k before any k+1)."""
    buckets: dict[int, dict[int, list[tuple[int, int, StepPhases]]]] = {}
    for rank, rows in step_rows.items():
        for row in rows:
            buckets.setdefault((row.step - 1) // window, {}).setdefault(rank, []).append(
                (row.step, row.gen, row.phases)
            )
    out = []
    for w in sorted(buckets):
        for rank in sorted(buckets[w]):
            out.append(window_summary(rank, nodes.get(rank), w, buckets[w][rank]))
    return out


def _excess_by_step(
    rank: int, basis: str, step_rows: dict[int, list[StepRow]], span: int = 5
) -> dict[int, float]:
    """Step -> ``rank``'s ``basis`` value (a StepPhases field) over the other ranks' usual at
    that step.

    The others' usual is the median of their per-step median over the ``span``
    steps either side: one rank descheduled for a step or two on a loaded
    machine (with 2 ranks, the only other one) must not read as the slow
    rank's excess dropping there.
    """
    by_step: dict[int, dict[int, float]] = {}
    for r, rows in step_rows.items():
        for row in rows:
            value = getattr(row.phases, basis)
            if value is not None:
                by_step.setdefault(row.step, {})[r] = float(value)
    others: dict[int, float] = {}
    for step, values in by_step.items():
        m = _others_median(values, rank)
        if m is not None:
            others[step] = m
    out: dict[int, float] = {}
    for step, values in by_step.items():
        near = [others[s] for s in range(step - span, step + span + 1) if s in others]
        if rank in values and near:
            out[step] = values[rank] - median(near)
    return out


def _step_onset(excess: dict[int, float], near: int, window: int) -> tuple[int, float] | None:
    """The step a slowdown began and its size (seconds per step), from one rank's excess step
    by step.

    The detector works on windows, so its ``since`` is a window's first step;
    the files have every step. The level is the median excess over the three
    windows after ``near`` + one window (well inside the slowdown); the onset is
    the first step within a window of ``near`` from which at least 4 of 5 steps
    stand at half that level or more (one step of noise neither starts nor
    breaks it); the size, the median excess from there over three windows.
    """
    after = [excess[s] for s in range(near + window, near + 4 * window) if s in excess]
    if len(after) < window:
        after = [x for s, x in excess.items() if s >= near]
    if not after:
        return None
    half = median(after) / 2
    if half <= 0:
        return None
    for start in range(near - window, near + window + 1):
        run = [excess[s] for s in range(start, start + 5) if s in excess]
        if (start in excess and excess[start] >= half and len(run) >= 4
                and sum(x >= half for x in run) >= 4):
            slowed = [excess[s] for s in range(start, start + 3 * window) if s in excess]
            return start, median(slowed)
    return None


def _refine(finding: Finding, step_rows: dict[int, list[StepRow]], window: int) -> Finding:
    """A finding's onset and size to the step, from the per-step phases (see ``_step_onset``)."""
    basis = finding.evidence.get("basis") or finding.phase
    if basis not in StepPhases._fields:
        return finding
    onsets = [_step_onset(_excess_by_step(r, basis, step_rows), finding.since_step, window)
              for r in finding.ranks]
    if any(o is None for o in onsets):
        return finding
    found = [o for o in onsets if o is not None]
    since = int(median(o[0] for o in found))
    size = sum(o[1] for o in found) / len(found)
    # The job's step before the slowdown: the median over ranks, over the three windows before it.
    per_step: dict[int, list[float]] = {}
    for rows in step_rows.values():
        for row in rows:
            if since - 3 * window <= row.step < since:
                per_step.setdefault(row.step, []).append(row.phases.step)
    base = median(median(v) for v in per_step.values()) if per_step else 0.0
    return replace(
        finding, since_step=since, excess_s=round(size, 6),
        step_factor=round((base + size) / base, 4) if base > 0 else finding.step_factor,
        evidence={**finding.evidence, "onset": "steps"},
    )  # fmt: skip


def _others_median(values: dict[int, float], rank: int) -> float | None:
    rest = [v for r, v in values.items() if r != rank]
    return median(rest) if rest else None


def rank_rows(step_rows: dict[int, list[StepRow]], nodes: dict[int, str]) -> list[RankRow]:
    rows: list[RankRow] = []
    for rank, steps in sorted(step_rows.items()):
        if not steps:
            continue
        ph = [s.phases for s in steps]
        comms = [p.comm for p in ph if p.comm is not None]
        row = RankRow(
            rank=rank, node=nodes.get(rank, ""), steps=len(steps),
            first_step=steps[0].step, last_step=steps[-1].step,
            step=robust_mean([p.step for p in ph]), compute=robust_mean([p.compute for p in ph]),
            fp=robust_mean([p.fp for p in ph]), data=robust_mean([p.data for p in ph]),
            ckpt=robust_mean([p.ckpt for p in ph]), comm=robust_mean(comms) if comms else None,
        )  # fmt: skip
        row.outliers, row.outlier_counts = _outliers(steps, row.step)
        rows.append(row)
    _score(rows)
    rows.sort(key=lambda r: (-r.score, r.rank))
    return rows


def _score(rows: list[RankRow]) -> None:
    """Each rank's largest excess over the others' median, in any phase, as a share of the step
    time.

    Compute counts only with comm markers (without them every rank's compute
    holds the same wait for the slowest); the forward pass stands in for it.
    """
    if len(rows) < 2:
        return
    step = median(r.step for r in rows)
    if step <= 0:
        return
    comm_known = all(r.comm is not None for r in rows)
    waits = {x.rank: float(x.comm or 0.0) for x in rows}
    best: dict[int, tuple[float, str]] = {}
    for phase in PHASES:
        attr = "fp" if phase == "compute" and not comm_known else phase
        values = {r.rank: float(getattr(r, attr)) for r in rows}
        for r in rows:
            m = _others_median(values, r.rank)
            if m is None:
                continue
            excess = (values[r.rank] - m) / step
            if comm_known and phase == "compute":
                mc = _others_median(waits, r.rank)
                if mc is not None and waits[r.rank] >= mc:
                    # Computes longer but waits as long: not the one waited for.
                    excess = min(excess, 0.0)
            if excess > best.get(r.rank, (-math.inf, ""))[0]:
                best[r.rank] = (excess, phase)
    for r in rows:
        excess, phase = best.get(r.rank, (0.0, ""))
        r.score = round(excess, 4)
        r.worst = phase if excess > 0 else ""  # no phase where it is slower than the others


def _outliers(steps: list[StepRow], step_s: float) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Steps whose data wait or checkpoint stall stood far above this rank's usual.

    "Far above": more than the rank's median for that phase plus the larger of
    5 robust standard deviations (1.4826 x the median absolute deviation) and
    a quarter of its step time; one long wait in a thousand steps is what a
    person wants to see, the usual jitter is not. Checkpoint stalls are judged
    among the steps that had one (a rank that saves every 100 steps has a
    median stall of 0 over all steps).
    """
    lists: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    for kind in ("data", "ckpt"):
        pairs = [(s.step, float(getattr(s.phases, kind))) for s in steps]
        if kind == "ckpt":
            pairs = [(n, v) for n, v in pairs if v > 0]
        if len(pairs) < 3:
            continue
        values = [v for _, v in pairs]
        m = median(values)
        mad = median(abs(v - m) for v in values)
        limit = m + max(5 * 1.4826 * mad, 0.25 * step_s)
        hits = [n for n, v in pairs if v > limit and math.isfinite(v)]
        if hits:
            counts[kind] = len(hits)
            worst = sorted(pairs, key=lambda p: -p[1])
            keep = {n for n, v in worst if v > limit}
            lists[kind] = (
                sorted(keep)[:OUTLIER_LIST_MAX] if len(keep) <= OUTLIER_LIST_MAX
                else sorted(n for n, _ in worst[:OUTLIER_LIST_MAX])
            )
    return lists, counts
