"""The manager's slot of one node: its agent's line when it has one, the commands waiting otherwise.

Every node of every job is driven through a slot: each ``AgentHandle`` call
becomes a ``protocol/node_wire.py`` command on the node's line, a TCP
connection to an agent on another host (``manager/nodes.py`` says how nodes
join, are lost and come back; a slot outlives its connection) or the
in-process line to the agent of ``undying run`` on one node
(``launch/in_process.py``). What the agent answers comes back as its reports
(``manager/node_reports.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import typing
from dataclasses import dataclass, field
from typing import Any, Protocol

from undying.protocol.codec import Message, MessageError
from undying.protocol.generations import GenerationRecord
from undying.protocol.node_wire import (
    AbortRank,
    AgentJoin,
    AgentState,
    ArmRank,
    KeepSpares,
    KillRank,
    RankSpawned,
    SpawnRank,
    StopNode,
    TellRank,
    encode,
)
from undying.protocol.seams import AgentHandle
from undying.protocol.worker_wire import COMMANDS, ArmFault, TraceSet, WorkerCommand

__all__ = ["NodeSlot", "Line"]


class Line(Protocol):
    """Where a slot writes its commands (encoded lines): a node's connection, or the in-process
    line."""

    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...

    async def drain(self) -> None: ...


@dataclass
class NodeSlot:
    """The slot of one node: its agent's line when it has one (TCP or in-process), the commands
    waiting otherwise."""

    node: int
    session: str = ""
    host: str = ""
    pid: int = 0
    writer: Line | None = None
    last_heard: float = 0.0  # wall clock, for people (the status); judged by ``heard``
    # monotonic: the agent's last word, as the manager's judge clock counts silence
    heard: float = 0.0
    joined_at: float = 0.0
    lost_at: float = 0.0
    lost_reason: str = ""
    live: dict[int, int] = field(default_factory=dict)
    _phases: dict[int, str] = field(default_factory=dict)
    _spares: int = 0
    _zygote_pid: int = 0
    # rank -> the process the node gave it
    _answers: dict[int, RankSpawned] = field(default_factory=dict)
    _waiting: list[SpawnRank] = field(default_factory=list)
    _stops: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    _seq: int = 0

    # --- the AgentHandle calls ------------------------------------------------

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool, resume_from: str = "",
              incarnation: int = 0) -> tuple[int, bool]:
        """Ask the node for a process; its PID comes back in RankSpawned (0 until then).

        On the in-process line the answer comes before this returns: then it is returned too.
        """
        command = SpawnRank(rank, record, joining, resume_from, incarnation)
        self._answers.pop(rank, None)
        if self.writer is None:
            self._waiting.append(command)  # for the agent that takes this node next
        else:
            self.send(command)
        answer = self._answers.pop(rank, None)
        if answer is None or answer.incarnation != incarnation:
            return 0, False
        return answer.pid, answer.warm

    def tell(self, rank: int, message: Message) -> bool:
        if not isinstance(message, COMMANDS):
            raise MessageError(f"{type(message).__name__} is no command a worker takes "
                               "(worker_wire.WorkerCommand)")
        if rank not in self.live:
            return False
        return self.send(TellRank(rank, typing.cast(WorkerCommand, message)))

    def live_ranks(self) -> list[int]:
        return sorted(self.live)

    def kill(self, rank: int, sig: signal.Signals) -> bool:
        if rank not in self.live:
            return False
        return self.send(KillRank(rank, int(sig)))

    def arm(self, rank: int, fault: ArmFault) -> None:
        self.send(ArmRank(rank, fault))

    def abort(self, rank: int, generation: int, reason: str, *,
              at_step_start: bool = False, from_step: int = 0) -> bool:
        if rank not in self.live:
            return False
        return self.send(AbortRank(rank, generation, reason, at_step_start, from_step))

    def keep_spares(self) -> None:
        self.send(KeepSpares())

    def spares_ready(self) -> int:
        return self._spares if self.writer is not None else 0

    async def stop_all(self, grace_s: float) -> None:
        """Stop the node's workers; a node that is gone, or stays silent past the grace, counts as
        stopped (so does one whose connection closed while it has a window to come back: nothing can
        answer on it)."""
        if self.writer is None or self.writer.is_closing():
            return
        self._seq += 1
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stops[self._seq] = done
        self.send(StopNode(grace_s, self._seq))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), grace_s + 5.0)
        self._stops.pop(self._seq, None)
        self.live.clear()

    def set_trace(self, switch: TraceSet) -> None:
        self.send(switch)

    def phases(self) -> dict[int, str]:
        return {r: p for r, p in self._phases.items() if r in self.live}

    # --- the connection -------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self.writer is not None

    def heard_from(self) -> None:
        """A line came from the node's agent."""
        self.last_heard = time.time()
        self.heard = time.monotonic()

    def send(self, message: Message) -> bool:
        return self.send_line(encode(message))

    def send_line(self, line: bytes) -> bool:
        """Encoded messages (a beat round encodes its ManagerBeat once for every node)."""
        if self.writer is None or self.writer.is_closing():
            return False
        self.writer.write(line)
        return True

    def attach(self, writer: Line, join: AgentJoin, session: str) -> None:
        self.attach_line(writer, host=join.host, pid=join.pid, session=session)
        self.live = {int(r): pid for r, pid in join.live.items()}

    def attach_line(self, writer: Line, *, host: str, pid: int, session: str) -> None:
        """The node's agent is on ``writer`` now (its join said who it is)."""
        self.writer = writer
        self.session = session
        self.host = host
        self.pid = pid
        self.joined_at = self.last_heard = time.time()
        self.heard = time.monotonic()

    def send_waiting(self) -> None:
        """The spawns that waited for an agent on this node (replacements for the ranks it lost)."""
        waiting, self._waiting = self._waiting, []
        for command in waiting:
            self.send(command)

    def drop_waiting(self) -> None:
        """The job regroups without this node's old ranks: no agent that takes the node gets
        them."""
        self._waiting.clear()

    def detach(self, reason: str) -> None:
        """The node is lost: its connection closes, its session is stale, nothing it held is
        live."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
        self.session = ""
        self.lost_at = time.time()
        self.lost_reason = reason
        self.live.clear()
        self._phases.clear()
        for done in self._stops.values():
            if not done.done():
                done.set_result(None)

    def view(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "attached": self.attached,
            "host": self.host,
            "agent_pid": self.pid,
            "zygote_pid": self._zygote_pid,
            "ranks": sorted(self.live),
            "last_heard": self.last_heard,
            "joined_at": self.joined_at,
            "lost_at": self.lost_at or None,
            "lost_reason": self.lost_reason,
            "waiting_spawns": [c.rank for c in self._waiting],
        }

    def stopped(self, seq: int) -> None:
        """The node's answer to StopNode ``seq``."""
        done = self._stops.get(seq)
        if done is not None and not done.done():
            done.set_result(None)

    def on_state(self, message: AgentState) -> None:
        self.live = {int(r): pid for r, pid in message.live.items()}
        self._phases = {int(r): p for r, p in message.phases.items()}
        self._spares = message.spares_ready
        self._zygote_pid = message.zygote_pid

    def answered(self, message: RankSpawned) -> None:
        """The node's answer to a SpawnRank (or the process of a stuck spare's rank)."""
        self.live[message.rank] = message.pid
        self._answers[message.rank] = message


def _satisfies_the_seam(slot: NodeSlot) -> AgentHandle:
    """(For mypy: a remote node's slot is what the manager drives,
    ``protocol.seams.AgentHandle``.)"""
    return slot
