"""A judge's own clock: a peer's silence counts only over time the judge itself was running.

Every part of undying that declares a peer lost or hung because it heard
nothing from it for a while is a judge: the manager of its agents and parked
standbys, an agent of its ranks and spares and of its manager. A judge that
was not running cannot judge silence. Stopped (SIGSTOP, a paused VM, a swap
storm, a long garbage collection, an event loop blocked by a slow call), it
reads nothing; when it runs again every peer looks silent for as long as the
judge itself was away, while their words wait unread in its sockets. A manager
stopped for 8 s with a 3 s heartbeat timeout declared both of its nodes lost
and failed the job.

The rule, the same for every judge: the judge's loop ticks at a known
``period_s``; a gap between two ticks longer than ``stall_s`` is a stall of the
judge itself. After one, silence counts from the judge's return (``silent_s``):
every peer gets a fresh window before the judge declares anything. A peer that
is alive speaks within it (its words were only waiting); one that is gone is
declared at the window's end, one window later than an unstalled judge would.

Why tick gaps, and not a second clock: no clock stops while one process is
stopped. ``CLOCK_MONOTONIC`` and ``CLOCK_BOOTTIME`` both run on through a
SIGSTOP, a swap storm or a blocked loop; they differ only across a suspend of
the whole machine, which ``CLOCK_MONOTONIC`` leaves out (so no silence grows
then either). A CPU-time clock stops when the process is stopped but also
whenever it merely sleeps waiting for its peers. Only the judge's own ticks
say whether it ran. So the clock is ``time.monotonic`` (``CLOCK_MONOTONIC``:
never the wall clock, which a time daemon may step) and a stall is a tick gap.

Why ``stall_s`` is half the judge's window (at least three periods): a gap
shorter than that cannot make a live peer look silent past the window, since
every peer speaks several times a window (beats are a fifth of the heartbeat
timeout or 0.5 s); and a loop that only lags under load (a busy 2-core host
lags by tenths of a second) must not postpone its judgements again and again.
A judge that stalls over and over postpones every time, and says so each time
in its log: that judge is then the fault to fix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

__all__ = ["JudgeClock", "stall_limit"]

log = logging.getLogger("undying.judge")


def stall_limit(period_s: float, window_s: float) -> float:
    """The tick gap past which the judge counts itself stalled: half its window, at least three
    periods."""
    return max(3 * period_s, window_s / 2)


class JudgeClock:
    """The clock of one judge's loop (one event loop or thread: ticks come from that loop only).

    ``tick`` once per pass of the loop, and before any judgement made outside
    it; ``silent_s`` is then a peer's silence by this rule. Times given to it
    are ``time.monotonic()`` values, or ``time.time()`` ones with ``wall=True``
    (for peers whose last word is kept on the wall clock).
    """

    def __init__(self, period_s: float, window_s: float, name: str, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        if period_s <= 0 or window_s <= 0:
            raise ValueError(f"a judge's period ({period_s}) and window ({window_s}) must be "
                             "positive")
        self.period_s = period_s
        self.window_s = window_s
        self.name = name
        self._monotonic = monotonic
        self._wall = wall
        # (the first tick starts the clock: no stall before it)
        self._last_tick: float | None = None
        # When the judge came back from its latest stall, on both clocks (0.0: it never stalled).
        self.resumed = 0.0
        self.resumed_wall = 0.0
        self.stalls = 0
        self.last_stall_s = 0.0

    @property
    def window_s(self) -> float:
        """The judge's window: the silence it declares (its heartbeat timeout); settable, as a job's
        flags arrive."""
        return self._window_s

    @window_s.setter
    def window_s(self, value: float) -> None:
        if value <= 0:
            raise ValueError(f"a judge's window must be positive, not {value}")
        self._window_s = value
        self.stall_s = stall_limit(self.period_s, value)

    def start(self) -> None:
        """The judge's loop starts now: the time before it (a start-up's work) is no stall of it."""
        self._last_tick = None
        self.tick()

    def tick(self) -> float:
        """One pass of the judge's loop; returns the gap since the previous tick.

        A gap past ``stall_s`` is a stall of the judge: from now on, every peer's
        silence counts from this moment (a fresh window for each).
        """
        now = self._monotonic()
        gap = 0.0 if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        if gap > self.stall_s:
            self.stalls += 1
            self.last_stall_s = gap
            self.resumed = now
            self.resumed_wall = self._wall()
            log.warning("%s did not run for %.1fs (its loop ticks every %gs; a stall of its own: "
                        "stopped, paused or starved); every peer it watches gets a fresh %gs "
                        "window before it declares anything",
                        self.name, gap, self.period_s, self.window_s)
        return gap

    async def keep_ticking(self) -> None:
        """Tick every period, forever: a task of the judge's event loop, for a judge whose own waits
        are long (a connection attempt, a wait for a line) and so cannot tick at a steady pace
        itself."""
        while True:
            await asyncio.sleep(self.period_s)
            self.tick()

    def counts_from(self, last_heard: float, *, wall: bool = False) -> float:
        """Where a peer's silence starts: its last word, or the judge's return from a stall if that
        is later.

        Ticks first: a judgement made before the loop's own tick (a callback that
        ran first after the stall) still sees the stall.
        """
        self.tick()
        return max(last_heard, self.resumed_wall if wall else self.resumed)

    def silent_s(self, last_heard: float, now: float | None = None, *, wall: bool = False) -> float:
        """How long a peer last heard at ``last_heard`` has been silent while this judge was
        running."""
        since = self.counts_from(last_heard, wall=wall)
        if now is None:
            now = self._wall() if wall else self._monotonic()
        return max(0.0, now - since)

    def fresh(self) -> bool:
        """Whether the judge came back from a stall less than a window ago (ticks first, as
        ``counts_from``).

        A peer's connection that closes then may have been closed by the peer's
        own judgement of this judge's silence (it connects again): it is judged by
        its silence, in its fresh window, not lost at once.
        """
        self.tick()
        return bool(self.stalls) and self._monotonic() - self.resumed <= self.window_s
