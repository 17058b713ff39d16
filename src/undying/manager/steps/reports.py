"""The workers' word on their steps: commits (one rank's, or a node's run of them), progress through
a step's phases, a saved checkpoint, a rank done with its last step.

Each report goes to the step clock and to the parts it concerns: the
recovery whose first step it may be, the regroup, the checkpoints, the
integrity checks, the dying gasp. Commits arrive in runs and are written to
the log's steps table in one statement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from undying.jobfiles.records import JobState, RankInfo, RankState
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore
from undying.manager.integrity import (
    NUMERIC_PHASE,
    SDC_PHASE,
    VERIFIED_PHASE,
    Divergence,
    on_numeric_fault,
    on_sdc,
    on_verified,
)
from undying.manager.preemption import Preemption
from undying.manager.recovery import Detection, Recoveries
from undying.manager.regroup import Regrouping
from undying.protocol.worker_wire import (
    CheckpointSaved,
    Done,
    Progress,
    StepCommitted,
    float_metrics,
)

__all__ = ["StepReports", "CommitRow", "History", "Tracking"]

# A commit as the log's steps table takes it: rank, step, generation, time, metrics.
# ("inf", "nan": as the wire carries them)
CommitRow = tuple[int, int, int, float, Mapping[str, float | str]]
# A commit with its metrics as numbers.
NumberRow = tuple[int, int, int, float, dict[str, float]]


class History(Protocol):
    """The run's history the status page charts (``views.RunHistory``):
    what it is told of the steps."""

    def commits(self, rows: list[NumberRow], world_size: int) -> None: ...

    def commit(self, rank: int, step: int, t: float, metrics: dict[str, float],
               world_size: int) -> None: ...

    def checkpoint(self, message: CheckpointSaved) -> None: ...


class Tracking(Protocol):
    """The experiment trackers (``trackers.Trackers``): told each step every rank committed."""

    def committed(self, step: int, values: Mapping[str, float]) -> None: ...


class StepReports:
    """Each worker's report of its steps, to the parts it concerns (``finish``: ranks done,
    the job's end)."""

    def __init__(self, core: JobCore, *, history: History, checkpoints: Checkpoints,
                 recoveries: Recoveries, detection: Detection, regrouping: Regrouping,
                 divergence: Divergence, gasp: Preemption,
                 finish: Callable[[RankInfo], None], tracking: Tracking | None = None) -> None:
        self.core = core
        self.tracking = tracking
        self.history = history
        self.checkpoints = checkpoints
        self.recoveries = recoveries
        self.detection = detection
        self.regrouping = regrouping
        self.divergence = divergence
        self.gasp = gasp
        self._finish = finish

    def on_commits(self, rows: list[CommitRow]) -> None:
        core = self.core
        ranks = core.ranks
        numbers = [(rank, step, generation, t, float_metrics(metrics))
                   for rank, step, generation, t, metrics in rows
                   if rank in ranks]  # (not a process numbered before a regroup)
        core.events.steps(numbers)
        self.history.commits(numbers, core.book.world_size)
        for rank, step, generation, t, metrics in numbers:
            self._commit(rank, step, generation, t, metrics)
        # their ranks rows are due at the next flush, also when one ran in between
        core.events.changed()

    def on_commit(self, message: StepCommitted) -> None:
        metrics = float_metrics(message.metrics)
        self.core.events.step(message.rank, message.step, message.generation, message.t, metrics)
        self.history.commit(message.rank, message.step, message.t, metrics,
                            self.core.book.world_size)
        self._commit(message.rank, message.step, message.generation, message.t, metrics)

    def _commit(self, rank: int, step: int, generation: int, t: float,
                metrics: dict[str, float]) -> None:
        core = self.core
        if core.book.commit(rank, step, generation, t):
            core.events.event("step_rerun", rank=rank, step=step)
        if self.detection.leavers.pending:
            # a rank that exited 0 before this step left early
            self.detection.leavers.on_commit(rank, step)
        done = core.clock.committed(rank, step, t, metrics)
        if done is not None and self.tracking is not None:
            # every rank committed it: its values (their mean) to the trackers, once
            self.tracking.committed(step, done[1])
        if core.state is JobState.STARTING:  # the job's first commit: it runs
            core.move(JobState.RUNNING)
        self._maybe_finish_recovery(rank, t, generation)

    def on_progress(self, message: Progress) -> None:
        core = self.core
        info = core.ranks[message.rank]
        info.generation = message.generation
        info.last_seen = message.t
        core.events.event(message.phase, generation=message.generation, rank=message.rank,
                          step=message.step, **message.detail)
        self.checkpoints.on_state_reported(message.phase, message.detail)
        core.clock.reported(message.phase, message.detail)
        self.divergence.on_progress(message)
        self.recoveries.on_progress(message.rank, message.generation, message.step, message.phase,
                                    message.detail, message.t)
        if message.phase == NUMERIC_PHASE:
            # a step's numeric check, replayed: its verdict (integrity/numerics.py)
            on_numeric_fault(core, message, self.recoveries)
        elif message.phase == SDC_PHASE:
            # a step that differed from its replay (integrity/verification.py)
            on_sdc(core, message)
        elif message.phase == VERIFIED_PHASE:
            # a verified step's verdict: a quarantined host may requalify
            on_verified(core, message)

    def on_checkpoint(self, message: CheckpointSaved) -> None:
        self.checkpoints.on_saved(message)
        self.history.checkpoint(message)
        if not message.error:
            self.core.clock.saved(message.step, message.t, message.blocking_s)
            self.regrouping.on_saved(message.kind, message.path)
        self.gasp.on_saved(message)

    def on_done(self, message: Done) -> None:
        core = self.core
        info = core.ranks[message.rank]
        info.state = RankState.DONE
        info.digest = message.digest
        info.step = message.step
        core.events.event("done", rank=message.rank, step=message.step, digest=message.digest)
        core.book.persist(info)
        # (its exit came first: it finished after all)
        if self.detection.leavers.on_done(message.rank):
            self._finish(info)
            return
        self._maybe_finish_recovery(message.rank, message.t, core.generations.current)

    def _maybe_finish_recovery(self, rank: int, t: float, generation: int) -> None:
        if self.regrouping.active:
            return  # (a regroup's recovery ends on the new world's first step)
        if self.recoveries.maybe_finish(rank, t, message_generation=generation):
            self.regrouping.maybe_grow()
