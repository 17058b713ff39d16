"""Faults a worker reports itself: its group broke (``CommFailure``), a fault was injected into it
(``FaultInjected``), its script raised (``Fatal``).

Each is noted for the detection that turns the rank's exit or silence into an
incident; a broken group during a regroup is the regroup's to re-plan, and a
rank leaving at a planned move's boundary is the move's.
"""

from __future__ import annotations

from typing import Protocol

from undying.jobfiles.records import RankState
from undying.manager.core import JobCore
from undying.manager.recovery.detection import Detection
from undying.manager.recovery.left_behind import LeftBehind
from undying.manager.recovery.watch import Regroups
from undying.protocol.worker_wire import CommFailure, Fatal, FaultInjected

__all__ = ["ReportedFaults", "Moves"]


class Moves(Protocol):
    """What recovery asks of the planned moves (``placement.Migrations``), which are built on
    recovery."""

    def on_left(self, message: FaultInjected) -> bool: ...


class ReportedFaults:
    """The handlers of the faults workers report."""

    def __init__(self, core: JobCore, *, detection: Detection, regrouping: Regroups,
                 moves: Moves, left_behind: LeftBehind) -> None:
        self.core = core
        self.detection = detection
        self.regrouping = regrouping
        self.moves = moves
        self.left_behind = left_behind

    def on_comm_failure(self, message: CommFailure) -> None:
        info = self.core.ranks[message.rank]
        info.state = RankState.RECOVERING
        info.last_seen = message.t
        self.core.events.event("comm_failure", generation=message.generation, rank=message.rank,
                               step=message.step, error=message.error, torn=message.torn)
        self.core.book.persist(info)
        self.left_behind.on_kept_left(info, message.generation, reopen=not self.regrouping.active)
        # the regroup's group broke: it re-plans (after the grace), no retry
        if self.regrouping.active:
            self.regrouping.on_group_broke(message.generation,
                                           f"rank {message.rank}'s group broke ({message.error})")
            return
        self.detection.on_comm_failure(message)

    def on_fault_injected(self, message: FaultInjected) -> None:
        if message.kind == "migrate" and self.moves.on_left(message):
            return  # a moved rank at its boundary (placement/migration.py)
        if message.kind != "slow":  # a slowdown is no fault a later exit should be timed from
            self.detection.injected[message.rank] = (message.t, message.kind)
        self.core.events.event("fault_injected", rank=message.rank, kind=message.kind,
                               step=message.step, phase=message.phase)

    def on_fatal(self, message: Fatal) -> None:
        self.detection.fatal[self.core.ranks[message.rank].pid] = message
        self.core.events.event("user_error", rank=message.rank, step=message.step,
                               error=message.error, traceback=message.traceback)
