"""Tracer: the off path records nothing, the on path records the documented fields."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from undying.protocol.trace_switch import TraceSwitch
from undying.trace import KINDS, STEP_GROUP, Tracer, TraceWriter

BASE_FIELDS = {"v", "kind", "job", "rank", "node", "gen", "step", "t", "dur"}


def make_tracer(writer: TraceWriter | None = None) -> tuple[Tracer, list[dict[str, Any]]]:
    tracer = Tracer(writer, job_id="J", rank=2, node="host")
    seen: list[dict[str, Any]] = []
    tracer.add_listener(seen.append)
    return tracer, seen


def test_kinds() -> None:
    assert KINDS == ("step", "comm", "ckpt", "fp", "data")
    assert STEP_GROUP == ("step", "ckpt", "fp", "data")


def test_off_spans_are_the_shared_noop_and_emit_nothing() -> None:
    tracer, seen = make_tracer()
    assert not tracer.step_on and not tracer.comm_on
    spans = {id(tracer.span(k)) for k in KINDS}
    assert len(spans) == 1
    with tracer.span("fp", name="x") as sp:
        sp.set(bytes=3)
    # Step markers on, comm off: comm spans stay no-ops.
    tracer.apply(TraceSwitch(step=True))
    assert id(tracer.span("comm")) in spans
    assert id(tracer.span("fp")) not in spans
    assert seen == []


def test_unknown_kind_is_an_error_even_when_off() -> None:
    tracer, _ = make_tracer()
    with pytest.raises(ValueError, match="unknown trace marker kind 'forward'"):
        tracer.span("forward")


def test_apply_and_enabled() -> None:
    tracer, _ = make_tracer()
    tracer.apply(TraceSwitch(step=True, comm=True))
    assert tracer.step_on and tracer.comm_on
    assert all(tracer.enabled(k) for k in KINDS)
    tracer.apply(TraceSwitch(step=True))
    assert tracer.step_on and not tracer.comm_on
    assert not tracer.enabled("comm") and all(tracer.enabled(k) for k in STEP_GROUP)
    tracer.apply(TraceSwitch())
    assert not any(tracer.enabled(k) for k in KINDS)


def test_span_records_the_fields() -> None:
    tracer, seen = make_tracer()
    tracer.apply(TraceSwitch(step=True, comm=True))
    tracer.generation, tracer.step = 3, 17
    before = time.time()
    with tracer.span("fp"):
        time.sleep(0.02)
    with tracer.span("ckpt", part="block") as sp:
        sp.set(bytes=1024)
    with tracer.span("step", name="my-phase"):
        pass
    after = time.time()
    assert [r["kind"] for r in seen] == ["fp", "ckpt", "step"]
    fp, ckpt, user = seen
    assert set(fp) == BASE_FIELDS
    assert fp["v"] == 1 and fp["job"] == "J" and fp["rank"] == 2 and fp["node"] == "host"
    assert fp["gen"] == 3 and fp["step"] == 17
    assert before - 1e-6 <= fp["t"] <= after
    assert 0.02 <= fp["dur"] < 1.0
    assert ckpt["part"] == "block" and ckpt["bytes"] == 1024
    assert user["name"] == "my-phase"
    json.dumps(seen)


def test_span_that_raises_is_recorded_with_the_error() -> None:
    tracer, seen = make_tracer()
    tracer.apply(TraceSwitch(step=True))
    with pytest.raises(KeyError), tracer.span("step"):
        raise KeyError("x")
    assert seen[0]["error"] == "KeyError"


def test_emit_builds_the_record_and_takes_overrides() -> None:
    tracer, seen = make_tracer()
    tracer.step = 5
    tracer.emit("comm", 100.0, 0.25, op="allreduce", bytes=4096)
    tracer.emit("comm", 100.0, 0.25, op="allreduce", bytes=1, step=4, gen=1)
    assert seen[0] == {
        "v": 1,
        "kind": "comm",
        "job": "J",
        "rank": 2,
        "node": "host",
        "gen": 0,
        "step": 5,
        "t": 100.0,
        "dur": 0.25,
        "op": "allreduce",
        "bytes": 4096,
    }
    assert (seen[1]["step"], seen[1]["gen"]) == (4, 1)


def test_listeners_add_remove_and_a_failing_one(caplog: pytest.LogCaptureFixture) -> None:
    tracer, seen = make_tracer()
    other: list[dict[str, Any]] = []

    def broken(record: dict[str, Any]) -> None:
        raise RuntimeError("listener bug")

    tracer.add_listener(broken)
    tracer.add_listener(other.append)
    with caplog.at_level(logging.ERROR, logger="undying.trace"):
        tracer.emit("data", 1.0, 0.1)
        tracer.emit("data", 2.0, 0.1)
    assert len(seen) == 2 and len(other) == 2
    assert len([r for r in caplog.records if "listener" in r.getMessage()]) == 1
    tracer.remove_listener(other.append)
    tracer.remove_listener(broken)
    tracer.remove_listener(broken)  # unknown: ignored
    tracer.emit("data", 3.0, 0.1)
    assert len(seen) == 3 and len(other) == 2


def test_records_reach_the_file_from_other_threads(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, "J", 2)
    try:
        tracer, seen = make_tracer(writer)
        tracer.apply(TraceSwitch(step=True, comm=True))

        def comm_thread(k: int) -> None:
            # Like a DDP comm hook's future callback, on gloo's thread.
            for i in range(200):
                tracer.emit("comm", time.time(), 0.001, op="allreduce", bytes=i, thread=k)

        threads = [threading.Thread(target=comm_thread, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for step in range(50):
            tracer.step = step
            with tracer.span("step"):
                pass
        for t in threads:
            t.join()
        assert writer.flush()
        assert writer.path is not None
        assert writer.path.parent == tmp_path / "J" / "2"
        recs = [json.loads(line) for line in writer.path.read_text().splitlines()]
        assert len(recs) == 650 == len(seen) == writer.written
        assert sum(r["kind"] == "comm" for r in recs) == 600
        assert [r["step"] for r in recs if r["kind"] == "step"] == list(range(50))
        for k in range(3):
            assert [r["bytes"] for r in recs if r.get("thread") == k] == list(range(200))
    finally:
        writer.close()
