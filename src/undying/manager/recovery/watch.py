"""The watch of deadlines: a pass every half second over what must happen by a time.

A regroup's grace; a lost node's ranks waiting for a host past ``--node-wait``
(then the job regroups without it); a recovery overdue (it fails); a rank left
behind in a wait gloo never ends (it is treated as hung). The deadlines count
only while this manager ran (``protocol/judge_clock.py``): after a stall of its
own, the joins and reports it did not read come first. Beside it, the event
log's periodic flush.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from undying.jobfiles.records import IncidentKind
from undying.manager.core import JobCore
from undying.manager.recovery.detection import Detection
from undying.manager.recovery.left_behind import LeftBehind
from undying.manager.recovery.rounds import Recoveries
from undying.protocol.judge_clock import JudgeClock

__all__ = ["Watch", "Regroups", "WATCH_S"]

WATCH_S = 0.5  # the watch of deadlines: a pass every half second
_FLUSH_S = 0.25  # the event log's flush


class Regroups(Protocol):
    """What recovery asks of the regroup (``regroup.Regrouping``), which is built on recovery."""

    @property
    def active(self) -> bool: ...

    def watch(self, resumed: float = 0.0) -> None: ...

    def lost_nodes(self) -> list[int]: ...

    def begin(self, why: str) -> None: ...

    def on_group_broke(self, generation: int, why: str) -> None: ...


class Watch:
    """The manager's deadlines, judged on its own clock (``clock``), and the log's flush."""

    def __init__(self, core: JobCore, *, recoveries: Recoveries, detection: Detection,
                 regrouping: Regroups, left_behind: LeftBehind) -> None:
        self.core = core
        self.recoveries = recoveries
        self.detection = detection
        self.left_behind = left_behind
        self.regrouping = regrouping
        self.clock = JudgeClock(WATCH_S, core.config.timeouts.heartbeat_timeout,
                                "the manager's deadlines")
        self.clock.tick()

    def start(self) -> list[asyncio.Task[None]]:
        """The watch and the flush, running until cancelled. The watch's clock counts from here: the
        job's start-up before it (a zygote importing torch, the ranks spawned) is no stall of the
        manager's, and warned of none."""
        self.clock.start()
        return [asyncio.create_task(self._watch()), asyncio.create_task(self._flush_periodically())]

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            self.clock.tick()
            # (its return from its latest stall; 0.0: it never stalled)
            self.check(self.clock.resumed_wall)

    def check(self, resumed: float) -> None:
        """One pass: each deadline due, acted on (``resumed``: when the manager came back from a
        stall)."""
        if self.core.winding_down:
            return
        if self.regrouping.active:
            self.regrouping.watch(resumed)
            return
        recovery = self.recoveries.current
        if recovery is None:
            return
        lost = self.regrouping.lost_nodes()
        if lost and any(i.kind is IncidentKind.NODE_LOSS for i in recovery.incidents):
            # Its ranks wait for a host to take them; past --node-wait the job goes on without it.
            node_wait = self.core.config.timeouts.node_wait
            if time.time() - max(recovery.started, resumed) > node_wait:
                self.regrouping.begin(f"node{'s' if len(lost) > 1 else ''} "
                                      f"{', '.join(map(str, lost))} lost and not replaced within "
                                      f"--node-wait {node_wait:g}s")
            return
        overdue = self.recoveries.overdue(time.time(), resumed)
        if overdue:
            self.recoveries.fail(overdue)
            return
        self.left_behind.judge(time.time(), resumed)  # (left_behind.py: a wait gloo never ends)

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(_FLUSH_S)
            self.core.events.flush()
