"""StepSummarizer: per-rank window summaries from trace records, and the synthetic jobs the trace tests share.

``synth_job`` makes the records of a synchronous DDP job step by step, with
the timing a real one has: every rank computes with its own per-step jitter
(log-normal, plus an occasional step up to 2.5x as long), the machine's load
moves all ranks together, data waits spike now and then, and the collective
ends only when the last rank arrived, so a fast rank's wait is the slow
rank's extra time. Step times jitter by 10-30% from step to step, as on a
loaded 2-core machine. A slowdown adds a fraction of the usual step time to
one phase of chosen ranks from a chosen step.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from undying.trace.summary import StepAccumulator, StepSummarizer, robust_mean, window_summary

T0 = 1763880000.0


def synth_job(
    *,
    ranks: int = 4,
    steps: int = 200,
    seed: int = 0,
    nodes: list[str] | None = None,
    slow: dict[int, tuple[str, int, float]] | None = None,
    comm: bool = True,
    step_s: float = 0.05,
    sigma: float = 0.12,
    save_every: int = 0,
    gen_from: dict[int, int] | None = None,
    job: str = "J",
) -> dict[int, list[dict[str, Any]]]:
    """Records per rank. ``slow`` = {rank: (phase, from_step, fraction of the usual step)}.

    ``gen_from`` = {step: generation}: from that step on, records carry that
    generation (as after a recovery).
    """
    rng = random.Random(seed)
    nodes = nodes or ["a"] * ranks
    slow = slow or {}
    compute0, data0, xfer0, post = step_s * 0.8, step_s * 0.05, step_s * 0.1, step_s * 0.02
    out: dict[int, list[dict[str, Any]]] = {r: [] for r in range(ranks)}
    start = [T0] * ranks
    usual: list[float] = []  # rank 0's step times so far: what "the usual step" is
    gen = 0
    for s in range(1, steps + 1):
        gen = (gen_from or {}).get(s, gen)
        load = math.exp(rng.gauss(0, 0.08))
        parts, arrive = [], []
        for r in range(ranks):
            jitter = math.exp(rng.gauss(0, sigma)) * (rng.uniform(1.5, 2.5) if rng.random() < 0.03 else 1.0)
            c = compute0 * load * jitter
            d = data0 * math.exp(rng.gauss(0, 0.4)) + (step_s * rng.uniform(0.3, 1.0) if rng.random() < 0.02 else 0)
            k = step_s * 0.5 * math.exp(rng.gauss(0, 0.1)) if save_every and s % save_every == 0 else 0.0
            phase, frm, frac = slow.get(r, ("", 0, 0.0))
            if phase and s >= frm:
                extra = frac * sorted(usual)[len(usual) // 2] if usual else frac * step_s
                if phase == "compute":
                    c += extra * jitter  # a slower device: the extra time jitters with the rest
                elif phase == "data":
                    d += extra
                elif phase == "ckpt":
                    k += extra
                elif phase == "fp":  # the extra time spent in the forward pass (as an injected sleep)
                    c += extra
            fp = c * 0.35 * math.exp(rng.gauss(0, 0.05)) + (extra if phase == "fp" and s >= frm else 0.0)
            parts.append((c, d, k, fp))
            arrive.append(start[r] + d + c)
        end = max(arrive) + xfer0 * math.exp(rng.gauss(0, 0.2))
        for r in range(ranks):
            c, d, k, fp = parts[r]
            t = start[r]
            base = {"v": 1, "job": job, "rank": r, "node": nodes[r], "gen": gen, "step": s}
            recs = [dict(base, kind="data", t=t, dur=d), dict(base, kind="fp", t=t + d, dur=fp)]
            if comm:  # two buckets overlapping the backward pass, the last one waiting for the slowest rank
                recs.append(dict(base, kind="comm", op="allreduce", bytes=1 << 22, t=t + d + fp, dur=c - fp))
                recs.append(dict(base, kind="comm", op="allreduce", bytes=1 << 20, t=arrive[r], dur=end - arrive[r]))
            total = end + post + k - t
            if k:  # the training loop's stall after the commit: the tracer writes it after the step record
                recs.append(dict(base, kind="step", t=t, dur=total - k))
                recs.append(dict(base, kind="ckpt", part="block", bytes=1 << 20, t=end + post, dur=k))
                recs.append(dict(base, kind="ckpt", part="write", bytes=1 << 20, t=end + post + k, dur=5 * k))
            else:
                recs.append(dict(base, kind="step", t=t, dur=total))
            for rec in recs:
                rec["t"], rec["dur"] = round(rec["t"], 6), round(rec["dur"], 7)
            out[r].extend(recs)
            start[r] = t + total
            if r == 0:
                usual.append(total)
    return out


def write_trace(root: Path, recs: dict[int, list[dict[str, Any]]], *, job: str = "J", files: int = 2) -> Path:
    """Write records as the tracer does: ``root/<job>/<rank>/<timestamp>.ndjson``, split over ``files`` files."""
    for rank, rows in recs.items():
        d = root / job / str(rank)
        d.mkdir(parents=True, exist_ok=True)
        size = math.ceil(len(rows) / files)
        for i in range(files):
            name = f"20261123T1015{i:02d}.{rank:06d}Z.ndjson"
            with open(d / name, "w") as f:
                for rec in rows[i * size : (i + 1) * size]:
                    f.write(json.dumps(rec) + "\n")
    return root / job


def summaries_of(recs: dict[int, list[dict[str, Any]]], window: int = 10) -> list[dict[str, Any]]:
    """Every rank's summaries as the workers make them (take after each record, flush at the end), window-major."""
    out = []
    for rows in recs.values():
        sm = StepSummarizer(window)
        for rec in rows:
            sm.observe(rec)
            while (s := sm.take()) is not None:
                out.append(s)
        s = sm.flush()
        while s is not None:
            out.append(s)
            s = sm.take()
    out.sort(key=lambda s: (s["window"], s["rank"]))
    return out


def _rec(kind: str, step: int, t: float, dur: float, **kw: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, "job": "J", "rank": 1, "node": "n1", "gen": kw.pop("gen", 0),
            "step": step, "t": t, "dur": dur, **kw}  # fmt: skip


def test_windows_are_aligned_on_step_numbers_and_close_when_the_next_begins() -> None:
    sm = StepSummarizer(window=10)
    for s in range(5, 21):  # a rank that joined at step 5
        sm.observe(_rec("step", s, T0 + s, 0.1))
        if s <= 10:
            assert sm.take() is None  # the window is not over before a record of the next one
    first = sm.take()
    assert first is not None and sm.take() is None
    assert (first["window"], first["first_step"], first["last_step"], first["steps"]) == (0, 5, 10, 6)
    sm.observe(_rec("data", 21, T0 + 21, 0.01))
    second = sm.take()
    assert second is not None and (second["first_step"], second["last_step"], second["steps"]) == (11, 20, 10)
    assert second["rank"] == 1 and second["node"] == "n1" and second["gen"] == 0
    json.dumps(second)  # JSON-able, a few numbers
    assert len(second) <= 13


def test_a_stall_recorded_after_the_step_record_stays_in_its_window() -> None:
    """The tracer writes a save's stall after the commit, so after the step record of a window's last step."""
    sm = StepSummarizer(window=2)
    sm.observe(_rec("step", 1, T0, 0.1))
    sm.observe(_rec("step", 2, T0 + 0.1, 0.1))
    assert sm.take() is None  # as the worker polls after each step record
    sm.observe(_rec("ckpt", 2, T0 + 0.2, 0.05, part="block"))
    sm.observe(_rec("ckpt", 2, T0 + 0.25, 0.5, part="write"))  # background: costs the loop nothing
    sm.observe(_rec("step", 3, T0 + 0.25, 0.1))
    s = sm.take()
    assert s is not None and s["ckpt"] == pytest.approx(0.025)  # the median of 0 and 0.05
    # a stall outside the step's interval does not eat into the step's compute
    assert s["compute"] == pytest.approx(0.1)


def test_phases_of_a_step() -> None:
    acc = StepAccumulator(gen=0)
    acc.add(_rec("data", 7, T0, 0.01))
    acc.add(_rec("fp", 7, T0 + 0.01, 0.02))
    acc.add(_rec("fp", 7, T0 + 0.03, 0.02))  # two micro-batches: summed
    # bucket all-reduces overlapping each other and the backward pass: the exposed wait is the tail
    acc.add(_rec("comm", 7, T0 + 0.05, 0.04, op="allreduce"))
    acc.add(_rec("comm", 7, T0 + 0.07, 0.03, op="allreduce"))
    acc.add(_rec("ckpt", 7, T0 + 0.10, 0.01, part="block"))
    assert not acc.done
    acc.add(_rec("step", 7, T0, 0.11))
    p = acc.values()
    assert p.step == 0.11 and p.fp == pytest.approx(0.04) and p.data == 0.01 and p.ckpt == 0.01
    assert p.comm == pytest.approx(0.03)  # last launch at +0.07, last completion at +0.10
    assert p.compute == pytest.approx(0.11 - 0.01 - 0.01 - 0.03, abs=1e-5)
    no_comm = StepAccumulator(gen=0)
    no_comm.add(_rec("step", 7, T0, 0.11))
    assert no_comm.values().comm is None and no_comm.values().compute == 0.11


def test_a_later_generation_replaces_a_step_and_stragglers_are_dropped() -> None:
    sm = StepSummarizer(window=10)
    sm.observe(_rec("step", 1, T0, 0.1))
    sm.observe(_rec("step", 2, T0, 5.0))  # the attempt that failed
    sm.observe(_rec("step", 2, T0 + 6, 0.1, gen=1))  # re-run after the recovery
    sm.observe(_rec("data", 2, T0, 9.0, gen=0))  # a straggler of the failed attempt
    s = sm.flush()
    assert s is not None and s["steps"] == 2 and s["step"] == pytest.approx(0.1) and s["data"] == 0
    assert s["gen"] == 1 and sm.dropped == 1
    # a restart from a checkpoint goes back to an earlier window: a new generation's window is made anew
    sm.observe(_rec("step", 25, T0, 0.1, gen=1))
    sm.observe(_rec("step", 12, T0, 0.2, gen=2))
    sm.observe(_rec("step", 3, T0, 0.1, gen=1))  # an older generation's earlier window: dropped
    old, new = sm.take(), sm.flush()
    assert old is not None and old["window"] == 2
    assert new is not None and new["window"] == 1 and new["gen"] == 2 and new["steps"] == 1
    assert sm.dropped == 2


def test_records_without_a_step_or_duration_are_ignored() -> None:
    sm = StepSummarizer(window=10)
    sm.observe({"kind": "step", "dur": 0.1})
    sm.observe(_rec("step", 1, T0, -1.0))
    sm.observe(_rec("step", True, T0, 0.1))  # type: ignore[arg-type]
    sm.observe(_rec("unknown", 1, T0, 0.1))
    assert sm.flush() is None


def test_robust_mean_ignores_the_odd_long_step() -> None:
    assert robust_mean([1.0] * 8 + [10.0, 20.0]) == 1.0
    assert robust_mean([1.0, 2.0, 30.0]) == 2.0  # the median of fewer than 5
    assert robust_mean([float(i) for i in range(1, 11)]) == pytest.approx(5.5)
    with pytest.raises(ValueError):
        robust_mean([])


def test_summaries_of_a_synthetic_job_say_who_is_slow() -> None:
    recs = synth_job(ranks=4, steps=60, seed=3, slow={2: ("compute", 1, 0.3)})
    sums = summaries_of(recs)
    assert len(sums) == 4 * 6 and {s["steps"] for s in sums} == {10}
    last = {s["rank"]: s for s in sums if s["window"] == 5}
    others = [last[r] for r in (0, 1, 3)]
    assert all(last[2]["compute"] > o["compute"] for o in others)
    assert all(last[2]["comm"] < o["comm"] for o in others)  # the slow rank waits least
    assert max(s["step"] for s in last.values()) / min(s["step"] for s in last.values()) < 1.05  # synchronous


def test_window_summary_is_what_the_summarizer_sends() -> None:
    recs = synth_job(ranks=1, steps=10, seed=1)
    sm = StepSummarizer(10)
    accs: dict[int, StepAccumulator] = {}
    for rec in recs[0]:
        sm.observe(rec)
        accs.setdefault(rec["step"], StepAccumulator(0)).add(rec)
    online = sm.flush()
    offline = window_summary(0, "a", 0, [(s, a.gen, a.values()) for s, a in accs.items()])
    assert online == offline
