"""The trackers' feed: each committed step's values to every tracker the job asked for, once, from
the manager, in a bounded background thread per tracker.

The manager's loop only puts a step on a tracker's bounded queue
(``Trackers.committed``, never blocking); the tracker's thread opens the
job's run, sends the steps in order, flushes, and then advances the durable
cursor (``cursor.py``). A tracker that fails, falls behind by a whole queue,
or takes longer than ``hang_s`` over one call is reported once (a warning and a
``tracker_dropped`` event) and dropped: the job goes on without it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from undying.manager.trackers.cursor import Cursor
from undying.manager.trackers.sinks import Row, Sink, make_sink

__all__ = ["Feed", "Trackers", "MAX_QUEUED", "HANG_S", "CLOSE_S"]

log = logging.getLogger("undying.manager")

# Steps waiting for one tracker; a tracker this far behind is dropped (the manager's memory stays
# bounded).
MAX_QUEUED = 10_000
# A tracker busy this long in one call (its run's start, a log, a flush) is taken as hung.
HANG_S = 120.0
# At the job's end, how long each tracker may take to send what is queued and close its run.
CLOSE_S = 30.0
# Steps sent in one batch (one flush and one cursor write per batch).
_BATCH = 256
_STOP = None
T = TypeVar("T")


class Feed:
    """One tracker's queue and thread. ``problem`` says why it stopped taking steps ('' while it
    takes them)."""

    def __init__(self, name: str, sink: Sink, cursor: Cursor, *, max_queued: int = MAX_QUEUED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.sink = sink
        self.cursor = cursor
        self.problem = ""
        self.succeeded = True  # how the job ended, for the run's final state
        self._clock = clock
        self._queue: queue.Queue[Row | None] = queue.Queue(maxsize=max_queued)
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"undying-tracker-{name}",
                                        daemon=True)
        self._thread.start()

    def offer(self, row: Row) -> None:
        """Queue one committed step (never blocks); a full queue drops the tracker."""
        if self.problem:
            return
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self.problem = (f"{self._queue.maxsize} steps behind (it takes steps slower than the "
                            "job commits them)")

    def hung_for(self) -> float:
        """How long its current call has lasted (0 when it waits for steps)."""
        since = self._busy_since
        return 0.0 if since is None else self._clock() - since

    def close(self, timeout: float, succeeded: bool) -> bool:
        """Send what is queued, close the run; False when it did not end within ``timeout``."""
        self.succeeded = succeeded
        try:
            self._queue.put(_STOP, timeout=max(0.0, timeout))
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _call(self, what: Callable[[], T]) -> T:
        self._busy_since = self._clock()
        try:
            return what()
        finally:
            self._busy_since = None

    def _run(self) -> None:
        opened = False
        try:
            last = self.cursor.last(self.name)
            facts = self._call(lambda: self.sink.open(self.cursor.facts(self.name), last))
            opened = True
            self.cursor.advance(self.name, **facts)
            stop = False
            while not stop:
                batch: list[Row] = []
                item = self._queue.get()
                while True:
                    if item is _STOP:
                        stop = True
                        break
                    batch.append(item)
                    if len(batch) >= _BATCH:
                        break
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                last = self._send(batch, last)
        except Exception as e:  # a tracker's library may raise anything: it is dropped, not fatal
            # (its first line, bounded: a library's message may run to pages)
            first = (str(e).strip().splitlines() or [""])[0]
            self.problem = self.problem or f"{type(e).__name__}: {first}"[:200]
        finally:
            if opened:
                try:
                    self._call(lambda: self.sink.close(self.succeeded and not self.problem))
                except Exception as e:
                    self.problem = self.problem or f"its close failed: {type(e).__name__}: {e}"

    def _send(self, batch: Sequence[Row], last: int) -> int:
        """Send the steps after ``last`` (a re-run or resumed step is never sent twice), flush,
        then move the cursor."""
        rows = [(step, values) for step, values in batch if step > last and values]
        if not rows or self.problem:
            return last
        self._call(lambda: self._log_and_flush(rows))
        last = rows[-1][0]
        self.cursor.advance(self.name, last)
        return last

    def _log_and_flush(self, rows: Sequence[Row]) -> None:
        self.sink.log(rows)
        self.sink.flush()


class Trackers:
    """The trackers of a job (``--trackers``): every committed step's values to each, once.

    ``committed`` is called on the manager's loop for each step every rank committed,
    in order; ``report`` (on the same loop) tells of a tracker dropped.
    """

    def __init__(self, names: Sequence[str], job_id: str, job_dir: Path, *,
                 report: Callable[[str, str], None],
                 make: Callable[[str, str, Path], Sink] = make_sink,
                 max_queued: int = MAX_QUEUED, hang_s: float = HANG_S) -> None:
        self._report = report
        self._hang_s = hang_s
        self._last = 0
        self._reported: set[str] = set()
        cursor = Cursor(job_dir)
        self.feeds = [Feed(name, make(name, job_id, job_dir), cursor, max_queued=max_queued)
                      for name in names]
        if self.feeds:
            # (a step the slowest tracker already took is not queued again on a relaunch)
            self._last = min(cursor.last(name) for name in names)

    def committed(self, step: int, values: Mapping[str, float]) -> None:
        """Every rank committed ``step`` with these values (their mean): to each tracker, once."""
        self.check()
        if step <= self._last or not values:
            return  # a re-run after a recovery or a resume: already sent
        self._last = step
        for feed in self.feeds:
            feed.offer((step, dict(values)))
        self.check()

    def check(self) -> None:
        """Report, once each, a tracker that failed, fell behind or hangs; it is dropped."""
        for feed in self.feeds:
            if feed.name in self._reported:
                continue
            if not feed.problem and feed.hung_for() > self._hang_s:
                feed.problem = f"no answer for over {self._hang_s:g} s"
            if feed.problem:
                self._reported.add(feed.name)
                self._report(feed.name, feed.problem)

    def close(self, succeeded: bool, timeout: float = CLOSE_S) -> None:
        """The job ended: each tracker sends what is queued and closes its run, within
        ``timeout`` each."""
        for feed in self.feeds:
            if feed.name in self._reported:
                continue
            if not feed.close(timeout, succeeded):
                feed.problem = feed.problem or f"did not close its run within {timeout:g} s"
        self.check()
