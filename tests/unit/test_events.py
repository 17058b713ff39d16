"""The manager's SQLite event log, written and read back from a real file."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from undying.errors import UsageError
from undying.manager.events import SCHEMA_VERSION, EventLog, read_job
from undying.manager.state import Incident


@pytest.fixture
def log(tmp_path: Path) -> EventLog:
    events = EventLog(tmp_path / "events.db")
    yield events  # type: ignore[misc]
    with contextlib.suppress(sqlite3.ProgrammingError):  # the test closed it
        events.close()


def _incident(status: str = "open") -> Incident:
    inc = Incident(id=1, kind="crash", rank=2, step=12, fault_t=500.0, recovery=1, action="replace", status=status)
    inc.phases.update({"detected": 500.5, "first_step_done": 502.0})
    return inc


def test_readable_while_the_writer_is_open(log: EventLog) -> None:
    log.set_job("job_id", "job-1")
    log.set_job("world_size", 4)
    log.set_job("rerun_steps", [3, 4])
    log.rank(1, {"rank": 1, "step": 7, "state": "running"})
    log.rank(0, {"rank": 0, "step": 6, "state": "running"})
    log.step(0, 1, 0, 10.0, {"loss": 0.25})
    log.step(1, 1, 0, 10.5, {"loss": 0.25, "acc": 1.0})
    log.event("started", generation=0, world_size=4)
    log.flush()

    data = read_job(log.path)
    assert data["job"] == {"schema_version": SCHEMA_VERSION, "job_id": "job-1", "world_size": 4, "rerun_steps": [3, 4]}
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["ranks"][1] == {"rank": 1, "step": 7, "state": "running"}
    assert data["steps"] == [
        {"rank": 0, "step": 1, "generation": 0, "t": 10.0, "metrics": {"loss": 0.25}},
        {"rank": 1, "step": 1, "generation": 0, "t": 10.5, "metrics": {"loss": 0.25, "acc": 1.0}},
    ]
    assert data["incidents"] == []


def test_an_incident_is_stored_with_its_timeline(log: EventLog) -> None:
    log.incident(_incident())
    log.flush()
    (got,) = read_job(log.path)["incidents"]
    assert got["status"] == "open" and got["rank"] == 2 and got["step"] == 12
    assert got["phases"] == {"detected": 0.5, "first_step_done": 2.0}
    assert got["mttr_s"] == 2.0


def test_an_incident_is_updated_in_place(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.db")
    inc = _incident()
    log.incident(inc)
    inc.status = "recovered"
    log.incident(inc)
    log.close()
    (got,) = read_job(log.path)["incidents"]
    assert got["status"] == "recovered"


def test_incidents_are_visible_at_once(log: EventLog) -> None:
    log.flush()  # nothing pending, as after the manager's periodic flush
    inc = _incident()
    log.incident(inc)  # the module promises incidents are flushed at once
    assert [i["status"] for i in read_job(log.path)["incidents"]] == ["open"]
    inc.status = "failed"
    log.incident(inc)
    assert [i["status"] for i in read_job(log.path)["incidents"]] == ["failed"]


def test_a_flushed_job_key_is_visible_at_once(log: EventLog) -> None:
    log.set_job("state", "running", flush=True)
    assert read_job(log.path)["job"]["state"] == "running"
    log.set_job("state", "recovering", flush=True)
    assert read_job(log.path)["job"]["state"] == "recovering"


def test_step_commits_are_batched_until_a_flush(log: EventLog) -> None:
    log.flush()
    log.step(0, 1, 0, 1.0, {})
    assert read_job(log.path)["steps"] == []
    log.flush()
    assert len(read_job(log.path)["steps"]) == 1


def test_everything_is_kept_after_close(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    log = EventLog(path)
    log.set_job("state", "succeeded")
    log.step(0, 1, 0, 1.0, {"loss": 1.0})
    log.incident(_incident("recovered"))
    log.event("done", rank=0, digest="abc")
    log.close()
    data = read_job(path)
    assert data["job"]["state"] == "succeeded"
    assert len(data["steps"]) == 1 and data["incidents"][0]["status"] == "recovered"
    db = sqlite3.connect(path)
    try:
        assert db.execute("SELECT rank, kind, data FROM events").fetchall() == [(0, "done", '{"digest": "abc"}')]
    finally:
        db.close()


def test_reading_never_writes(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not an undying event log"):
        read_job(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()


@pytest.mark.parametrize("folder", ["exp#3", "run%201"])
def test_a_job_dir_with_uri_characters_is_readable(tmp_path: Path, folder: str) -> None:
    path = tmp_path / folder / "events.db"
    path.parent.mkdir()
    log = EventLog(path)
    log.set_job("job_id", "j", flush=True)
    try:
        assert read_job(path)["job"]["job_id"] == "j"
    finally:
        log.close()
