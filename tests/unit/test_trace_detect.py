"""SlowDetector: no finding on uniform jobs with realistic noise, a slowed rank or node found within 50 steps."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.test_trace_summary import summaries_of, synth_job
from undying.trace.detect import Finding, SlowDetector, describe_finding
from undying.trace.finding import onset


def detect(recs: dict[int, list[dict[str, Any]]], **kw: Any) -> list[tuple[int, Finding]]:
    """Feed a job's summaries as the manager gets them; each finding with the last step of the window that made it."""
    det = SlowDetector(world_size=len(recs), **kw)
    out: list[tuple[int, Finding]] = []
    for s in summaries_of(recs):
        out += [(s["last_step"], f) for f in det.add(s)]
    out += [(-1, f) for f in det.flush()]
    return out


@pytest.mark.parametrize(
    ("ranks", "comm", "nodes", "seed"),
    [(4, True, None, 0), (4, True, None, 1), (4, False, None, 2), (8, True, list("aaaabbbb"), 3)],
)
def test_no_finding_over_1000_steps_of_a_uniform_job(ranks: int, comm: bool, nodes: list[str] | None, seed: int) -> None:
    recs = synth_job(ranks=ranks, steps=1000, seed=seed, comm=comm, nodes=nodes, save_every=25)
    steps = [r["dur"] for r in recs[0] if r["kind"] == "step"]
    usual = sorted(steps)[len(steps) // 2]
    jitter = sorted(abs(s / usual - 1) for s in steps)
    assert jitter[len(jitter) // 2] > 0.04 and jitter[int(0.9 * len(jitter))] > 0.15  # a noisy machine
    assert [f.describe() for _, f in detect(recs)] == []


@pytest.mark.parametrize("phase", ["compute", "data", "ckpt"])
@pytest.mark.parametrize(("seed", "onset"), [(10, 41), (11, 57), (12, 73)])
def test_a_rank_slowed_by_15_percent_is_found_within_50_steps(phase: str, seed: int, onset: int) -> None:
    recs = synth_job(ranks=4, steps=onset + 80, seed=seed, slow={2: (phase, onset, 0.15)})
    found = detect(recs)
    assert len(found) == 1, [f.describe() for _, f in found]
    at, f = found[0]
    assert (f.kind, f.rank, f.ranks, f.phase, f.node) == ("slow_rank", 2, [2], phase, "a")
    # the worker sends a window one step after it ends (on the next step's first record)
    assert 0 < at + 1 - onset + 1 <= 50
    assert onset - 10 <= f.since_step <= onset + 10
    assert 0.1 < f.excess_s / f.evidence["step"] < 0.25
    if phase == "compute":
        assert f.evidence["longest"] and f.evidence["shortest_comm"]
        assert f.evidence["comm"] < f.evidence["others_comm"]
        assert f.factor is not None and 1.1 < f.factor < 1.4
    if phase == "ckpt":
        assert f.factor is None  # the others do not stall at all
        assert "where the others have none" in f.describe()


def test_without_comm_markers_compute_is_judged_by_the_forward_pass() -> None:
    onset = 41
    recs = synth_job(ranks=4, steps=130, seed=5, comm=False, slow={1: ("fp", onset, 0.15)})
    found = detect(recs)
    assert [(f.kind, f.rank, f.phase, f.evidence["basis"]) for _, f in found] == [("slow_rank", 1, "compute", "fp")]
    assert found[0][0] + 2 - onset <= 50
    assert "judged by the forward pass" in found[0][1].describe()


def test_a_slow_node_is_one_finding_not_one_per_rank() -> None:
    onset = 41
    recs = synth_job(ranks=4, steps=150, seed=7, nodes=list("aabb"),
                     slow={2: ("compute", onset, 0.15), 3: ("compute", onset, 0.15)})  # fmt: skip
    found = detect(recs)
    assert [(f.kind, f.rank, f.node, f.ranks, f.phase) for _, f in found] == [("slow_node", -1, "b", [2, 3], "compute")]
    assert found[0][0] + 2 - onset <= 60
    text = found[0][1].describe()
    assert text.startswith("node b (ranks 2, 3) is compute-slow: ") and "comm wait" in text
    # 4 of 8 ranks, in another phase
    recs = synth_job(ranks=8, steps=150, seed=8, nodes=list("aaaabbbb"),
                     slow={r: ("data", onset, 0.15) for r in (4, 5, 6, 7)})  # fmt: skip
    assert [(f.kind, f.node, f.ranks) for _, f in detect(recs)] == [("slow_node", "b", [4, 5, 6, 7])]


def test_one_slow_rank_on_a_node_of_two_is_a_slow_rank() -> None:
    recs = synth_job(ranks=4, steps=300, seed=9, nodes=list("aabb"), slow={2: ("compute", 41, 0.3)})
    found = detect(recs)
    assert [(f.kind, f.rank, f.node) for _, f in found] == [("slow_rank", 2, "b")]


# --- the detector on summaries written by hand ---------------------------------------------------


def window(rank: int, w: int, *, compute: float = 0.08, comm: float | None = 0.02, data: float = 0.001,
           ckpt: float = 0.0, fp: float = 0.03, node: str = "a", gen: int = 0, steps: int = 10) -> dict[str, Any]:
    """A rank's summary of window ``w`` in a job whose ranks all take 0.1 s per step."""
    return {"rank": rank, "node": node, "gen": gen, "window": w, "first_step": 10 * w + 1,
            "last_step": 10 * w + 10, "steps": steps, "step": 0.1, "fp": fp, "data": data, "ckpt": ckpt,
            "comm": comm, "compute": compute}  # fmt: skip


def feed(det: SlowDetector, windows: range, slow: dict[int, dict[str, Any]] | None = None,
         ranks: int = 4) -> list[Finding]:  # fmt: skip
    out: list[Finding] = []
    for w in windows:
        for r in range(ranks):
            out += det.add(window(r, w, **(slow or {}).get(r, {})))
    return out


def test_reported_once_until_it_recovers_then_again() -> None:
    det = SlowDetector(world_size=4, warmup=0)
    slow = {3: {"compute": 0.1, "comm": 0.002}}  # 20 ms more compute, 18 ms less wait: 2.5 bars
    first = feed(det, range(0, 2), slow)
    assert [(f.rank, f.phase, f.since_step) for f in first] == [(3, "compute", 1)]
    assert f"{first[0].factor:.2f}" == "1.25"
    assert feed(det, range(2, 10), slow) == []  # still slow: not reported again
    assert det.active() == [("rank", 3, "compute")]
    assert feed(det, range(10, 20)) == []  # recovers
    assert det.active() == []
    again = feed(det, range(20, 23), slow)
    assert [(f.rank, f.since_step) for f in again] == [(3, 201)]


def test_a_rank_that_computes_longer_but_waits_as_long_is_not_the_one_waited_for() -> None:
    det = SlowDetector(world_size=4)
    assert feed(det, range(0, 10), {3: {"compute": 0.1, "comm": 0.03}}) == []


def test_one_freak_window_is_not_a_finding() -> None:
    det = SlowDetector(world_size=4)
    found = feed(det, range(0, 1), {1: {"data": 0.5}})
    found += feed(det, range(1, 20))
    assert found == []


def test_a_window_is_judged_when_every_rank_sent_it_or_later_windows_came() -> None:
    det = SlowDetector(world_size=4, warmup=0)
    for w in range(2):
        for r in range(4):
            det.add(window(r, w))
    assert det.windows == 2
    # rank 1 dies: its windows do not come; the others' wait for it until 2 later windows arrived
    slow = {"compute": 0.12, "comm": 0.0}
    found: list[Finding] = []
    for w in range(2, 5):
        for r in (0, 2, 3):
            found += det.add(window(r, w, **(slow if r == 2 else {})))
    assert det.windows == 3  # window 2, judged without rank 1 once window 4 came
    assert found == []
    found += det.add(window(0, 5))
    assert det.windows == 4 and [f.rank for f in found] == [2]  # windows 2 and 3 made it
    # a summary of a window already judged is counted, not used
    assert det.add(window(1, 3)) == [] and det.late == 1
    # without a world size, every rank seen so far is waited for
    det = SlowDetector(warmup=0)
    for r in range(3):
        det.add(window(r, 0))
    assert det.windows == 0  # until the job moved on, more ranks may come
    det.add(window(0, 1))
    det.add(window(1, 1))
    assert det.windows == 1  # window 0, with all 3 ranks
    det.add(window(2, 1))
    det.add(window(2, 2))
    assert det.windows == 2


def test_a_restart_from_a_checkpoint_judges_the_rerun_windows() -> None:
    det = SlowDetector(world_size=2)
    for w in range(5):
        det.add(window(0, w))
        det.add(window(1, w))
    assert det.windows == 4, "window 0 is every rank's warm-up"
    for w in (2, 3):
        det.add(window(0, w, gen=1))
        det.add(window(1, w, gen=1))
    assert det.windows == 5, "judged anew from the restart, after its own warm-up window (2)"


def test_a_ranks_first_window_in_a_generation_is_its_warm_up_and_not_judged() -> None:
    """The job's first steps, and the first after a recovery, pay one-time costs (DDP's bucket rebuild, a new
    group's first collectives) on a rank at random: a 2-window burst there made a false finding (see the module doc)."""
    burst = {1: {"compute": 0.1, "comm": 0.002}}  # 2.5 bars, as in test_reported_once_until_it_recovers_then_again
    det = SlowDetector(world_size=4)
    assert feed(det, range(0, 1), burst) + feed(det, range(1, 2), burst) + feed(det, range(2, 12)) == [], (
        "a burst in the warm-up window and one after it is one window of evidence, not a finding")
    # After a recovery (generation 1 from window 12 on): its first window is warm-up again.
    found: list[Finding] = []
    for w in range(12, 14):
        for r in range(4):
            found += det.add(window(r, w, gen=1, **burst.get(r, {})))
    assert found == []
    for w in range(14, 16):
        for r in range(4):
            found += det.add(window(r, w, gen=1, **burst.get(r, {})))
    assert [(f.rank, f.since_step) for f in found] == [(1, 131)], "a slowdown that lasts is found from the window after"


def test_short_windows_and_lone_ranks_are_not_judged() -> None:
    det = SlowDetector(world_size=2)
    assert feed(det, range(5), {1: {"compute": 0.5, "comm": 0.0, "steps": 2}}, ranks=2) == []
    det = SlowDetector(world_size=1)
    assert feed(det, range(5), ranks=1) == [] and det.windows == 0


def test_findings_are_deterministic_and_json_able() -> None:
    recs = synth_job(ranks=4, steps=120, seed=4, slow={0: ("data", 30, 0.2)})
    a = [f.to_dict() for _, f in detect(recs)]
    b = [f.to_dict() for _, f in detect(recs)]
    assert a == b and len(a) == 1
    assert json.loads(json.dumps(a)) == a
    assert describe_finding(a[0]).startswith("rank 0 is data-slow: ")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        SlowDetector(threshold=8)
    with pytest.raises(ValueError, match="patience"):
        SlowDetector(patience=0)


# --- since which step, by how much -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("xs", "since", "size"),
    [
        ([8, 8, 8], 1, 8),  # evidence rose with the slowdown
        ([1.7, 1.7, 1.7, 15.7, 15.6], 31, 15.65),  # a little slow for long, then much slower
        ([1, 2, 5.5, 8, 8.2], 21, 8),  # the onset inside a window: that window half slow
        ([1, 2, 8, 3.5, 8, 8], 21, 8),  # a dip inside the slowdown does not restart it
        ([6, 5, 7, 6], 1, 6),  # noise around one level: no split
    ],
)
def test_onset_splits_where_the_level_changed(xs: list[float], since: int, size: float) -> None:
    history = [(1 + 10 * i, 0.0, x) for i, x in enumerate(xs)]
    assert onset(history) == (since, pytest.approx(size))
    assert onset([]) is None
