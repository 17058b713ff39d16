"""The slow-rank detector as a pure function over real recorded step phases, at several step times.

The recordings (tests/unit/data/slow_traces/, made by bench/slow_traces.py) are
real ``undying run --trace on`` jobs of the demo script on this 2-core machine:
2 and 4 ranks; short steps (the demo's model, ~10 ms idle), long ones (padded
to 60 ms: the forward pass ~1% of the step, as the demo's is on a loaded
machine) and a larger model (real compute), the demo's model with comm markers
on too (compute judged as step less collective wait, the forward pass a second
witness); fault-free, or one rank slowed
1.5x by ``undying inject slow`` in compute, data or checkpoint from a known
step. Replaying them is deterministic: no process, no clock, no load.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from functools import cache
from pathlib import Path
from statistics import median
from typing import Any

import pytest

from undying.trace.detect import Finding, SlowDetector
from undying.trace.step_rows import StepRow, find_slow
from undying.trace.summary import StepPhases, window_summary

DATA = Path(__file__).parent / "data" / "slow_traces"
CASES = sorted(p.name.removesuffix(".json.gz") for p in DATA.glob("*.json.gz"))
UNIFORM = [c for c in CASES if c.endswith("-uniform")]
SLOWED = [c for c in CASES if not c.endswith("-uniform")]


@cache
def load(name: str) -> dict[str, Any]:
    return json.loads(gzip.decompress((DATA / f"{name}.json.gz").read_bytes()))


def rows_of(rec: dict[str, Any]) -> dict[int, list[StepRow]]:
    return {int(r): [StepRow(int(r), x[0], x[1], x[2], StepPhases(*x[3:])) for x in rows]
            for r, rows in rec["rows"].items()}  # fmt: skip


def online(rows: dict[int, list[StepRow]], window: int = 10) -> list[tuple[int, Finding]]:
    """What the manager finds: each rank's window summaries as the workers send them, window by window.

    Each finding comes with the last step of the window that completed it.
    """
    buckets: dict[int, dict[int, list[tuple[int, int, StepPhases]]]] = defaultdict(dict)
    for rank, rs in rows.items():
        for row in rs:
            buckets[(row.step - 1) // window].setdefault(rank, []).append((row.step, row.gen, row.phases))
    det = SlowDetector(world_size=len(rows))
    out: list[tuple[int, Finding]] = []
    for w in sorted(buckets):
        for rank in sorted(buckets[w]):
            s = window_summary(rank, "vm", w, buckets[w][rank])
            out += [(s["last_step"], f) for f in det.add(s)]
    return out + [(-1, f) for f in det.flush()]


def test_the_recordings_cover_short_and_long_steps_2_and_4_ranks_every_phase() -> None:
    assert {(c.split("-")[0], c.split("-")[1]) for c in CASES} == {
        (r, g) for r in ("r2", "r4") for g in ("short", "long", "big", "comm")}  # fmt: skip
    assert {c.rsplit("-", 1)[1] for c in SLOWED} == {"compute", "data", "ckpt"} and len(SLOWED) == 24
    assert all(x[7] is not None for c in CASES if "-comm-" in c for x in load(c)["rows"]["0"])  # comm markers
    steps = {c: median(x[3] for x in load(c)["rows"]["0"]) for c in UNIFORM}
    assert min(steps.values()) < 0.02 and max(steps.values()) > 0.055, steps  # a 3x range of step times


@pytest.mark.parametrize("name", UNIFORM)
def test_no_finding_in_a_fault_free_job(name: str) -> None:
    rows = rows_of(load(name))
    assert [f.describe() for _, f in online(rows)] == []
    assert [f.describe() for f in find_slow(rows, {})[0]] == []


def test_the_forward_pass_is_judged_however_small_a_share_of_the_step() -> None:
    """The root cause of `undying demo --fault slow` failing on a loaded machine.

    Compute without comm markers is judged by the forward pass, which the
    detector used to skip when it was under 2% of the step: the demo's 0.4 ms
    forward pass in a 60 ms step, although the slowed rank's was 75x the others'.
    """
    rec = load("r4-long-compute")
    rows = rows_of(rec)
    after = [r.phases for rs in rows.values() for r in rs if r.step > rec["injected"]["step"] + 10]
    others_fp = median(p.fp for rank, rs in rows.items() if rank != 2 for p in (r.phases for r in rs))
    assert others_fp < 0.02 * median(p.step for p in after)  # the old gate's condition held
    [(_, f)] = online(rows)
    assert (f.rank, f.phase, f.evidence["basis"]) == (2, "compute", "fp")


@pytest.mark.parametrize("name", SLOWED)
def test_a_slowed_rank_is_found_with_its_start_and_size(name: str) -> None:
    rec = load(name)
    rows = rows_of(rec)
    injected, extra = rec["injected"], rec["extra_ms"] / 1000
    start, rank, phase = injected["step"], injected["rank"], injected["phase"]
    # Online, as the manager raises it: that rank, that phase, once; within 50 steps.
    found = online(rows)
    assert [(f.kind, f.rank, f.phase) for _, f in found] == [("slow_rank", rank, phase)], [
        f.describe() for _, f in found]  # fmt: skip
    at, f = found[0]
    assert 0 < at - start <= 50
    # Online the start is a window's first step and the size a window-level estimate: the onset's
    # window is partly slow, and a loaded machine's windows keep some long steps.
    assert abs(f.since_step - start) <= 10
    assert abs(f.excess_s - extra) <= 0.3 * extra, (f.excess_s, extra)
    # Offline (undying diagnose): to the step.
    [g] = find_slow(rows, {})[0]
    assert (g.rank, g.phase) == (rank, phase)
    assert abs(g.since_step - start) <= 5, (g.since_step, start)
    assert abs(g.excess_s - extra) <= 0.2 * extra, (g.excess_s, extra)
    assert g.step_factor is not None and g.step_factor > 1.2
    text = g.describe()
    assert f"rank {rank} is {phase}-slow" in text and f"since step {g.since_step}" in text and "x the step before" in text


def with_slowdown(rows: dict[int, list[StepRow]], rank: int, field: str, extra: dict[int, float]) -> dict[int, list[StepRow]]:
    """``rows`` with ``extra[step]`` seconds added to one rank's ``field`` (and its step) at those steps."""
    out = dict(rows)
    changed = []
    for r in rows[rank]:
        add = extra.get(r.step, 0.0)
        p = r.phases._replace(**{field: getattr(r.phases, field) + add, "step": r.phases.step + add})
        changed.append(StepRow(r.rank, r.step, r.gen, r.t, p))
    out[rank] = changed
    return out


@pytest.mark.parametrize(("name", "field"), [("r4-short-uniform", "fp"), ("r4-big-uniform", "data"),
                                             ("r2-long-uniform", "data")])  # fmt: skip
def test_a_rank_a_little_slow_for_long_is_dated_from_its_real_slowdown(name: str, field: str) -> None:
    """A finding once said "since step 141, +2.4 ms" of a slowdown of +7.7 ms from step 233.

    A rank sitting just under the bar for a long time (a busy neighbour) keeps
    evidence alive; the start and size must come from the real slowdown, not
    from where that evidence first rose. Real fault-free rows, with a drift of
    6% of the step from step 5 and half a step more from step 73.
    """
    rows = rows_of(load(name))
    step = median(r.phases.step for rs in rows.values() for r in rs)
    rank, start = max(rows), 73
    extra = {s: 0.06 * step + (0.5 * step if s >= start else 0.0) for s in range(5, 200)}
    slowed = with_slowdown(rows, rank, field, extra)
    phase = "compute" if field == "fp" else field
    found = online(slowed)
    assert [(f.rank, f.phase) for _, f in found] == [(rank, phase)]
    f = found[0][1]
    assert abs(f.since_step - start) <= 10 and abs(f.excess_s - 0.56 * step) <= 0.2 * 0.5 * step
    [g] = find_slow(slowed, {})[0]
    assert abs(g.since_step - start) <= 5 and abs(g.excess_s - 0.5 * step) <= 0.2 * 0.5 * step
