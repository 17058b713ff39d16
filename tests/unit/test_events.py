"""The manager's SQLite event log, written and read back from a real file."""

from __future__ import annotations

import contextlib
import math
import sqlite3
from pathlib import Path

import pytest

from undying.errors import UsageError
from undying.jobfiles.events import SCHEMA_VERSION, EventLog, LogReader, fold_wal, read_job
from undying.jobfiles.log_rows import Commit
from undying.jobfiles.records import Incident, RankInfo, RankState


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


# --- the typed read API: every reader outside this module goes through it ----------------------

def _a_small_job(log: EventLog) -> None:
    log.set_job("job_id", "job-1")
    log.set_job("started_at", 100.0)
    for rank in (0, 1, 2, 3):  # as the manager writes them
        log.rank(rank, RankInfo(rank=rank, node=rank // 2, pid=1000 + rank, state=RankState.RUNNING, step=0,
                                generation=1, restarts=rank % 2, last_seen=50.0 + rank, incarnation=7).to_dict())
    log.step(1, 1, 0, 11.0, {"loss": 0.5})
    log.step(0, 1, 0, 10.0, {"loss": 0.5})
    log.steps([(0, 2, 0, 12.0, {"loss": 0.25}), (1, 2, 0, 12.5, {"loss": 0.25}), (1, 2, 1, 14.0, {"loss": 0.25})])
    log.event("done", rank=0, step=2, digest="aa")
    log.event("checkpoint_saved", rank=0, step=2, bytes=10, write_s=0.5)
    log.event("done", rank=1, step=2, digest="bb")
    log.incident(_incident())
    log.flush()


def test_log_reader_answers_with_typed_rows(log: EventLog) -> None:
    _a_small_job(log)
    with LogReader(log.path) as reader:
        assert reader.job()["started_at"] == 100.0 and reader.job()["job_id"] == "job-1"
        assert [c.step for c in reader.commits()] == [1, 1, 2, 2, 2]  # in time order
        assert reader.commits()[0] == Commit(rank=0, step=1, generation=0, t=10.0, metrics={"loss": 0.5})
        assert reader.first_commit_times() == {0: 10.0, 1: 11.0}
        done = reader.events("done")
        assert [(e.rank, e.data["digest"]) for e in done] == [(0, "aa"), (1, "bb")]
        assert done[0].kind == "done" and done[0].id < done[1].id and done[0].data["step"] == 2
        assert reader.events("nothing_like_this") == []
        assert reader.count_events() == 3
        assert [r["rank"] for r in reader.ranks()] == [0, 1, 2, 3]
        assert [i["id"] for i in reader.incidents()] == [1]
        commits = reader.commits()
    assert read_job(log.path)["steps"] == [c.to_dict() for c in commits]  # the dict view is the same rows


def test_log_reader_refuses_what_is_no_log(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not an undying event log"):
        LogReader(tmp_path / "missing.db")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    with LogReader(junk) as reader, pytest.raises(LogReader.Error):
        reader.job()


def test_a_restarted_manager_reads_back_what_it_needs(log: EventLog) -> None:
    _a_small_job(log)
    saved = log.saved_job()  # on the writer's own connection: also what is not flushed yet
    log.step(3, 1, 1, 20.0, {"loss": 0.5})
    again = log.saved_job()
    assert saved.facts["job_id"] == "job-1" and saved.facts["schema_version"] == SCHEMA_VERSION
    assert saved.newest_steps == {0: 2, 1: 2}  # the newest step of each rank, not every step
    assert again.newest_steps[3] == 1
    assert [(rank, step) for rank, step, _ in again.commits] == [(0, 1), (1, 1), (0, 2), (1, 2), (1, 2), (3, 1)]
    # What was written comes back as the manager's own types, equal field for field.
    assert saved.ranks == [RankInfo(rank=r, node=r // 2, pid=1000 + r, state=RankState.RUNNING, step=0, generation=1,
                                    restarts=r % 2, last_seen=50.0 + r, incarnation=7) for r in (0, 1, 2, 3)]
    assert saved.incidents == [_incident()]  # its phases absolute again


def test_forgotten_ranks_stay_forgotten_also_in_a_fresh_log(log: EventLog) -> None:
    _a_small_job(log)
    log.forget_ranks(2)
    log.flush()
    assert [r["rank"] for r in read_job(log.path)["ranks"]] == [0, 1]
    assert [r.rank for r in log.saved_job().ranks] == [0, 1]
    # The file is lost under the running job: the fresh log carries the job's ranks over, not the forgotten ones.
    log.path.unlink()
    log._next_check = 0.0
    log.flush()
    assert [r["rank"] for r in read_job(log.path)["ranks"]] == [0, 1]


def test_fold_wal_puts_a_killed_writers_wal_into_the_log(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.db")
    _a_small_job(log)
    killed = tmp_path / "killed"  # the files as a launcher killed mid-run leaves them: the log and its WAL
    killed.mkdir()
    for suffix in ("", "-wal"):
        (killed / f"events.db{suffix}").write_bytes(Path(f"{log.path}{suffix}").read_bytes())
    log.close()

    def digests_in_the_main_file_alone() -> list[str]:
        alone = tmp_path / "alone.db"
        alone.write_bytes((killed / "events.db").read_bytes())
        try:
            with LogReader(alone) as reader:
                return [e.data["digest"] for e in reader.events("done")]
        except LogReader.Error:  # not even the tables: they are in the WAL too
            return []
        finally:
            alone.unlink()

    assert digests_in_the_main_file_alone() == []
    fold_wal(killed / "events.db")
    assert digests_in_the_main_file_alone() == ["aa", "bb"]
    fold_wal(tmp_path / "nothing-here.db")  # no log: nothing to fold, no error, no file made
    assert not (tmp_path / "nothing-here.db").exists()


def test_a_commits_metrics_read_back_as_written_nan_and_infinity_included(tmp_path: Path) -> None:
    """The steps table's metrics take a fast writer that would turn NaN into null: a NaN loss must stay NaN."""
    log = EventLog(tmp_path / "events.db")
    written = [{"loss": 0.30000000000000004, "lr": 1e-300}, {"loss": math.nan}, {"loss": math.inf, "gnorm": -math.inf}]
    log.steps([(0, step, 0, float(step), metrics) for step, metrics in enumerate(written, start=1)])
    log.step(1, 1, 0, 1.5, {"loss": math.nan})
    log.flush()
    with LogReader(tmp_path / "events.db") as reader:
        read = [c.metrics for c in sorted(reader.commits(), key=lambda c: (c.rank, c.step))]
    log.close()
    assert read[0] == written[0]
    assert math.isnan(read[1]["loss"]) and math.isnan(read[3]["loss"])
    assert read[2] == {"loss": math.inf, "gnorm": -math.inf}
