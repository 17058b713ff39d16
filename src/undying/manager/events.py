"""The manager's SQLite event log: every event, incident, commit and the job's state.

Written by the manager's loop thread only; read by ``undying status`` and the
demo, also after the job ended. WAL mode lets readers run beside the writer.
Commits of steps are frequent, so writes are grouped and flushed on a short
timer and at once for anything a person would look for (incidents, states).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from undying.errors import UsageError
from undying.manager.held_writes import HeldWrites
from undying.manager.state import Incident

__all__ = ["EventLog", "SavedJob", "read_job", "read_job_table", "connect_readonly", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
log = logging.getLogger("undying.manager")
_SQLITE_HEADER = b"SQLite format 3\x00"
_INCIDENT_SQL = ("INSERT OR REPLACE INTO incidents (id, kind, rank, step, action, status, fault_t, data) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?)")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS job (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, generation INTEGER,
    rank INTEGER, kind TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY, kind TEXT NOT NULL, rank INTEGER, step INTEGER,
    action TEXT, status TEXT, fault_t REAL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps (
    rank INTEGER NOT NULL, step INTEGER NOT NULL, generation INTEGER NOT NULL,
    t REAL NOT NULL, metrics TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS steps_by_step ON steps (step, rank);
CREATE TABLE IF NOT EXISTS ranks (rank INTEGER PRIMARY KEY, data TEXT NOT NULL);
"""


@dataclass
class SavedJob:
    """What a restarted manager reads back: the job's facts, rank rows, committed steps and incidents."""

    job: dict[str, Any]
    ranks: list[dict[str, Any]]
    steps: list[tuple[int, int]]  # (rank, step) of every commit
    incidents: list[Incident]


class EventLog:
    """The log. It also watches its own file: deleted, replaced or corrupt under a running job, it is noticed
    within a second (``CHECK_EVERY_S``), said in one error line, and a fresh log takes its place, carrying the
    job's facts, incidents and ranks over, so the job trains on and ``undying status`` still reads it."""

    CHECK_EVERY_S = 1.0

    def __init__(self, path: Path) -> None:
        self.path = path
        # The last value of every job fact, incident and rank row: what a fresh log starts from.
        self._facts: dict[str, str] = {}
        self._incidents: dict[int, tuple[Any, ...]] = {}
        self._ranks: dict[int, str] = {}
        self._hooks: list[Callable[[], None]] = []
        self._open()
        self.set_job("schema_version", SCHEMA_VERSION)

    def _open(self) -> None:
        # Writes survive a full disk (held in memory, written when there is room): see held_writes.
        self._db = HeldWrites(sqlite3.connect(self.path, isolation_level=None, check_same_thread=False),
                              path=str(self.path))
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._db.execute("BEGIN")
        self._dirty = False
        # One descriptor kept open for the header check: closing any descriptor of the file would drop
        # every POSIX lock this process holds on it, SQLite's included (then another process's reader
        # may checkpoint and delete the WAL under us). It is closed only with the connection.
        self._probe = os.open(self.path, os.O_RDONLY)
        st = os.fstat(self._probe)
        self._identity = (st.st_dev, st.st_ino)
        self._next_check = time.monotonic() + self.CHECK_EVERY_S

    def _file_problem(self) -> str:
        """What happened to the log's file under us ("" when nothing did): cheap enough to ask every second."""
        try:
            st = os.stat(self.path)  # a stat opens nothing
            header = os.pread(self._probe, 16, 0)
        except FileNotFoundError:
            return "was deleted"
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if (st.st_dev, st.st_ino) != self._identity:
            return "was replaced by another file"
        if header != _SQLITE_HEADER:
            return "is corrupt (its header is not SQLite's)"
        return ""

    def _replace(self, problem: str) -> None:
        """A fresh log in place of a lost or corrupt one: the old file (if any) set aside, never deleted."""
        with contextlib.suppress(sqlite3.Error, OSError):
            self._db.raw.close()
        with contextlib.suppress(OSError):
            os.close(self._probe)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for suffix in ("", "-wal", "-shm"):  # a stale WAL must not be replayed into the fresh file
            part = Path(str(self.path) + suffix)
            if part.exists():
                os.replace(part, Path(f"{self.path.with_suffix('')}.lost-{stamp}.db{suffix}"))
        self._open()
        for key, value in self._facts.items():
            self._db.execute("INSERT OR REPLACE INTO job (key, value) VALUES (?, ?)", (key, value))
        for row in self._incidents.values():
            self._db.execute(_INCIDENT_SQL, row)
        for rank, data in self._ranks.items():
            self._db.execute("INSERT OR REPLACE INTO ranks (rank, data) VALUES (?, ?)", (rank, data))
        self._db.execute("INSERT INTO events (t, generation, rank, kind, data) VALUES (?, ?, ?, ?, ?)",
                         (time.time(), None, None, "event_log_replaced", json.dumps({"problem": problem})))
        self._dirty = True
        log.error("the event log %s %s while the job ran: a fresh log is written there from now on (the job "
                  "trains on; the job's facts, incidents and ranks were carried over, earlier events and steps "
                  "were in the lost file)", self.path, problem)

    @property
    def db(self) -> HeldWrites:
        """The connection, for a restarted manager to read the job back (on the loop thread only)."""
        return self._db

    def load(self) -> SavedJob:
        """The job as the log holds it, for a manager that carries on a job whose manager died."""
        db = self._db
        return SavedJob(
            job={k: json.loads(v) for k, v in db.execute("SELECT key, value FROM job")},
            ranks=[json.loads(data) for (data,) in db.execute("SELECT data FROM ranks")],
            steps=[(int(rank), int(step)) for rank, step in db.execute("SELECT rank, step FROM steps")],
            incidents=[Incident.from_dict(json.loads(data))
                       for (data,) in db.execute("SELECT data FROM incidents ORDER BY id")],
        )

    def forget_ranks_from(self, rank: int) -> None:
        """The layout shrank: the rows of ranks ``rank`` and above are gone with it."""
        self._exec("DELETE FROM ranks WHERE rank >= ?", (rank,))
        for gone in [r for r in self._ranks if r >= rank]:
            del self._ranks[gone]
        self._dirty = True

    def event(self, name: str, /, *, generation: int | None = None, rank: int | None = None, **data: Any) -> None:
        self._exec(
            "INSERT INTO events (t, generation, rank, kind, data) VALUES (?, ?, ?, ?, ?)",
            (time.time(), generation, rank, name, json.dumps(data, default=str)),
        )
        self._dirty = True

    def step(self, rank: int, step: int, generation: int, t: float, metrics: dict[str, float]) -> None:
        self._exec(
            "INSERT INTO steps (rank, step, generation, t, metrics) VALUES (?, ?, ?, ?, ?)",
            (rank, step, generation, t, json.dumps(metrics)),
        )
        self._dirty = True

    def steps(self, rows: list[tuple[int, int, int, float, dict[str, float]]]) -> None:
        """Several commits' rows (rank, step, generation, t, metrics) in one statement."""
        self._exec_many(
            "INSERT INTO steps (rank, step, generation, t, metrics) VALUES (?, ?, ?, ?, ?)",
            [(rank, step, generation, t, json.dumps(metrics)) for rank, step, generation, t, metrics in rows],
        )
        self._dirty = True

    def incident(self, incident: Incident) -> None:
        row = (incident.id, incident.kind, incident.rank, incident.step, incident.action,
               incident.status, incident.fault_t, json.dumps(incident.to_dict(), default=str))
        self._incidents[incident.id] = row
        self._exec(_INCIDENT_SQL, row)
        self._dirty = True
        self.flush()

    def rank(self, rank: int, data: dict[str, Any]) -> None:
        self._ranks[rank] = text = json.dumps(data)
        self._exec("INSERT OR REPLACE INTO ranks (rank, data) VALUES (?, ?)", (rank, text))
        self._dirty = True

    def set_job(self, key: str, value: Any, *, flush: bool = False) -> None:
        self._facts[key] = text = json.dumps(value, default=str)
        self._exec("INSERT OR REPLACE INTO job (key, value) VALUES (?, ?)", (key, text))
        self._dirty = True
        if flush:
            self.flush()

    def changed(self) -> None:
        """Something a ``before_flush`` hook writes is pending: the next flush commits, and runs the hooks."""
        self._dirty = True

    def before_flush(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` in each transaction before it commits (what it writes commits with the rest)."""
        self._hooks.append(hook)

    def _exec(self, sql: str, params: Any = ()) -> None:
        try:
            self._db.execute(sql, params)
        except sqlite3.DatabaseError as e:  # corrupt under us (a full disk is held inside HeldWrites, not raised)
            self._replace(f"is corrupt ({e})")
            self._db.execute(sql, params)

    def _exec_many(self, sql: str, rows: list[Any]) -> None:
        try:
            self._db.executemany(sql, rows)
        except sqlite3.DatabaseError as e:
            self._replace(f"is corrupt ({e})")
            self._db.executemany(sql, rows)

    def flush(self) -> None:
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + self.CHECK_EVERY_S
            problem = self._file_problem()
            if problem:
                self._replace(problem)
        if self._dirty:
            for hook in self._hooks:
                hook()
            try:
                self._db.execute("COMMIT")
            except sqlite3.DatabaseError as e:  # corrupt under us (a full disk is held, not raised)
                self._replace(f"is corrupt ({e})")
                self._db.execute("COMMIT")
            self._db.execute("BEGIN")
            self._dirty = False

    def close(self) -> None:
        self.flush()
        self._db.execute("COMMIT")
        self._db.close()
        with contextlib.suppress(OSError):
            os.close(self._probe)


def connect_readonly(path: Path) -> sqlite3.Connection:
    """Open an event log for reading only; never creates a file."""
    if not path.is_file():
        raise UsageError(f"{path} is not an undying event log; pass the --job-dir of a job")
    return sqlite3.connect(f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro", uri=True)


def read_job_table(path: Path) -> dict[str, Any]:
    """The job's key/value facts only (state, ids, generation): cheap however long the job ran."""
    db = connect_readonly(path)
    try:
        return {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM job")}
    finally:
        db.close()


def read_job(path: Path) -> dict[str, Any]:
    """Everything ``undying status`` shows, read from the log of a job (running or not)."""
    db = connect_readonly(path)
    try:
        job = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM job")}
        ranks = [json.loads(d) for (d,) in db.execute("SELECT data FROM ranks ORDER BY rank")]
        incidents = [json.loads(d) for (d,) in db.execute("SELECT data FROM incidents ORDER BY id")]
        steps = [
            {"rank": r, "step": s, "generation": g, "t": t, "metrics": json.loads(m)}
            for r, s, g, t, m in db.execute(
                "SELECT rank, step, generation, t, metrics FROM steps ORDER BY t"
            )
        ]
    finally:
        db.close()
    return {"job": job, "ranks": ranks, "incidents": incidents, "steps": steps}
