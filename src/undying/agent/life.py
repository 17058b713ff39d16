"""The agent's life as one state, its moves in one table (as ``jobfiles/records.py`` holds the
job's).

What the agent does depends on where it is in its life: before it serves its
workers' channel a process starts as a fresh interpreter (no zygote is asked);
while it stops its processes nothing is judged hung and no spare is started;
while an elastic job regroups the zygote stays though the node is empty (the
job comes back at once). Each of those was a flag of its own; here they are
one state, and every event that changes it is a move in ``_MOVES``.

The events (``Event``) come from the agent's own acts and from its processes:

- ``SERVE``: its workers' channel is up (``Agent.start``), once;
- ``START_PROCESS``: a process started (a rank's or a spare's); a regroup's
  hold on the zygote ends there, the job came back;
- ``REGROUP_EXIT``: a worker of an elastic job left for a regroup (``EXIT_REGROUPED``);
- ``STOP``: ``stop_all`` began; ``RESUME``: ``resume_after_stop`` (a fenced node
  joins afresh, a StopNode answered). A stop keeps a regroup's hold, and the
  resume gives it back;
- ``CLOSE``: the agent is closed; nothing revives it.

A process starts or ends in any state, so those two events move from every
state; ``SERVE`` twice, or a stop before the agent serves, is a mistake of its
caller and raises ``IllegalMove``.
"""

from __future__ import annotations

import enum
import logging
import time

__all__ = ["AgentLife", "Event", "IllegalMove", "LifeMachine"]

log = logging.getLogger("undying.agent")


class AgentLife(str, enum.Enum):
    # built: its workers' channel is not up, a process starts as a fresh interpreter
    STARTING = "starting"
    SERVING = "serving"
    # a worker left for an elastic regroup: the zygote stays, the job comes back at once
    REGROUPING = "regrouping"
    STOPPING = "stopping"  # stopping its processes (or stopped): nothing judged, no spare started
    # stopping, and a regroup holds the zygote (given back on resume)
    STOPPING_IN_REGROUP = "stopping-in-regroup"
    CLOSED = "closed"


class Event(str, enum.Enum):
    SERVE = "serve"
    START_PROCESS = "start-process"
    REGROUP_EXIT = "regroup-exit"
    STOP = "stop"
    RESUME = "resume"
    CLOSE = "close"


_S, _E = AgentLife, Event
_MOVES: dict[tuple[AgentLife, Event], AgentLife] = {
    (_S.STARTING, _E.SERVE): _S.SERVING,
    (_S.STARTING, _E.START_PROCESS): _S.STARTING,
    (_S.STARTING, _E.REGROUP_EXIT): _S.STARTING,  # (no zygote yet to hold)
    (_S.SERVING, _E.START_PROCESS): _S.SERVING,
    (_S.SERVING, _E.REGROUP_EXIT): _S.REGROUPING,
    (_S.SERVING, _E.STOP): _S.STOPPING,
    (_S.SERVING, _E.RESUME): _S.SERVING,  # (a second StopNode's resume, the first one's done)
    (_S.REGROUPING, _E.START_PROCESS): _S.SERVING,
    (_S.REGROUPING, _E.REGROUP_EXIT): _S.REGROUPING,
    (_S.REGROUPING, _E.STOP): _S.STOPPING_IN_REGROUP,
    (_S.REGROUPING, _E.RESUME): _S.REGROUPING,
    (_S.STOPPING, _E.START_PROCESS): _S.STOPPING,  # (a spawn sent before the stop)
    (_S.STOPPING, _E.REGROUP_EXIT): _S.STOPPING_IN_REGROUP,
    (_S.STOPPING, _E.STOP): _S.STOPPING,
    (_S.STOPPING, _E.RESUME): _S.SERVING,
    (_S.STOPPING_IN_REGROUP, _E.START_PROCESS): _S.STOPPING,
    (_S.STOPPING_IN_REGROUP, _E.REGROUP_EXIT): _S.STOPPING_IN_REGROUP,
    (_S.STOPPING_IN_REGROUP, _E.STOP): _S.STOPPING_IN_REGROUP,
    (_S.STOPPING_IN_REGROUP, _E.RESUME): _S.REGROUPING,
    **{(state, _E.CLOSE): _S.CLOSED for state in AgentLife},
    **{(_S.CLOSED, event): _S.CLOSED
       for event in (_E.START_PROCESS, _E.REGROUP_EXIT, _E.STOP, _E.RESUME)},
}


class IllegalMove(RuntimeError):
    pass


class LifeMachine:
    """The agent's state, moved only by ``move``."""

    def __init__(self) -> None:
        self.state = AgentLife.STARTING
        self.since = time.monotonic()

    def move(self, event: Event) -> AgentLife:
        new = _MOVES.get((self.state, event))
        if new is None:
            raise IllegalMove(f"the agent cannot take {event.value} while {self.state.value}")
        if new is not self.state:
            log.debug("agent: %s -> %s (%s)", self.state.value, new.value, event.value)
            self.state, self.since = new, time.monotonic()
        return new

    @property
    def serving(self) -> bool:
        """Its workers' channel is up: a process may be forked by the zygote."""
        return self.state in (AgentLife.SERVING, AgentLife.REGROUPING, AgentLife.STOPPING,
                              AgentLife.STOPPING_IN_REGROUP)

    @property
    def stopping(self) -> bool:
        """Its processes are being stopped, or it is closed: no rank or spare is judged, none
        started or replaced (a spare's exit is no loss then)."""
        return self.state in (AgentLife.STOPPING, AgentLife.STOPPING_IN_REGROUP, AgentLife.CLOSED)

    @property
    def holds_zygote(self) -> bool:
        """A regroup holds the zygote though the node has no process (the job comes back at
        once)."""
        return self.state in (AgentLife.REGROUPING, AgentLife.STOPPING_IN_REGROUP)
