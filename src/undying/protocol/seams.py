"""What the manager's parts ask of a node, so they need not know how the node is reached.

``AgentHandle`` is the manager's slot of one node
(``undying.manager.node_slot.NodeSlot``): each call becomes a command of
``undying.protocol.node_wire`` on the node's line, whether its agent is on
another host or in the launcher's own process (``undying.launch.in_process``).
The agent answers in reports of the same wire. The messages are the contract;
this is the manager's handle on them (and what its unit tests stand in for).
"""

from __future__ import annotations

import signal
from typing import Any, Protocol

from undying.protocol.codec import Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.worker_wire import ArmFault, TraceSet

__all__ = ["AgentHandle"]


class AgentHandle(Protocol):
    """What the manager asks of the agent of one node."""

    node: int

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool,
              resume_from: str = "", incarnation: int = 0) -> tuple[int, bool]: ...

    def tell(self, rank: int, message: Message) -> bool: ...

    def live_ranks(self) -> list[int]: ...

    def kill(self, rank: int, sig: signal.Signals) -> bool: ...

    def arm(self, rank: int, fault: ArmFault) -> None: ...

    def abort(self, rank: int, generation: int, reason: str, *,
              at_step_start: bool = False, from_step: int = 0) -> bool: ...

    def keep_spares(self) -> None: ...

    def spares_ready(self) -> int: ...

    async def stop_all(self, grace_s: float) -> None: ...

    def set_trace(self, switch: TraceSet) -> None: ...

    def phases(self) -> dict[int, str]: ...

    def view(self) -> dict[str, Any]: ...

    @property
    def attached(self) -> bool:
        """The node's agent is here (one across the network may be gone; a standalone one always
        is)."""
        ...

    def drop_waiting(self) -> None:
        """Forget spawns kept for an agent yet to come (the job regroups without them)."""
        ...
