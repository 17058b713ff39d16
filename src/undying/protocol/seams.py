"""The two seams between a manager and its agents, so neither imports the other.

``AgentHandle`` is what a manager asks of the agent of one node: the
in-process ``undying.agent.Agent`` of a standalone run, or the manager's slot
for an agent on another host (``undying.manager.nodes.RemoteAgent``), which
turns each call into a message of ``undying.protocol.node_wire``.
``ManagerLink`` is what an agent reports to its manager: the in-process
``Manager``, or ``undying.agent.remote.ManagerClient``, which sends each call
as a report. Only the launcher (``undying.agent.launcher``) holds both in one
process.
"""

from __future__ import annotations

import signal
from typing import Any, Protocol

from undying.protocol.codec import Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.node_wire import RankProgress
from undying.protocol.trace_switch import TraceSwitch
from undying.protocol.worker_wire import ArmFault, TraceSet

__all__ = ["AgentHandle", "ManagerLink"]


class AgentHandle(Protocol):
    """What the manager asks of the agent of one node."""

    node: int

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool,
              resume_from: str = "", incarnation: int = 0) -> tuple[int, bool]: ...

    def tell(self, rank: int, message: Message) -> bool: ...

    def live_ranks(self) -> list[int]: ...

    def kill(self, rank: int, sig: signal.Signals) -> bool: ...

    def arm(self, rank: int, fault: ArmFault) -> None: ...

    def abort(self, rank: int, generation: int, reason: str) -> bool: ...

    def keep_spares(self) -> None: ...

    def spares_ready(self) -> int: ...

    async def stop_all(self, grace_s: float) -> None: ...

    def set_trace(self, switch: TraceSet) -> None: ...

    def phases(self) -> dict[int, str]: ...

    def view(self) -> dict[str, Any]: ...

    @property
    def attached(self) -> bool:
        """The node's agent is here (one across the network may be gone; a standalone one always is)."""
        ...

    def drop_waiting(self) -> None:
        """Forget spawns kept for an agent yet to come (the job regroups without them)."""
        ...


class ManagerLink(Protocol):
    """What the agent reports to the manager (in-process when standalone)."""

    def on_exit(self, rank: int, pid: int, returncode: int, t: float) -> None: ...

    def on_message(self, message: Message) -> None: ...

    def on_hang(self, rank: int, pid: int, phase: str, last_seen: float, t: float) -> None: ...

    def on_stall(self, progress: list[RankProgress], limit: float, t: float) -> None: ...

    def on_trace_file(self, switch: TraceSwitch) -> None: ...

    def on_trace_file_error(self, message: str) -> None: ...
