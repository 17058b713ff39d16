"""The job's trace switch and what the traces find: every rank follows one switch;
slow ranks become incidents.

The switch changes while the job runs (``undying trace on|off [--comm]``, the
API, or a switch file); the agents pass it on to their ranks at once. The comm
hooks of DDP must change at the same step on every rank, so a change of them
names a step far enough ahead for every rank to hear of it first. The ranks'
trace summaries feed the slow-rank detector; a finding is an incident to see
and act on, not one that is recovered.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, cast

from undying.jobfiles.records import Incident, IncidentDetail, IncidentKind, IncidentStatus
from undying.manager.core import JobCore
from undying.protocol.trace_switch import TraceSwitch
from undying.protocol.worker_wire import TraceSet, TraceSummary
from undying.trace.detect import Finding, SlowDetector

__all__ = ["TraceControl"]

log = logging.getLogger("undying.manager")

# How far ahead a comm-marker switch takes effect (see TraceControl._comm_switch_step).
_COMM_SWITCH_AHEAD_S = 0.5
_COMM_SWITCH_MIN_STEPS = 5
_COMM_SWITCH_MAX_STEPS = 1000


class TraceControl:
    def __init__(self, core: JobCore) -> None:
        self.core = core
        initial = core.config.trace.trace
        self.switch = TraceSwitch(step=initial != "off", comm=initial == "comm",
                                  by="start" if initial != "off" else "", t=core.started_at)
        self.error = ""
        self.comm_from_step = 0
        self._detector = SlowDetector(world_size=core.config.world_size)
        core.on_layout(self._new_layout)

    def _new_layout(self, world_size: int) -> None:
        self._detector = SlowDetector(world_size=world_size)

    def message(self) -> TraceSet:
        return TraceSet(self.switch.step, self.switch.comm, self.switch.by, self.switch.t,
                        comm_from_step=self.comm_from_step)

    def _comm_switch_step(self) -> int:
        """The step from which every rank's DDP has (or drops) the comm hook:
        far enough ahead to hear of it.

        Ranks of a synchronous job are within a step or two of the newest
        commit; the switch reaches them in milliseconds. Half a second of steps
        (at least 5) ahead leaves a wide margin and still switches within a second.
        """
        newest = self.core.book.newest_step()
        step_s = self.core.clock.median_rank_step_s()
        ahead = max(_COMM_SWITCH_MIN_STEPS,
                    math.ceil(_COMM_SWITCH_AHEAD_S / step_s) if step_s > 0 else 0)
        return newest + min(ahead, _COMM_SWITCH_MAX_STEPS)

    def set(self, switch: TraceSwitch) -> dict[str, Any]:
        """Every rank of every node follows ``switch`` (the agents pass it on at once)."""
        previous = self.switch
        self.switch = switch
        self.error = ""
        if (previous.comm and previous.step) != (switch.comm and switch.step):
            self.comm_from_step = self._comm_switch_step()
        self.core.events.event("trace_switch", step=switch.step, comm=switch.comm, by=switch.by,
                               comm_from_step=self.comm_from_step)
        if (previous.step, previous.comm) != (switch.step, switch.comm):
            log.warning("job %s: tracing %s, by %s", self.core.config.job_id, switch.describe(),
                        switch.by)
        message = self.message()
        for agent in self.core.agents.values():
            agent.set_trace(message)
        return self.status()

    def change(self, *, on: bool, comm_only: bool, by: str) -> dict[str, Any]:
        """``undying trace on|off [--comm]``: the change, and a line saying what it did."""
        switch, said = self.switch.changed(on=on, comm_only=comm_only, by=by, t=time.time())
        result = self.set(switch)
        result["message"] = said
        return result

    def on_file(self, switch: TraceSwitch) -> None:
        """The watched switch file changed (an agent read it): the switch as it says."""
        self.set(switch)

    def on_file_error(self, message: str) -> None:
        """A malformed switch file: reported, ignored; the last good setting stays."""
        self.error = message
        self.core.events.event("trace_switch_error", error=message)
        log.warning("job %s: %s; the trace switch stays %s", self.core.config.job_id, message,
                    self.switch.describe())

    def status(self) -> dict[str, Any]:
        return {**self.switch.to_dict(), "error": self.error, "comm_from_step": self.comm_from_step}

    def on_summary(self, message: TraceSummary) -> None:
        """A rank's window of step phases; slow-rank detection runs on them
        (no raw records here)."""
        for finding in self._detector.add(message.summary):
            self._on_slow(finding)

    def _on_slow(self, finding: Finding) -> None:
        """A slow rank or node: an incident to see and act on; nothing is recovered,
        the job trains on."""
        core = self.core
        now = time.time()
        incident = Incident(
            id=len(core.incidents) + 1, kind=IncidentKind(finding.kind), rank=finding.rank,
            step=finding.since_step, fault_t=now, recovery=0, action="report",
            status=IncidentStatus.OBSERVED, error=finding.describe(),
            detail=cast(IncidentDetail, {**finding.to_dict(), "node": finding.node}),
        )
        incident.phases["detected"] = now
        core.incidents.append(incident)
        core.events.incident(incident)
        log.warning("job %s gen %d: %s", core.config.job_id, core.generations.current,
                    finding.describe())
