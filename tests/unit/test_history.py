"""The run's history (the page's charts, the metrics' histograms): bounded, whole, and read back as scraped."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from undying.config import JobConfig
from undying.jobfiles.events import EventLog
from undying.jobfiles.records import IncidentKind
from undying.manager.http.server import build_app
from undying.manager.manager import Manager
from undying.manager.views.history import LABELLED_RANKS, Downsampled, RunHistory
from undying.manager.views.metrics import exposition, metric_names, new_registry
from undying.protocol.worker_wire import CheckpointSaved, StepCommitted

TOKEN = "t" * 32


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_series_keeps_the_whole_run_in_bounded_buckets_and_keeps_its_spikes() -> None:
    series = Downsampled(capacity=8)
    for step in range(1, 101):
        series.add(step, 5.0 if step == 77 else 1.0)
    assert series.width == 16 and len(series.points(limit=100)) <= 8  # 100 steps in 8 buckets of 16
    points = series.points(limit=100)
    assert points[0][0] == 1 and points[-1][1] == 100  # the whole run, from its first step to its last
    assert sum(p[1] - p[0] + 1 for p in points) == 100
    spike = [p for p in points if p[0] <= 77 <= p[1]]
    assert len(spike) == 1 and spike[0][4] == 5.0 and spike[0][3] == 1.0  # the max survives the merge
    assert spike[0][2] == pytest.approx((15 * 1.0 + 5.0) / 16)
    assert len(series.points(limit=3)) <= 3  # asked for fewer points: merged further
    # A range: only the buckets that overlap it.
    assert all(p[1] >= 40 and p[0] <= 60 for p in series.points(40, 60))
    series.add(101, math.nan)  # a NaN is no point
    assert series.points()[-1][1] == 100


def test_a_short_run_is_kept_step_by_step() -> None:
    series = Downsampled()
    for step in range(5, 300):
        series.add(step, float(step))
    points = series.points(limit=2000)
    assert series.width == 1 and [p[0] for p in points] == list(range(5, 300))
    assert series.points(100, 109, limit=2000) == [[s, s, float(s), float(s), float(s)] for s in range(100, 110)]


def feed(history: RunHistory, ranks: int, steps: range, dt: float = 0.1, slow: dict[int, float] | None = None,
         t0: float = 1000.0) -> None:
    """Each step every rank commits ``dt`` after the previous one (plus its extra in ``slow``), loss falling."""
    t = t0
    for step in steps:
        t += dt
        for rank in range(ranks):
            history.commit(rank, step, t + (slow or {}).get(rank, 0.0), {"loss": 1.0 / step, "lr": 0.1}, ranks)


def test_job_and_rank_step_times_and_values() -> None:
    history = RunHistory()
    feed(history, 2, range(1, 11))
    view = history.view()
    assert [p[0] for p in view["step_times"]] == list(range(2, 11))  # step 1 has no step before it
    assert all(p[2] == pytest.approx(0.1) for p in view["step_times"])
    assert set(view["ranks"]) == {"0", "1"} and len(view["ranks"]["1"]) == 9
    assert view["values"]["loss"][0] == [1, 1, 1.0, 1.0, 1.0] and set(view["values"]) == {"loss", "lr"}
    assert history.step_seconds.count == 9 and history.step_seconds.total == pytest.approx(0.9)
    assert set(history.rank_step_seconds) == {"0", "1"} and history.rank_step_seconds["0"].count == 9


def test_a_step_is_the_jobs_when_its_last_rank_committed_it() -> None:
    history = RunHistory()
    for rank, t in ((0, 10.0), (1, 10.5)):
        history.commit(rank, 1, t, {}, 2)
    history.commit(0, 2, 11.0, {}, 2)
    assert history.view()["step_times"] == []  # rank 1 has not committed step 2 yet
    history.commit(1, 2, 12.0, {}, 2)
    assert history.view()["step_times"] == [[2, 2, 1.5, 1.5, 1.5]]  # 10.5 -> 12.0
    assert history.view()["ranks"]["0"] == [[2, 2, 1.0, 1.0, 1.0]]


def test_rank_labels_are_bounded_and_page_lines_too() -> None:
    history = RunHistory()
    feed(history, 40, range(1, 4))
    labels = set(history.rank_step_seconds)
    assert labels == {str(r) for r in range(LABELLED_RANKS)} | {f"{LABELLED_RANKS}+"}
    assert history.rank_step_seconds[f"{LABELLED_RANKS}+"].count == (40 - LABELLED_RANKS) * 2
    assert len(history.view()["ranks"]) == 32


def test_logged_names_are_bounded() -> None:
    history = RunHistory()
    for step in range(1, 4):
        history.commit(0, step, float(step), {f"v{i}": 1.0 for i in range(20)} | {"bad name!": 2.0}, 1)
    assert len(history.values) == 8 and "bad name!" not in history.values


def test_checkpoint_saves_are_measured_and_failures_and_reuses_are_not() -> None:
    history = RunHistory()
    history.checkpoint(CheckpointSaved(0, 10, "periodic", "/c/10", 0.02, 1.5, 4096, 1.0))
    history.checkpoint(CheckpointSaved(0, 20, "periodic", "", 0.0, 0.1, 0, 2.0, error="ENOSPC"))
    history.checkpoint(CheckpointSaved(0, 20, "existing", "/c/10", 0.0, 0.0, 0, 3.0))
    assert history.save_seconds["write"].count == 1 and history.save_seconds["blocking"].total == pytest.approx(0.02)
    assert history.bytes_written == 4096


@pytest.mark.parametrize("ratio, losses, words", [
    (1.5, {}, "between 0 and 1"), (True, {}, "between 0 and 1"), (0.5, {"recovery": -1.0}, "0 or more"),
    (0.5, {"a b": 1.0}, "short name"), (0.5, {f"c{i}": 1.0 for i in range(17)}, "at most 16"),
    (0.5, {"recovery": math.inf}, "0 or more"),
])
def test_goodput_setter_checks_its_inputs(ratio: Any, losses: dict[str, float], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        RunHistory().set_goodput(ratio, losses)


STATUS: dict[str, Any] = {
    "job_id": "j", "state": "running", "step": 30, "spares_ready": 2,
    "checkpoints": {"last": {"step": 20, "bytes": 4096, "kind": "periodic"}, "health": {"failures": 1}},
    "ranks": [], "incidents": [],
}


def test_the_histograms_and_gauges_as_scraped() -> None:
    history = RunHistory()
    feed(history, 2, range(1, 31), dt=0.2)
    history.checkpoint(CheckpointSaved(0, 20, "periodic", "/c/20", 0.02, 1.5, 4096, 1.0))
    before = samples(exposition(new_registry(lambda: STATUS, history)).decode())
    assert ("undying_goodput_ratio", ()) not in before  # not worked out yet: no made-up number
    history.set_goodput(0.9, {"recovery": 3.0, "startup": 1.5})
    got = samples(exposition(new_registry(lambda: STATUS, history)).decode())
    assert got[("undying_step_seconds_count", ())] == 29
    assert got[("undying_step_seconds_bucket", (("le", "0.1"),))] == 0
    assert got[("undying_step_seconds_bucket", (("le", "0.25"),))] == 29
    assert got[("undying_step_seconds_sum", ())] == pytest.approx(29 * 0.2)
    assert got[("undying_rank_step_seconds_count", (("rank", "1"),))] == 29
    assert got[("undying_checkpoint_save_seconds_count", (("part", "write"),))] == 1
    assert got[("undying_checkpoint_save_seconds_bucket", (("le", "2.0"), ("part", "write")))] == 1
    assert got[("undying_checkpoint_save_seconds_bucket", (("le", "1.0"), ("part", "write")))] == 0
    assert got[("undying_checkpoint_written_bytes_total", ())] == 4096
    assert got[("undying_checkpoint_bytes", ())] == 4096
    assert got[("undying_checkpoint_last_step", ())] == 20
    assert got[("undying_checkpoint_steps_behind", ())] == 10
    assert got[("undying_checkpoint_failures_total", ())] == 1
    assert got[("undying_spares_ready", ())] == 2
    assert got[("undying_goodput_ratio", ())] == 0.9
    assert got[("undying_goodput_lost_seconds", (("cause", "recovery"),))] == 3.0
    assert got[("undying_step_value", (("name", "loss"),))] == pytest.approx(1.0 / 30)  # the newest step's
    assert got[("undying_step_value", (("name", "lr"),))] == pytest.approx(0.1)
    # Every kind from 0 before the first incident.
    for kind in IncidentKind:
        assert got[("undying_incidents_total", (("kind", kind.value),))] == 0


def test_every_family_is_there_from_the_first_scrape(tmp_path: Path) -> None:
    """The names a dashboard may query do not depend on how far the job got."""
    manager = Manager(JobConfig(job_id="fresh", job_dir=str(tmp_path), nproc_per_node=2),
                      EventLog(tmp_path / "events.db"))
    try:
        fresh = metric_names(new_registry(manager.status, manager.history))
        history = RunHistory()
        feed(history, 2, range(1, 5))
        history.set_goodput(0.5, {"recovery": 1.0})
        fed = metric_names(new_registry(lambda: STATUS, history))
        assert fresh == fed
        assert {"undying_step_seconds_bucket", "undying_incidents_total", "undying_goodput_ratio",
                "undying_checkpoint_save_seconds_sum", "undying_spares_ready"} <= fresh
    finally:
        manager.close()


def test_a_restarted_managers_history_is_read_back_from_the_log(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.db")
    t = 100.0
    for step in range(1, 21):
        t += 0.5
        events.steps([(rank, step, 0, t, {"loss": 2.0 / step}) for rank in range(2)])
    events.event("checkpoint_saved", rank=0, step=10, kind="periodic", path="/c", blocking_s=0.01, write_s=0.3,
                 bytes=100)
    events.flush()
    history = RunHistory()
    history.replay(tmp_path / "events.db", 2)
    events.close()
    assert history.step_seconds.count == 19 and history.bytes_written == 100
    assert history.view()["values"]["loss"][-1] == [20, 20, 0.1, 0.1, 0.1]


def test_the_series_endpoint(tmp_path: Path) -> None:
    manager = Manager(JobConfig(job_id="s", job_dir=str(tmp_path), nproc_per_node=2), EventLog(tmp_path / "e.db"))
    feed(manager.history, 2, range(1, 2001), dt=0.01)

    async def fetch(query: str, token: str = TOKEN) -> tuple[int, Any]:
        async with TestClient(TestServer(build_app(manager, token=TOKEN)),
                              headers={"Authorization": "Bearer " + token}) as client:
            answer = await client.get("/api/series" + query)
            return answer.status, await answer.json()

    try:
        status, whole = asyncio.run(fetch(""))
        assert status == 200 and whole["first"] == 2 and whole["last"] == 2000 and whole["width"] == 2
        assert len(whole["step_times"]) <= 400 and whole["step_times"][0][0] == 2
        assert whole["world_size"] == 2 and whole["incidents"] == [] and len(whole["values"]["loss"]) <= 400
        status, few = asyncio.run(fetch("?points=10"))
        assert status == 200 and len(few["step_times"]) == 10 and few["step_times"][-1][1] == 2000
        status, zoomed = asyncio.run(fetch("?from=1000&to=1100&points=2000"))
        assert status == 200 and zoomed["step_times"][0][0] >= 998 and zoomed["step_times"][-1][1] <= 1101
        assert len(zoomed["step_times"]) == 51  # the stored buckets of 2 steps, none merged further
        for query, words in (("?points=5", "?points= must be a whole number from 10"), ("?to=%C2%B2", "?to= must"),
                             ("?from=abc", "?from= must be a whole number"),
                             ("?from=9&to=3", "?from=9 is after ?to=3")):
            status, error = asyncio.run(fetch(query))
            assert status == 400 and words in error["error"], (query, error)
        status, error = asyncio.run(fetch("", token="wrong" * 8))
        assert status == 401 and "token" in error["error"]  # the run is the job's, like its status
    finally:
        manager.close()


def test_a_manager_restarted_from_its_log_has_the_run_it_had(tmp_path: Path) -> None:
    """Manager.restore reads the history back: the page and the histograms go on from where they were."""
    config = JobConfig(job_id="r", job_dir=str(tmp_path), nproc_per_node=2)
    first = Manager(config, EventLog(tmp_path / "events.db"))
    t = 50.0
    for step in range(1, 31):
        t += 0.25
        first.on_messages([StepCommitted(rank, 0, step, t, {"loss": 3.0 / step}) for rank in range(2)])
    before = first.history.view()
    first.events.flush()
    first.close()
    again = Manager(config, EventLog(tmp_path / "events.db"), restoring=True)
    try:
        again.restore()
        assert again.history.view() == before and before["step_times"]
        assert again.history.step_seconds.count == 29 and again.history.rank_step_seconds["1"].count == 29
    finally:
        again.close()


def test_a_log_that_cannot_be_read_back_leaves_the_history_empty_not_the_manager_stuck(tmp_path: Path) -> None:
    broken = tmp_path / "events.db"
    broken.write_bytes(b"not a database at all" * 100)
    history = RunHistory()
    history.replay(broken, 2)  # said once in the log; no exception
    assert history.view()["step_times"] == [] and history.step_seconds.count == 0
