"""The event log's SQLite connection, made to outlive a full disk: writes are held in memory until
there is room.

By default the checkpoints live in the job dir, beside ``events.db``: the disk
that fills with checkpoints fills under the event log too. SQLite then fails
the statement (or the COMMIT) with SQLITE_FULL, and the exception, raised in
the middle of the manager's handlers, used to stop it from hearing its ranks'
exits: the job hung. Here the writes of the open transaction are kept (they
are also what SQLite rolls back), the manager goes on from memory (the HTTP
API and metrics never read the log), and every few seconds the held writes
are replayed in one transaction; once one commits, the log is whole again.

Only storage errors are held (SQLITE_FULL, SQLITE_IOERR*); any other error
is a bug and raises as before. Memory is bounded: past ``limit`` statements
the oldest are dropped, counted and said once.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["HeldWrites", "is_storage_error"]

log = logging.getLogger("undying.manager")

_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")
_SQLITE_FULL = 13
_SQLITE_IOERR = 10


def is_storage_error(e: BaseException) -> bool:
    """SQLite could not write for lack of room or an I/O failure (not a bug in a statement)."""
    if not isinstance(e, sqlite3.OperationalError | sqlite3.DatabaseError):
        return False
    code = getattr(e, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in (_SQLITE_FULL, _SQLITE_IOERR)
    text = str(e).lower()
    return "disk is full" in text or "disk i/o error" in text


class HeldWrites:
    """A connection used as BEGIN, writes, COMMIT, BEGIN, ...; on a storage error the writes wait
    in memory."""

    RETRY_EVERY_S = 5.0

    def __init__(self, db: sqlite3.Connection, *, path: str = "", limit: int = 200_000) -> None:
        self.raw = db
        self._path = path
        self._limit = limit
        # writes since the last COMMIT: (sql, params, many)
        self._txn: deque[tuple[str, Any, bool]] = deque()
        # when writing started to fail; None while all is written
        self.held_since: float | None = None
        self._next_try = 0.0
        self.dropped = 0

    @property
    def failing(self) -> bool:
        return self.held_since is not None

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        verb = sql.lstrip()[:8].upper()
        if verb.startswith("BEGIN"):
            if not self.failing and not self.raw.in_transaction:
                self.raw.execute(sql)
            return self.raw.cursor()
        if verb.startswith("COMMIT"):
            self._commit()
            return self.raw.cursor()
        if not verb.startswith(_WRITES):
            return self.raw.execute(sql, params)  # reads (and anything else) as they are
        return self._write(sql, params, many=False)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> sqlite3.Cursor:
        return self._write(sql, list(rows), many=True)

    def executescript(self, script: str) -> sqlite3.Cursor:
        return self.raw.executescript(script)

    def close(self) -> None:
        """A last try at what is held (no waiting for the retry period), then close; what is left
        is said."""
        if self.failing:
            self._next_try = 0.0
            self._replay()
            if self.failing:
                log.error("event log %s: %d write(s) could not be written before closing (the disk "
                          "is still full)", self._path, len(self._txn))
        self.raw.close()

    def _write(self, sql: str, params: Any, *, many: bool) -> sqlite3.Cursor:
        self._hold(sql, params, many)
        if self.failing:
            return self.raw.cursor()  # written with the rest once there is room
        try:
            return self.raw.executemany(sql, params) if many else self.raw.execute(sql, params)
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as e:
            if not is_storage_error(e):
                self._txn.pop()
                raise
            self._start_holding(e)
            return self.raw.cursor()

    def _hold(self, sql: str, params: Any, many: bool) -> None:
        self._txn.append((sql, params, many))
        if len(self._txn) > self._limit:
            self._txn.popleft()
            self.dropped += 1
            if self.dropped == 1:
                log.error("event log %s: more than %d writes held while the disk is full; the "
                          "oldest are dropped from now on (counted)", self._path, self._limit)

    def _commit(self) -> None:
        if self.failing:
            self._replay()
            return
        try:
            if self.raw.in_transaction:
                self.raw.execute("COMMIT")
            self._txn.clear()
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as e:
            if not is_storage_error(e):
                raise
            self._start_holding(e)

    def _start_holding(self, e: BaseException) -> None:
        self._rollback()
        self.held_since = time.time()
        self._next_try = time.monotonic() + self.RETRY_EVERY_S
        log.error("event log %s cannot be written (%s): the job goes on; %d write(s) are held in "
                  "memory and written when there is room (the HTTP API and metrics show everything "
                  "meanwhile)",
                  self._path, e, len(self._txn))

    def _rollback(self) -> None:
        if self.raw.in_transaction:
            with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already
                self.raw.execute("ROLLBACK")

    def _replay(self) -> None:
        """Every few seconds while failing: write everything held in one transaction."""
        if time.monotonic() < self._next_try:
            return
        self._next_try = time.monotonic() + self.RETRY_EVERY_S
        try:
            self._rollback()
            self.raw.execute("BEGIN")
            for sql, params, many in self._txn:
                if many:
                    self.raw.executemany(sql, params)
                else:
                    self.raw.execute(sql, params)
            self.raw.execute("COMMIT")
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as e:
            if not is_storage_error(e):
                raise
            self._rollback()
            return
        held_s = time.time() - (self.held_since or time.time())
        dropped = f" ({self.dropped} oldest dropped)" if self.dropped else ""
        log.warning("event log %s written again: %d held write(s) committed after %.1fs%s",
                    self._path, len(self._txn), held_s, dropped)
        self._txn.clear()
        self.held_since = None
        self.raw.execute("BEGIN")
