"""The manager's SQLite event log: every event, incident, commit and the job's state.

Written by the manager's loop thread only; read by ``undying status`` and the
demo, also after the job ended. WAL mode lets readers run beside the writer.
Commits of steps are frequent, so writes are grouped and flushed on a short
timer and at once for anything a person would look for (incidents, states).

This module (the writer) and ``log_reader`` (the readers, ``LogReader``) are
the only ones that speak SQL (``held_writes`` only replays the statements it
is handed). Everything else reads a log through ``LogReader`` and the typed
rows of ``log_rows``, and a restarted manager through ``EventLog.saved_job``,
so the schema can change here without a hunt for queries in the command
line, the demo, the oracle or the manager. ``LogReader`` and its helpers are
imported from here as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from undying.jobfiles.held_writes import HeldWrites
from undying.jobfiles.log_reader import (
    LogReader,
    commits,
    connect_readonly,
    job_facts,
    newest_steps,
    read_job,
    read_job_table,
)
from undying.jobfiles.log_rows import SavedJob, incident_from_row, rank_from_row
from undying.jobfiles.records import Incident
from undying.jobfiles.step_rows import pack

__all__ = [
    "SCHEMA_VERSION",
    "EventLog",
    "LogReader",
    "read_job",
    "read_job_table",
    "connect_readonly",
    "fold_wal",
]

# 2: commits kept per node and step (node_steps, see step_rows); a log of 1 (steps, per rank and
# step) is still read.
SCHEMA_VERSION = 2
log = logging.getLogger("undying.manager")
_SQLITE_HEADER = b"SQLite format 3\x00"
_INCIDENT_SQL = ("INSERT OR REPLACE INTO incidents "
                 "(id, kind, rank, step, action, status, fault_t, data) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?)")

_NODE_STEP_SQL = ("INSERT INTO node_steps (step, generation, t, ranks, names, data) "
                  "VALUES (?, ?, ?, ?, ?, ?)")

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
CREATE TABLE IF NOT EXISTS node_steps (
    step INTEGER NOT NULL, generation INTEGER NOT NULL, t REAL NOT NULL,
    ranks TEXT NOT NULL, names TEXT NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS node_steps_by_step ON node_steps (step);
CREATE TABLE IF NOT EXISTS ranks (rank INTEGER PRIMARY KEY, data TEXT NOT NULL);
"""



class EventLog:
    """The log. It also watches its own file: deleted, replaced or corrupt under a running job,
    it is noticed within a second (``CHECK_EVERY_S``), said in one error line, and a fresh log
    takes its place, carrying the job's facts, incidents and ranks over, so the job trains on and
    ``undying status`` still reads it."""

    CHECK_EVERY_S = 1.0

    def __init__(self, path: Path) -> None:
        self.path = path
        # The last value of every job fact, incident and rank row: what a fresh log starts from.
        self._facts: dict[str, str] = {}
        self._incidents: dict[int, tuple[Any, ...]] = {}
        self._ranks: dict[int, str] = {}
        self._hooks: list[Callable[[], None]] = []
        # The commits since the last flush: written then, one node_steps row per step (step_rows).
        self._commits: list[tuple[int, int, int, float, Mapping[str, float | str]]] = []
        self._open()
        self.set_job("schema_version", SCHEMA_VERSION)

    def _open(self) -> None:
        # Writes survive a full disk (held in memory, written when there is room): see held_writes.
        self._db = HeldWrites(sqlite3.connect(self.path, isolation_level=None,
                                              check_same_thread=False),
                              path=str(self.path))
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._db.execute("BEGIN")
        self._dirty = False
        # One descriptor kept open for the header check: closing any descriptor of the file would
        # drop every POSIX lock this process holds on it, SQLite's included (then another process's
        # reader may checkpoint and delete the WAL under us). It is closed only with the connection.
        self._probe = os.open(self.path, os.O_RDONLY)
        st = os.fstat(self._probe)
        self._identity = (st.st_dev, st.st_ino)
        self._next_check = time.monotonic() + self.CHECK_EVERY_S

    def _file_problem(self) -> str:
        """What happened to the log's file under us ("" when nothing did): cheap enough to ask
        every second."""
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
        """A fresh log in place of a lost or corrupt one: the old file (if any) set aside, never
        deleted."""
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
            self._db.execute("INSERT OR REPLACE INTO ranks (rank, data) VALUES (?, ?)",
                             (rank, data))
        self._db.execute("INSERT INTO events (t, generation, rank, kind, data) "
                         "VALUES (?, ?, ?, ?, ?)",
                         (time.time(), None, None, "event_log_replaced",
                          json.dumps({"problem": problem})))
        self._dirty = True
        log.error("the event log %s %s while the job ran: a fresh log is written there from now on "
                  "(the job trains on; the job's facts, incidents and ranks were carried over, "
                  "earlier events and steps were in the lost file)", self.path, problem)

    @property
    def db(self) -> HeldWrites:
        """The connection, for a test that kills a manager by closing its log under it; nothing
        may run SQL on it (the manager reads through ``saved_job`` and renumbers through
        ``forget_ranks``)."""
        return self._db

    def saved_job(self) -> SavedJob:
        """Everything a restarted manager needs from the log, read on this (the loop's)
        connection."""
        self._write_commits()  # (what is not flushed yet too)
        newest: dict[int, int] = {}
        for rank, step in newest_steps(self._db):
            newest[rank] = max(step, newest.get(rank, step))
        return SavedJob(
            facts=job_facts(self._db),
            ranks=[rank_from_row(json.loads(d))
                   for (d,) in self._db.execute("SELECT data FROM ranks ORDER BY rank")],
            newest_steps=newest,
            incidents=[incident_from_row(json.loads(d))
                       for (d,) in self._db.execute("SELECT data FROM incidents ORDER BY id")],
            commits=((c.rank, c.step, c.t) for c in commits(self._db)),
            reports=[(str(k), float(t), json.loads(d)) for k, t, d in self._db.execute(
                "SELECT kind, t, data FROM events "
                "WHERE kind IN ('steps_planned', 'checkpoint_saved') ORDER BY id")],
        )

    def forget_ranks(self, first: int) -> None:
        """Drop the rows of ranks ``first`` and up: the job was renumbered onto fewer ranks.

        Also from what a fresh log would carry over (``_replace``), or a lost
        log would bring the departed ranks back.
        """
        for rank in [r for r in self._ranks if r >= first]:
            del self._ranks[rank]
        self._exec("DELETE FROM ranks WHERE rank >= ?", (first,))
        self._dirty = True

    def event(self, name: str, /, *, generation: int | None = None, rank: int | None = None,
              **data: Any) -> None:
        self._exec(
            "INSERT INTO events (t, generation, rank, kind, data) VALUES (?, ?, ?, ?, ?)",
            (time.time(), generation, rank, name, json.dumps(data, default=str)),
        )
        self._dirty = True

    def step(self, rank: int, step: int, generation: int, t: float,
             metrics: Mapping[str, float | str]) -> None:
        self.steps([(rank, step, generation, t, metrics)])

    def steps(self, rows: Sequence[tuple[int, int, int, float, Mapping[str, float | str]]]) -> None:
        """Commits (rank, step, generation, t, metrics): kept until the next flush, which writes
        the commits of each step among them as one ``node_steps`` row (``step_rows.pack``), so
        a step costs a row a flush, however many ranks (and whichever way they came)."""
        self._commits.extend(rows)
        self._dirty = True

    def _write_commits(self) -> None:
        if self._commits:
            commits, self._commits = self._commits, []
            self._exec_many(_NODE_STEP_SQL, pack(commits))

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

    def job_fact(self, key: str) -> Any:
        """The fact ``key`` as this log last set it (None: never set by this process)."""
        text = self._facts.get(key)
        return None if text is None else json.loads(text)

    def set_job(self, key: str, value: Any, *, flush: bool = False) -> None:
        self._facts[key] = text = json.dumps(value, default=str)
        self._exec("INSERT OR REPLACE INTO job (key, value) VALUES (?, ?)", (key, text))
        self._dirty = True
        if flush:
            self.flush()

    def changed(self) -> None:
        """Something a ``before_flush`` hook writes is pending: the next flush commits, and runs
        the hooks."""
        self._dirty = True

    def before_flush(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` in each transaction before it commits (what it writes commits with the
        rest)."""
        self._hooks.append(hook)

    def _exec(self, sql: str, params: Any = ()) -> None:
        try:
            self._db.execute(sql, params)
        except sqlite3.DatabaseError as e:
            # Corrupt under us (a full disk is held inside HeldWrites, not raised).
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
            self._write_commits()
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


def fold_wal(path: Path) -> None:
    """Fold a log's write-ahead file into the log itself, where SQLite can (else leave both as
    they are).

    A launcher killed mid-run leaves events in ``events.db-wal`` that are in
    no other file; before the log is set aside (``JobDir.archive_log``) they
    are written into it, so the archived log reads whole on its own.
    """
    with contextlib.suppress(sqlite3.Error):
        uri = f"file:{urllib.parse.quote(str(path.absolute()))}?mode=rw"  # never creates
        db = sqlite3.connect(uri, uri=True)
        try:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            db.close()
