"""The job's and the ranks' states, with the moves allowed between them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JobState", "RankState", "IllegalTransition", "JobStateMachine", "Incident", "RankInfo"]


class JobState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by the user (Ctrl-C, the API's stop)
    PREEMPTED = "preempted"  # SIGTERM: the dying gasp was taken; run the same command again to resume

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.PREEMPTED)


_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.STOPPING}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.STOPPING}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.STOPPING}),
    JobState.STOPPING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.PREEMPTED}),
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


@dataclass
class Incident:
    id: int
    kind: str  # crash, error, comm-error
    rank: int
    step: int
    fault_t: float
    recovery: int  # the recovery round that handles it
    action: str = ""
    status: str = "open"  # open, recovered, failed, ignored
    phases: dict[str, float] = field(default_factory=dict)  # absolute times
    error: str = ""
    traceback: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def mttr_s(self) -> float | None:
        done = self.phases.get("first_step_done")
        return None if done is None else round(done - self.fault_t, 4)

    @classmethod
    def from_dict(cls, view: dict[str, Any]) -> Incident:
        """An incident as ``to_dict`` wrote it (its phases were relative to the fault)."""
        return cls(id=view["id"], kind=view["kind"], rank=view["rank"], step=view["step"], fault_t=view["fault_t"],
                   recovery=view["recovery"], action=view["action"], status=view["status"],
                   phases={k: view["fault_t"] + v for k, v in view["phases"].items()}, error=view["error"],
                   traceback=view["traceback"], detail=view["detail"])

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
