"""Prometheus metrics and the status page route, read back the way a scraper reads them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from undying.config import JobConfig
from undying.jobfiles.events import EventLog
from undying.jobfiles.records import Incident, RankState
from undying.manager.http.server import build_app
from undying.manager.manager import Manager
from undying.manager.views import exposition, new_registry


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def incident(id: int, kind: str, action: str, mttr: float | None, status: str = "recovered") -> dict[str, Any]:
    return {"id": id, "kind": kind, "rank": 1, "step": 5, "action": action, "status": status, "mttr_s": mttr,
            "phases": {"detected": 0.01} if mttr is None else {"detected": 0.01, "first_step_done": mttr}}


STATUS: dict[str, Any] = {
    "job_id": "j1",
    "state": "running",
    "generation": 3,
    "world_size": 4,
    "step": 120,
    "rerun_steps": [40, 77],
    "spares_ready": 1,
    "checkpoints": {"restarts": 0},
    "ranks": [
        {"rank": 0, "node": 0, "pid": 11, "state": "running", "step": 120, "restarts": 0},
        {"rank": 1, "node": 0, "pid": 12, "state": "recovering", "step": 119, "restarts": 2},
        {"rank": 2, "node": 1, "pid": 0, "state": "starting", "step": 0, "restarts": 0},  # not spawned yet
        {"rank": 3, "node": 1, "pid": 14, "state": "exited", "step": 118, "restarts": 0},
    ],
    "incidents": [
        incident(1, "crash", "replace", 0.8),
        incident(2, "crash", "replace", 3.5),
        incident(3, "comm-error", "retry", 0.2),
        incident(4, "hang", "replace", None, status="open"),
    ],
    "trace": {"step": True, "comm": False, "by": "cli", "t": 1.0},
    "step_times": [[118, 0.05], [119, 0.06], [120, 0.07]],
}


def test_exposition_of_a_status() -> None:
    text = exposition(new_registry(lambda: STATUS)).decode()
    got = samples(text)
    assert got[("undying_step", ())] == 120
    # (undying_step_seconds is a histogram of every step now: the last one's time is its own gauge)
    assert got[("undying_last_step_seconds", ())] == pytest.approx(0.07)
    assert got[("undying_generation", ())] == 3
    assert got[("undying_world_size", ())] == 4
    assert got[("undying_ranks_alive", ())] == 2  # running + recovering; starting without a PID is not alive
    assert got[("undying_job_state", (("state", "running"),))] == 1
    assert got[("undying_job_state", (("state", "failed"),))] == 0
    assert got[("undying_rerun_steps_total", ())] == 2
    assert got[("undying_rank_restarts_total", (("rank", "1"),))] == 2
    # By kind (every kind from 0), and by kind and the action decided (undying_incidents_total had both labels;
    # an action is only known once decided, so a kind's 0 before its first incident needs a family of its own).
    assert got[("undying_incidents_total", (("kind", "crash"),))] == 2
    assert got[("undying_incidents_total", (("kind", "comm-error"),))] == 1
    assert got[("undying_incidents_total", (("kind", "hang"),))] == 1
    assert got[("undying_incidents_total", (("kind", "node-loss"),))] == 0
    assert got[("undying_incident_actions_total", (("action", "replace"), ("kind", "crash")))] == 2
    assert got[("undying_incident_actions_total", (("action", "retry"), ("kind", "comm-error")))] == 1
    assert got[("undying_incident_actions_total", (("action", "replace"), ("kind", "hang")))] == 1
    assert got[("undying_incidents_open", ())] == 1
    assert got[("undying_trace_enabled", (("markers", "step"),))] == 1
    assert got[("undying_trace_enabled", (("markers", "comm"),))] == 0
    assert got[("undying_trace_switch_error", ())] == 0
    # The histogram holds the three finished recoveries (the open one has no MTTR yet), cumulatively.
    assert got[("undying_recovery_seconds_count", ())] == 3
    assert got[("undying_recovery_seconds_sum", ())] == pytest.approx(4.5)
    assert got[("undying_recovery_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[("undying_recovery_seconds_bucket", (("le", "1.0"),))] == 2
    assert got[("undying_recovery_seconds_bucket", (("le", "5.0"),))] == 3
    assert got[("undying_recovery_seconds_bucket", (("le", "+Inf"),))] == 3
    kinds = families(text)
    assert kinds["undying_incidents"] == "counter"
    assert kinds["undying_recovery_seconds"] == "histogram"
    assert kinds["undying_step"] == "gauge"  # a whole-job restart moves it back: not a counter


def test_a_status_without_the_newer_keys_still_exposes_everything_else() -> None:
    old = {k: v for k, v in STATUS.items() if k not in ("trace", "step_times")}
    got = samples(exposition(new_registry(lambda: old)).decode())
    assert ("undying_step_seconds", ()) not in got  # no step time measured: no made-up zero
    assert ("undying_last_step_seconds", ()) not in got and ("undying_step_seconds_count", ()) not in got
    assert got[("undying_trace_enabled", (("markers", "step"),))] == 0
    assert got[("undying_step", ())] == 120


def test_a_malformed_switch_file_shows() -> None:
    broken = dict(STATUS, trace={"step": True, "comm": False, "by": "file", "t": 2.0, "error": "not JSON"})
    got = samples(exposition(new_registry(lambda: broken)).decode())
    assert got[("undying_trace_switch_error", ())] == 1
    assert got[("undying_trace_enabled", (("markers", "step"),))] == 1  # the last good setting holds


def test_each_registry_is_its_own() -> None:
    """Two managers in one process expose their own numbers (no global registry)."""
    other = dict(STATUS, step=7, job_id="j2")
    a = samples(exposition(new_registry(lambda: STATUS)).decode())
    b = samples(exposition(new_registry(lambda: other)).decode())
    assert a[("undying_step", ())] == 120 and b[("undying_step", ())] == 7
    assert ("undying_job_info", (("job_id", "j2"),)) in b


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[Manager]:
    m = Manager(JobConfig(job_id="real", job_dir=str(tmp_path), nproc_per_node=2), EventLog(tmp_path / "events.db"))
    yield m
    m.close()


def test_metrics_of_a_real_manager(manager: Manager) -> None:
    """The collector reads the keys Manager.status() really has."""
    t = time.time()
    manager.ranks[0].pid, manager.ranks[0].state, manager.ranks[0].step = 100, RankState.RUNNING, 9
    manager.ranks[1].pid, manager.ranks[1].state, manager.ranks[1].step = 101, RankState.RUNNING, 9
    done = Incident(id=1, kind="crash", rank=1, step=6, fault_t=t, recovery=1, action="replace", status="recovered",
                    phases={"detected": t + 0.01, "first_step_done": t + 1.5})
    manager.incidents.append(done)
    manager.incidents.append(Incident(id=2, kind="comm-error", rank=0, step=8, fault_t=t, recovery=2, action="retry"))
    got = samples(exposition(new_registry(manager.status)).decode())
    assert got[("undying_step", ())] == 9
    assert got[("undying_ranks_alive", ())] == 2
    assert got[("undying_job_info", (("job_id", "real"),))] == 1
    assert got[("undying_incidents_total", (("kind", "crash"),))] == 1
    assert got[("undying_incidents_total", (("kind", "comm-error"),))] == 1
    assert got[("undying_incident_actions_total", (("action", "replace"), ("kind", "crash")))] == 1
    assert got[("undying_incident_actions_total", (("action", "retry"), ("kind", "comm-error")))] == 1
    assert got[("undying_recovery_seconds_count", ())] == 1
    assert got[("undying_recovery_seconds_sum", ())] == pytest.approx(1.5)
    assert got[("undying_job_state", (("state", manager.state.value),))] == 1


def test_routes(manager: Manager) -> None:
    """/ is the self-contained page, /metrics the exposition, and the JSON API is unchanged."""

    async def fetch() -> dict[str, Any]:
        async with TestClient(TestServer(build_app(manager, token="t" * 32)), headers={"Authorization": "Bearer " + "t" * 32}) as client:
            page = await client.get("/")
            metrics = await client.get("/metrics")
            status = await client.get("/api/status")
            ranks = await client.get("/api/ranks")
            return {
                "page": (page.status, page.headers["Content-Type"], await page.text()),
                "metrics": (metrics.status, metrics.headers["Content-Type"], await metrics.text()),
                "status": (status.status, await status.json()),
                "ranks": (ranks.status, await ranks.json()),
            }

    got = asyncio.run(fetch())
    status, content_type, html = got["page"]
    assert status == 200 and content_type.startswith("text/html")
    assert "api/status" in html and "<script" in html
    # Offline: nothing is loaded from anywhere else.
    for external in ("http://", "https://", "src=", "@import", "url("):
        assert external not in html.replace("http://www.w3.org/2000/svg", ""), external
    assert all(href.startswith('"data:') for href in html.split("href=")[1:])
    assert ".innerHTML" not in html
    status, content_type, text = got["metrics"]
    assert status == 200 and content_type.startswith("text/plain")
    assert samples(text)[("undying_world_size", ())] == 2
    assert got["status"][0] == 200 and got["status"][1]["job_id"] == "real"
    assert got["ranks"][0] == 200 and [r["rank"] for r in got["ranks"][1]] == [0, 1]
