"""The records the event log stores: the job's and the ranks' states, with the moves allowed
between them, the ranks and the incidents.

The manager decides with them (no asyncio, sqlite3 or torch here: a tested rule);
``undying.jobfiles.events`` writes and reads them back.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

__all__ = ["JobState", "RankState", "IllegalTransition", "JobStateMachine", "Incident",
           "IncidentKind", "IncidentStatus", "IncidentDetail", "RankInfo", "quote_first_failure"]


class JobState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by the user (Ctrl-C, the API's stop)
    # SIGTERM: the dying gasp was taken; run the same command again to resume
    PREEMPTED = "preempted"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.PREEMPTED)


_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.STOPPING}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.STOPPING}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.STOPPING}),
    JobState.STOPPING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED,
                                  JobState.PREEMPTED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
    JobState.PREEMPTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class JobStateMachine:
    def __init__(self) -> None:
        self.state = JobState.STARTING
        self.since = time.time()

    def move(self, new: JobState) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"job state {self.state.value} cannot move to {new.value}")
        self.state = new
        self.since = time.time()


class RankState(str, enum.Enum):
    STARTING = "starting"  # process spawned, not yet joined
    RUNNING = "running"
    RECOVERING = "recovering"
    DONE = "done"  # finished its last step
    EXITED = "exited"  # process gone (failed or stopped)


@dataclass
class RankInfo:
    rank: int
    node: int
    pid: int = 0
    state: RankState = RankState.STARTING
    step: int = 0
    generation: int = 0
    restarts: int = 0
    last_seen: float = 0.0
    digest: str = ""
    incarnation: int = 0  # the manager's number for the process that holds the rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "node": self.node,
            "pid": self.pid,
            "state": self.state.value,
            "step": self.step,
            "generation": self.generation,
            "restarts": self.restarts,
            "last_seen": self.last_seen,
            "incarnation": self.incarnation,
        }


class IncidentKind(enum.StrEnum):
    """What happened. Recovered: the first eight; seen and reported, the job trains on: the rest."""

    CRASH = "crash"  # the rank's process died (a signal, an exit code)
    ERROR = "error"  # the user's code raised in a step (the rank said so before dying)
    HANG = "hang"  # no heartbeat or no progress: killed, then replaced
    COMM_ERROR = "comm-error"  # a collective failed with every process alive: the link
    NODE_LOSS = "node-loss"  # a node's agent, and every rank on it, gone or out of reach
    NODE_JOINED = "node-joined"  # an elastic job grows to a node that joined
    # the script cannot run (SyntaxError, ImportError): the job fails at once
    SCRIPT_ERROR = "script-error"
    # exited 0 before its last step while the others went on (manager.recovery.leaving)
    LEFT_EARLY = "left-early"
    PREEMPT = "preempt"  # SIGTERM: the dying gasp
    CHECKPOINT_FAILED = "checkpoint_failed"  # saves fail (a full disk): retried at the next save
    SLOW_RANK = "slow_rank"  # found by slow-rank detection
    SLOW_NODE = "slow_node"
    # a re-run step's batch, or a restored state, is not the one it replaces (divergence)
    DIVERGED = "diverged"
    # a step's numeric check failed and was replayed (worker.numerics): the verdict
    NUMERIC = "numeric"
    # a rank's step differed from its replay elsewhere (--verify-every): rolled back (worker.verify)
    SDC = "sdc"
    # planned: an operator moved a rank (undying migrate / drain), no step lost
    MIGRATION = "migration"


class IncidentStatus(enum.StrEnum):
    OPEN = "open"  # being handled
    RECOVERED = "recovered"  # the job trains again (or a failing save succeeded)
    FAILED = "failed"  # the job failed or ended with it
    DUMPED = "dumped"  # preempted, its dying gasp (or the latest checkpoint) stands
    IGNORED = "ignored"  # a SIGTERM after the last step
    OBSERVED = "observed"  # reported only (a slow rank): nothing to recover

    @property
    def settled(self) -> bool:
        return self is not IncidentStatus.OPEN


# An incident opens, then settles once; a finding is only observed.
_INCIDENT_MOVES: dict[IncidentStatus, frozenset[IncidentStatus]] = {
    IncidentStatus.OPEN: frozenset({IncidentStatus.RECOVERED, IncidentStatus.FAILED,
                                    IncidentStatus.DUMPED, IncidentStatus.IGNORED}),
    **{s: frozenset() for s in IncidentStatus if s is not IncidentStatus.OPEN},
}


class IncidentDetail(TypedDict, total=False):
    """What an incident carries besides its common fields (the API shows it as ``detail``)."""

    # The process and its end.
    returncode: int
    pid: int
    node: int | str  # a node's number; a slow finding's host name
    injected: bool
    # The exception the process raised (its report, or torchrun's error file), and whether it had
    # committed no step yet: a start-up error (recovery/policy.certain_start).
    raised: str
    startup: bool
    # The decision and how it was carried out.
    reason: str
    restore_plan: str
    replacement: str  # "warm spare" or "new process"
    stuck_collective: bool
    # survivors gloo never let go, replaced in the same round (recovery/left_behind.py)
    left_behind: list[int]
    restart: int
    # The state restored.
    restored: str
    lost_steps: int
    checkpoint: str
    checkpoint_step: int
    generation: int
    restored_step: int
    regroup: dict[str, Any]
    closed: str
    # a planned move: planned_t, boundary_step, from, to, by (manager/placement/migration.py)
    migration: dict[str, Any]
    # A preemption.
    grace_period_s: float
    reused: str
    killed_ranks: list[int]
    stop_step: int
    dying_gasp_error: str
    dying_gasp_write_s: float | None
    sigterm_to_exit_s: float
    resume_reruns: int
    # Failing saves (checkpoint_health).
    failed_saves: int
    first_failed_step: int
    last_failed_step: int
    kind: str
    os_error: str
    last_error: str
    recovered_by_step: int
    # A slow rank or node (the finding of undying.trace.detect).
    rank: int
    ranks: list[int]
    phase: str
    factor: float | None
    excess_s: float
    since_step: int
    step_factor: float | None
    evidence: dict[str, Any]


@dataclass
class Incident:
    id: int
    kind: IncidentKind
    rank: int
    step: int
    fault_t: float
    recovery: int  # the recovery round that handles it (0: none, it is reported only)
    action: str = ""
    status: IncidentStatus = IncidentStatus.OPEN
    phases: dict[str, float] = field(default_factory=dict)  # absolute times
    error: str = ""
    traceback: str = ""
    detail: IncidentDetail = field(default_factory=lambda: IncidentDetail())

    def __post_init__(self) -> None:
        # Checked where it is made: a kind or status outside the enums is a bug, not a new value.
        self.kind = IncidentKind(self.kind)
        self.status = IncidentStatus(self.status)

    def settle(self, status: IncidentStatus) -> None:
        """Close the incident as ``status``; an incident settles once."""
        if status not in _INCIDENT_MOVES[self.status]:
            raise IllegalTransition(f"incident {self.id} is {self.status.value}; it cannot become "
                                    f"{status.value}")
        self.status = status

    @property
    def mttr_s(self) -> float | None:
        done = self.phases.get("first_step_done")
        return None if done is None else round(done - self.fault_t, 4)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "rank": self.rank,
            "step": self.step,
            "action": self.action,
            "status": self.status,
            "recovery": self.recovery,
            "fault_t": self.fault_t,
            "mttr_s": self.mttr_s,
            "phases": {k: round(v - self.fault_t, 4) for k, v in self.phases.items()},
            "error": self.error,
            "traceback": self.traceback,
            "detail": self.detail,
        }


# The faults of a rank's process (or its link, or its node): what a failed job's first failure is.
_FAULTS = frozenset({IncidentKind.CRASH, IncidentKind.ERROR, IncidentKind.HANG,
                     IncidentKind.COMM_ERROR, IncidentKind.NODE_LOSS, IncidentKind.SCRIPT_ERROR,
                     IncidentKind.LEFT_EARLY})


def quote_first_failure(reason: str, incidents: Sequence[Incident]) -> str:
    """A failed job's reason, its first line quoting the job's first failure: the exception its rank
    raised (else the failure's own words), unless the line quotes them already.

    The first line is the one a person reads last (the launcher prints it after
    the rest); the lines below it (a traceback) stay as they are.
    """
    first = next((i for i in incidents if i.kind in _FAULTS), None)
    head, newline, rest = reason.partition("\n")
    words = (first.detail.get("raised") or first.error).strip() if first is not None else ""
    if first is None or not words or _numberless(words) in _numberless(head):
        return reason  # (quoted already, numbers aside: rank 1's error as rank 0's words say it)
    return f"{head}; first failure: {first.kind} of rank {first.rank}: {words}{newline}{rest}"


def _numberless(words: str) -> str:
    return re.sub(r"\d+", "#", words)
