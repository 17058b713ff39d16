"""The event log read: ``LogReader`` (typed queries, the job running or not) and the commits of
both schemas.

With ``events`` (the writer) the only module that speaks SQL: the command
line, the demo, the oracle and the manager's views read a log through
``LogReader`` and the typed rows of ``log_rows``. Readers run beside the
writer (WAL) and see what it last committed. The commits come from the
``node_steps`` table (schema 2, ``step_rows``) and, in a log written before,
from ``steps`` (a row per rank and step); a table a log does not have reads as
empty, so either schema's log reads the same.
"""

from __future__ import annotations

import json
import sqlite3
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

from undying.errors import UsageError
from undying.jobfiles.held_writes import HeldWrites
from undying.jobfiles.log_rows import Commit, LoggedEvent
from undying.jobfiles.step_rows import NodeStepRow, in_time_order, ranks_of, unpack

__all__ = ["LogReader", "read_job", "read_job_table", "connect_readonly", "commits", "newest_steps",
           "job_facts"]

_NODE_STEP_COLUMNS = "step, generation, t, ranks, names, data"


def connect_readonly(path: Path) -> sqlite3.Connection:
    """Open an event log for reading only; never creates a file."""
    if not path.is_file():
        raise UsageError(f"{path} is not an undying event log; pass the --job-dir of a job")
    return sqlite3.connect(f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro", uri=True)


def job_facts(db: sqlite3.Connection | HeldWrites) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM job")}


class LogReader:
    """A job's event log opened read-only (the job running or not), with typed queries.

    Use as a context manager; each method is one query. Readers run beside
    the writer (WAL) and see what it last committed. A file that is no event
    log (or a damaged one) raises ``LogReader.Error`` from the first query.
    """

    Error: ClassVar[type[Exception]] = sqlite3.Error

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = connect_readonly(path)

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def job(self) -> dict[str, Any]:
        """The job's key/value facts (state, ids, generation, ...): cheap however long the job
        ran."""
        return job_facts(self._db)

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank's last row (``RankInfo.to_dict``), by rank."""
        return [json.loads(d) for (d,) in self._db.execute("SELECT data FROM ranks ORDER BY rank")]

    def incidents(self) -> list[dict[str, Any]]:
        """Each incident's last row (``Incident.to_dict``), oldest first."""
        return [json.loads(d)
                for (d,) in self._db.execute("SELECT data FROM incidents ORDER BY id")]

    def commits(self) -> list[Commit]:
        """Every logged commit, in time order (``iter_commits`` reads them one by one)."""
        return list(commits(self._db))

    def iter_commits(self) -> Iterator[Commit]:
        """Every logged commit, in time order, read as they are taken: memory bounded however
        long the job ran."""
        return commits(self._db)

    def commit_times(self) -> list[tuple[int, int, float]]:
        """Every logged commit as (rank, step, time), in time order: the commits without their
        values."""
        return [(c.rank, c.step, c.t) for c in commits(self._db)]

    def newest_step(self) -> int:
        """The newest step any rank committed (0 for none)."""
        newest = 0
        for table in ("steps", "node_steps"):
            for (step,) in _select(self._db, table, f"MAX(step) FROM {table}"):
                newest = max(newest, int(step or 0))
        return newest

    def newest_steps(self) -> dict[int, int]:
        """The newest step each rank committed, by rank (a bounded read however long the job
        ran)."""
        newest: dict[int, int] = {}
        for rank, step in newest_steps(self._db):
            newest[rank] = max(step, newest.get(rank, step))
        return newest

    def commits_of_step(self, step: int) -> list[Commit]:
        """The commits of one step (each rank's, and again for a step re-run), in time order."""
        return list(commits(self._db, "WHERE step = ?", (step,)))

    def commits_since(self, step: int) -> list[Commit]:
        """The commits of steps ``step`` and later (re-runs included), in time order: the newest
        steps of a long job without reading the rest."""
        return list(commits(self._db, "WHERE step >= ?", (step,)))

    def first_commit_times(self) -> dict[int, float]:
        """When each rank first committed a step (unix seconds), by rank."""
        firsts: dict[int, float] = {}
        rows = _select(self._db, "steps", "rank, MIN(t) FROM steps GROUP BY rank")
        found = [(int(r), float(t)) for r, t in rows]
        # the earliest row of each set of ranks holds each of its ranks' first commit
        for row in _select(self._db, "node_steps",
                           f"{_NODE_STEP_COLUMNS}, MIN(t) FROM node_steps GROUP BY ranks"):
            found.extend((c.rank, c.t) for c in unpack(row[:6]))
        for rank, t in found:
            firsts[rank] = min(t, firsts.get(rank, t))
        return firsts

    def events(self, kind: str) -> list[LoggedEvent]:
        """The events of one kind (``done``, ``checkpoint_saved``, ...), oldest first."""
        rows = self._db.execute(
            "SELECT id, t, generation, rank, kind, data FROM events WHERE kind = ? ORDER BY id",
            (kind,))
        return [LoggedEvent(int(i), float(t), g, r, k, json.loads(d))
                for i, t, g, r, k, d in rows]

    def newest_event_t(self) -> float | None:
        """When the newest event was logged (unix seconds); None for a log with none."""
        (t,) = self._db.execute("SELECT MAX(t) FROM events").fetchone()
        return None if t is None else float(t)

    def count_events(self) -> int:
        """How many events the log holds (of every kind)."""
        (n,) = self._db.execute("SELECT COUNT(*) FROM events").fetchone()
        return int(n)


def commits(db: sqlite3.Connection | HeldWrites, where: str = "",
             params: Sequence[Any] = ()) -> Iterator[Commit]:
    """The commits of both tables (a log of schema 1 has the per-rank one), in time order."""
    old = (Commit(int(r), int(s), int(g), float(t), json.loads(m)) for r, s, g, t, m in
           _select(db, "steps", f"rank, step, generation, t, metrics FROM steps {where} ORDER BY t",
                   params))
    rows: Iterator[NodeStepRow] = _select(
        db, "node_steps", f"{_NODE_STEP_COLUMNS} FROM node_steps {where} ORDER BY t", params)
    return in_time_order(old, rows)


def _select(db: sqlite3.Connection | HeldWrites, table: str, query: str,
            params: Sequence[Any] = ()) -> Iterator[Any]:
    """``SELECT query``'s rows; none where ``table`` is not in the log (a reader of a log of an
    older or newer schema)."""
    found = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                       (table,)).fetchone()
    return iter(db.execute(f"SELECT {query}", params)) if found else iter(())


def newest_steps(db: sqlite3.Connection | HeldWrites) -> Iterator[tuple[int, int]]:
    """(rank, the newest step it committed), from both tables; a rank may come more than once."""
    for rank, step in _select(db, "steps", "rank, MAX(step) FROM steps GROUP BY rank"):
        yield int(rank), int(step)
    for runs, step in _select(db, "node_steps", "ranks, MAX(step) FROM node_steps GROUP BY ranks"):
        for rank in ranks_of(str(runs)):
            yield rank, int(step)


def read_job_table(path: Path) -> dict[str, Any]:
    """The job's key/value facts only (state, ids, generation): cheap however long the job ran."""
    with LogReader(path) as reader:
        return reader.job()


def read_job(path: Path) -> dict[str, Any]:
    """Everything ``undying status`` shows, read from the log of a job (running or not)."""
    with LogReader(path) as reader:
        return {"job": reader.job(), "ranks": reader.ranks(), "incidents": reader.incidents(),
                "steps": [c.to_dict() for c in reader.commits()]}
