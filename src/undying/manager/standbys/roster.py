"""The manager's side of warm standby agents: parked connections,
each waiting to be given a lost node.

A standby's agent joins with ``node`` = ``STANDBY_NODE``. It is checked as any
agent is (token, job, flags), told ``StandbyParked`` with what its zygote
and spares need, and then only beats (``StandbyBeat``) while the manager
beats it back. ``policy.promotions`` (a pure function) says which standby
takes which lost node; this roster carries it out with the agent server's
``seat`` (the same as a new agent joining for the node: a new session, an
``AgentWelcome`` with the node's number, the spawns that waited for the node),
after which the connection is that node's like any other.

A standby silent past the heartbeat timeout is dropped (its host cut off); a
killed one closes its connection. Neither is a fault of the job: a standby
holds no rank. Its silence is judged as a node's is, by the agent server's
judge clock (``protocol/judge_clock.py``): only over time the manager ran, with
a fresh window after a stall of the manager itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from undying.manager.conns import read_line
from undying.manager.standbys.policy import Promote, SlotFacts, StandbyFacts, promotions
from undying.protocol.codec import MessageError
from undying.protocol.judge_clock import JudgeClock
from undying.protocol.node_wire import (
    AgentJoin,
    AgentRefused,
    StandbyBeat,
    StandbyParked,
    decode_from_agent,
    encode,
)

__all__ = ["Parked", "Standbys"]

log = logging.getLogger("undying.manager.nodes")


@dataclass
class Parked:
    """One standby's connection while it has no node."""

    key: int
    join: AgentJoin
    writer: asyncio.StreamWriter
    parked_at: float = field(default_factory=time.time)
    # wall clock, for people; judged by ``heard``
    last_heard: float = field(default_factory=time.time)
    heard: float = field(default_factory=time.monotonic)
    spares_ready: int = 0
    # Set when it is given a node: (the node, its session); the connection is then the node's.
    seated: tuple[int, str] | None = None

    def view(self) -> dict[str, Any]:
        return {"standby": self.key, "host": self.join.host, "agent_pid": self.join.pid,
                "spares_ready": self.spares_ready, "parked_at": self.parked_at,
                "last_heard": self.last_heard}


# seat(node, join, writer) -> the session: attach the connection to the node's slot as its new
# agent.
Seat = Callable[[int, AgentJoin, asyncio.StreamWriter], str]
# record(what, detail): the job's event log.
Record = Callable[[str, dict[str, Any]], None]


class Standbys:
    """The parked standbys of one manager."""

    def __init__(self, seat: Seat, record: Record, clock: JudgeClock | None = None) -> None:
        self.parked: dict[int, Parked] = {}
        # The manager's judge clock (the agent server's, which ticks it); a roster alone gets its
        # own.
        self.clock = clock or JudgeClock(0.2, 30.0, "the manager's standby roster")
        self._seat = seat
        self._record = record
        self._next = 0
        # () -> the hosts drained or quarantined (manager/placement/hosts.py): a standby parked
        # there is not promoted.
        self.blocked: Callable[[], set[str]] = set

    async def park(self, join: AgentJoin, writer: asyncio.StreamWriter,
                   check: Callable[[AgentJoin], str], welcome: StandbyParked) -> Parked | None:
        """A standby's join, checked as a node's would be (any node number): refused,
        or parked and told so."""
        refusal = check(msgspec.structs.replace(join, node=0))
        if refusal:
            log.warning("refused a standby agent from %s: %s", join.host, refusal)
            writer.write(encode(AgentRefused(refusal)))
            await writer.drain()
            return None
        self._next += 1
        parked = Parked(self._next, join, writer)
        self.parked[parked.key] = parked
        writer.write(encode(welcome))
        log.info("standby %d parked, from %s (agent pid %d)", parked.key, join.host, join.pid)
        self._record("standby_parked", {"standby": parked.key, "host": join.host, "pid": join.pid})
        return parked

    async def serve(self, parked: Parked, reader: asyncio.StreamReader, line_limit: int) -> bytes:
        """Its beats until it is given a node;
        returns the first line it sent as the node's agent (b"": gone)."""
        try:
            while parked.seated is None:
                line = await read_line(reader, line_limit)
                if not line:
                    return b""
                if parked.seated is not None:
                    return line  # written after its welcome: the node's first report
                parked.last_heard, parked.heard = time.time(), time.monotonic()
                try:
                    beat = decode_from_agent(line)
                except MessageError as e:
                    log.warning("standby %d: dropped a bad message: %s", parked.key, e)
                    continue
                if isinstance(beat, StandbyBeat):
                    parked.spares_ready = beat.spares_ready
            return await read_line(reader, line_limit)
        finally:
            if parked.seated is None:
                self.drop(parked, "its connection closed")

    def drop(self, parked: Parked, why: str) -> None:
        if self.parked.pop(parked.key, None) is None:
            return
        parked.writer.close()
        log.info("standby %d (%s) dropped: %s", parked.key, parked.join.host, why)
        self._record("standby_dropped", {"standby": parked.key, "host": parked.join.host,
                                         "why": why})

    def beat(self, line: bytes, silence_limit_s: float) -> None:
        """The manager's beat to every parked standby; one silent past the limit
        (while the manager ran) is dropped."""
        for parked in list(self.parked.values()):
            silent = self.clock.silent_s(parked.heard)
            if silent > silence_limit_s:
                self.drop(parked, f"silent for {silent:.1f}s "
                                  f"(heartbeat timeout {silence_limit_s:g}s)")
            elif line and not parked.writer.is_closing():
                parked.writer.write(line)

    def place(self, slots: list[SlotFacts], silence_limit_s: float, *,
              closed: bool = False) -> list[Promote]:
        """Give lost nodes to standbys (``policy.promotions`` decides); returns what was done."""
        out = self.blocked()
        facts = [StandbyFacts(p.key, p.spares_ready, p.parked_at, self.clock.silent_s(p.heard))
                 for p in self.parked.values() if p.join.host not in out]
        done = promotions(slots, facts, silence_limit_s=silence_limit_s, closed=closed)
        for promote in done:
            parked = self.parked.pop(promote.standby)
            join = msgspec.structs.replace(parked.join, node=promote.node)
            session = self._seat(promote.node, join, parked.writer)
            parked.seated = (promote.node, session)
            log.info("node %d: %s (host %s)", promote.node, promote.reason, parked.join.host)
            self._record("standby_promoted", {"standby": parked.key, "node": promote.node,
                                              "host": parked.join.host,
                                              "spares_ready": parked.spares_ready,
                                              "session": session})
        return done

    def tell_all(self, message: Any) -> None:
        """Every parked standby hears ``message`` (the job's end)."""
        line = encode(message)
        for parked in self.parked.values():
            if not parked.writer.is_closing():
                parked.writer.write(line)

    def views(self) -> list[dict[str, Any]]:
        return [p.view() for p in self.parked.values()]
