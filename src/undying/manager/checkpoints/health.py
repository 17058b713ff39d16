"""Failed checkpoint saves as incidents: told in the status, the API and the metrics,
closed by the next save.

A save that fails (a full disk, a vanished folder, a store that refuses) left
one ``checkpoint_failed`` event per attempt and nothing else: the status said
"running", then "succeeded", while every step since the last good checkpoint
was at risk. Here a run of failures is one incident of kind
``checkpoint_failed``: opened by the first failure (with the OS's error),
counting the ones after it, closed as ``recovered`` by the next committed
save, or ``failed`` when the job ends with it still open. The manager owns one
of these and calls it; it keeps no state the event log does not also hold.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from undying.config import EXIT_PREEMPTED, EXIT_PREEMPTED_BEHIND
from undying.jobfiles.records import Incident, IncidentKind, IncidentStatus
from undying.protocol.worker_wire import CheckpointSaved

__all__ = ["CheckpointHealth", "resume_line"]



class _IncidentLog(Protocol):
    def incident(self, incident: Incident) -> None: ...


class CheckpointHealth:
    """The job's saves: how many failed, the last OS error,
    and the incident of the failures in a row."""

    def __init__(self, events: _IncidentLog, incidents: list[Incident]) -> None:
        self._events = events
        self._incidents = incidents  # the manager's list: this module appends to it, never reorders
        self.failures = 0
        self.last_error = ""
        self.last_os_error = ""
        self.last_failed_step = -1
        self.open: Incident | None = None

    @property
    def failing(self) -> bool:
        """The most recent save failed, and none has succeeded since."""
        return self.open is not None

    def adopt(self, incident: Incident) -> bool:
        """A restarted manager's open incident read back from the log:
        True when it is one of these (kept here)."""
        if incident.kind is not IncidentKind.CHECKPOINT_FAILED:
            return False
        self.open = incident
        self.failures = max(self.failures, int(incident.detail.get("failed_saves", 0)))
        self.last_error = str(incident.detail.get("last_error", incident.error))
        self.last_os_error = str(incident.detail.get("os_error", ""))
        self.last_failed_step = int(incident.detail.get("last_failed_step", incident.step))
        return True

    def failed(self, message: CheckpointSaved) -> Incident:
        """A save failed: open the incident, or count this failure in the one already open."""
        self.failures += 1
        self.last_error = message.error
        self.last_os_error = message.os_error
        self.last_failed_step = message.step
        incident = self.open
        if incident is None:
            incident = Incident(
                id=len(self._incidents) + 1, kind=IncidentKind.CHECKPOINT_FAILED,
                rank=message.rank, step=message.step,
                fault_t=message.t, recovery=0, action="retry at the next save", error=message.error,
            )
            incident.phases["detected"] = time.time()
            incident.detail.update({"failed_saves": 0, "first_failed_step": message.step})
            self._incidents.append(incident)
            self.open = incident
        incident.detail["failed_saves"] = int(incident.detail.get("failed_saves", 0)) + 1
        incident.detail.update({
            "last_failed_step": message.step, "kind": message.kind, "os_error": message.os_error,
            "last_error": message.error,
        })
        self._events.incident(incident)
        return incident

    def saved(self, message: CheckpointSaved) -> Incident | None:
        """A save committed: the open incident, if any, is over (its steps are safe again)."""
        incident = self.open
        if incident is None:
            return None
        self.open = None
        incident.settle(IncidentStatus.RECOVERED)
        incident.phases["checkpoint_written"] = message.t
        incident.detail["recovered_by_step"] = message.step
        self._events.incident(incident)
        return incident

    def close(self) -> None:
        """The job ended: a run of failures still open ended without a save that worked."""
        incident = self.open
        if incident is None:
            return
        self.open = None
        incident.settle(IncidentStatus.FAILED)
        incident.detail["closed"] = "the job ended before a save succeeded"
        self._events.incident(incident)

    def warning(self, last_step: int, checkpoint_step: int | None) -> str:
        """For the final status of a job that ended while its saves failed; "" when they did not."""
        if self.open is None:
            return ""
        saves = int(self.open.detail.get("failed_saves", 1))
        why = self.last_os_error or self.last_error
        if checkpoint_step is None:
            where = "there is no checkpoint of this job"
        else:
            behind = max(0, last_step - checkpoint_step)
            where = (f"the newest checkpoint is of step {checkpoint_step}, {behind} "
                     f"step(s) before the last")
        return f"; warning: the last {saves} checkpoint save attempt(s) failed ({why}); {where}"

    def view(self) -> dict[str, Any]:
        return {
            "failures": self.failures,
            "failing": self.failing,
            "last_error": self.last_error,
            "last_os_error": self.last_os_error,
            "last_failed_step": self.last_failed_step,
            "incident": self.open.id if self.open is not None else None,
        }


def resume_line(preemption: dict[str, Any]) -> str:
    """The last line of a preempted run: what the same command resumes from,
    and how many steps it re-runs."""
    step = int(preemption.get("checkpoint_step", -1))
    if step < 0:
        return "exit 143: no checkpoint to resume from; the same command starts again at step 1"
    reruns = int(preemption.get("resume_reruns", 0))
    if not reruns:
        return f"exit {EXIT_PREEMPTED}: the same command resumes after step {step}, no step re-run"
    return (f"exit {EXIT_PREEMPTED_BEHIND}: the same command resumes after step {step} and "
            f"re-runs {reruns} step(s) ({step + 1}..{step + reruns}): the dying gasp of the stop "
            "step was not written")
