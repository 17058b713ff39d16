"""The manager's side of agents on other hosts: one TCP connection per node.

Each node has a slot (``NodeSlot``, ``node_slot.py``) that the manager drives
exactly as it drives the in-process agent of a standalone run (the
``AgentHandle`` calls become messages). A slot outlives its connection: when a node is lost, the
ranks it held are recovered like crashed ranks, the spawns of their
replacements wait in the slot, and the next agent that joins for that node
(a replacement host, as Kubernetes would start one) picks them up.

Membership is fenced by sessions. Every agent that joins gets a new session;
one that lost its connection may come back with its session only while the
manager still counts it as the node's agent. Once the node was declared lost,
the old session is stale: that agent is told it is fenced, kills its workers
and may join again as a new member. Its workers are fenced on their own too,
by the rank ownership keys the manager writes on the control store
(``rank/<r>/owner``), so a stale rank can never enter a newer generation.

A node's silence is judged only over time the manager ran (``clock``,
``protocol/judge_clock.py``): after a stall of the manager itself every node
gets a fresh window, and a connection that closes right then (its agent, which
heard nothing, connecting again) is judged by that window, not lost at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from undying.manager.conns import QuietLog, read_line
from undying.manager.node_reports import NodeEvents, NodeReports
from undying.manager.node_slot import NodeSlot
from undying.manager.standbys import Parked, SlotFacts, Standbys
from undying.protocol.codec import MessageError
from undying.protocol.judge_clock import JudgeClock
from undying.protocol.node_wire import (
    Acked,
    AgentFenced,
    AgentJoin,
    AgentRefused,
    AgentWelcome,
    ManagerBeat,
    NumberedReports,
    StandbyBeat,
    StandbyJoin,
    StandbyParked,
    decode_from_agent,
    encode,
)

__all__ = ["NodeSlot", "AgentServer", "JobFacts", "NodeEvents", "JoinCheck", "MANAGER_BEAT_S"]

log = logging.getLogger("undying.manager.nodes")
# Lines about floods of connections to the agents' port: a few a minute, then a count.
_flood_log = logging.getLogger("undying.manager.nodes.flood")
_flood_log.addFilter(QuietLog())

# How often the manager tells each agent it is alive (an agent that hears nothing
# for its heartbeat timeout reconnects), and how often the watch looks for silent nodes.
MANAGER_BEAT_S = 0.5
_WATCH_S = 0.2
# A line longer than this is no agent's message: the connection is dropped.
_LINE_LIMIT = 16 * 1024 * 1024
# Before a connection has joined, its line (the join: a few KB of flags) may be at most this long,
# so that connections nobody has vouched for cannot make the manager hold _LINE_LIMIT each.
_JOIN_LIMIT = 64 * 1024


# Checks a join against the job (token, job id, node range, flags); returns a refusal or "".
JoinCheck = Callable[[AgentJoin], str]


@dataclass(frozen=True)
class JobFacts:
    """What the agents' server learns only once the job's manager exists (``AgentServer.bind``).

    The server listens before any manager does: the first agent's join carries
    the flags that make the job's config, and the manager is built from that.
    """

    events: NodeEvents  # the manager: every report and every coming and going goes to it
    nnodes: int
    heartbeat_s: float  # the job's --heartbeat-timeout: a node silent this long is lost
    control_port: int  # told to every agent that joins, with the job dir
    job_dir: str
    # Hosts where no standby is placed (drained); none when not given.
    blocked_hosts: Callable[[], set[str]] = set
    # A restarted manager's: the sessions its agents may resume (read back from its log).
    known_sessions: dict[int, str] = field(default_factory=dict)


class AgentServer:
    """Accepts agents, checks them, and turns their messages into the manager's calls."""

    def __init__(self, host: str, port: int, check: JoinCheck, *, heartbeat_s: float,
                 max_connections: int = 256, join_wait_s: float = 10.0,
                 acked: dict[int, int] | None = None) -> None:
        self.host = host
        # A connection that sends no join line within this long is no agent: it is closed.
        self.join_wait_s = join_wait_s
        # Open connections at most: at the cap, the oldest one that has not joined yet is closed for
        # a new one (a flood of silent sockets cannot use up the manager's files nor lock a node
        # out).
        self.max_connections = max_connections
        self._unjoined: dict[asyncio.StreamWriter, float] = {}
        self.port = port
        self._check = check
        # The watch's own clock: a node's silence counts only while this manager ran
        # (protocol/judge_clock.py).
        self.clock = JudgeClock(_WATCH_S, heartbeat_s, "the manager")
        self.slots: dict[int, NodeSlot] = {}
        self._events: NodeEvents | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._first_join: asyncio.Future[AgentJoin] | None = None
        self._joined = asyncio.Event()
        self._connections: set[asyncio.StreamWriter] = set()
        self._closed = False
        # Sessions the manager restored from its log: an agent may resume these (a manager restart).
        self.known_sessions: dict[int, str] = {}
        self.on_change: Callable[[], None] = lambda: None
        # Per node, the newest report taken in its current session, and the newest in the log
        # (``acked``: a restarted manager's, read back from its log before any manager exists).
        self.received: dict[int, int] = dict(acked or {})
        self.persisted: dict[int, int] = dict(self.received)
        self.control_port, self.job_dir = 0, ""  # told to every agent that joins (``bind``)
        # each agent report to the manager's act
        self.reports = NodeReports(self._node_events, self.lose)
        # Warm standby agents with no node yet (``undying run --standby``): given lost nodes as they
        # go.
        self.standbys = Standbys(self._seat,
                                 lambda what, detail: self._node_events().on_standby(what, detail),
                                 self.clock)

    @property
    def heartbeat_s(self) -> float:
        """A node silent this long (while the manager ran) is lost; the job's flag, given by
        ``bind``."""
        return self.clock.window_s

    async def start(self) -> int:
        self._first_join = asyncio.get_running_loop().create_future()
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  limit=_JOIN_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        # The clock runs from here, not from the watch's first pass: a stall before that pass (a
        # restarted manager's restore from its log, or a pause right after its start) is a stall of
        # the judge too.
        self.clock.tick()
        self._spawn_task(self._beat_and_watch())
        return self.port

    def bind(self, job: JobFacts) -> None:
        """From now on, joins become nodes of this manager's job.

        One call with every fact the server lacked when it started listening
        (it exists before the first join makes the job's config, and so before
        the manager): the joins that wait meanwhile go on once it returns.
        """
        self.clock.window_s = job.heartbeat_s
        self.control_port = job.control_port
        self.job_dir = job.job_dir
        self.standbys.blocked = job.blocked_hosts
        self.known_sessions = dict(job.known_sessions)
        for node in range(job.nnodes):
            self.slots.setdefault(node, NodeSlot(node))
        self._events = job.events

    async def first_join(self) -> AgentJoin:
        """The first agent's join, before any manager exists: it carries the job's flags."""
        assert self._first_join is not None
        return await self._first_join

    async def all_joined(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not all(s.attached for s in self.slots.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._joined.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._joined.wait(), remaining)
        return True

    async def close(self) -> None:
        self._closed = True  # the job is over: connections closing now are no node loss
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        for task in list(self._tasks):
            task.cancel()

    def positions(self) -> dict[str, int]:
        """Called as the log commits: every report taken so far goes into this very transaction."""
        self.persisted = dict(self.received)
        return {str(n): seq for n, seq in self.received.items()}

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _beat_and_watch(self) -> None:
        """Beat to every attached agent; a node silent past the heartbeat timeout, while this
        manager ran, is lost.

        After a stall of the manager itself (``clock``), every node gets a fresh
        window: its words waited in the socket while the manager did not read.
        """
        last_beat = 0.0
        while True:
            await asyncio.sleep(_WATCH_S)
            self.clock.tick()
            now = time.time()
            beat = b""
            if now - last_beat >= MANAGER_BEAT_S:
                last_beat = now
                beat = encode(ManagerBeat(now))  # the same for every node
            self.standbys.beat(beat, self.heartbeat_s)
            for slot in list(self.slots.values()):
                if not slot.attached:
                    continue
                silent = self.clock.silent_s(slot.heard)
                if silent > self.heartbeat_s:
                    self.lose(slot, f"node {slot.node} ({slot.host}) silent for {silent:.1f}s "
                               f"(heartbeat timeout {self.heartbeat_s:g}s)")
                elif beat:
                    slot.send_line(beat + encode(Acked(self.persisted.get(slot.node, 0))))

    def _connection_ended(self, slot: NodeSlot, reason: str) -> None:
        """The node's connection closed or failed: the node is lost, unless this manager itself just
        stalled.

        An agent that heard nothing from a stopped manager for its heartbeat
        timeout connects again with its session (agent/remote.py), and its old
        connection's close waits in the manager's socket with the new join. Right
        after a stall of its own (``clock.fresh``) the manager judges such a node
        by its silence, in the node's fresh window: an agent that comes back
        within it resumes its session, one that does not is lost at its end.
        """
        if self.clock.fresh():
            log.warning("node %d: %s, right after this manager's own stall of %.1fs: the node has "
                        "a fresh %gs window to come back before it is lost", slot.node, reason,
                        self.clock.last_stall_s, self.heartbeat_s)
            return
        self.lose(slot, reason)

    def lose(self, slot: NodeSlot, reason: str) -> None:
        if self._closed:
            return
        log.warning("node %d lost: %s", slot.node, reason)
        slot.detach(reason)
        self.on_change()
        if self._events is not None:
            self._events.on_node_lost(slot.node, reason, time.time())
            # a warm standby takes the node: the replacements waiting in the slot go to it
            self.place_standbys()

    def place_standbys(self) -> None:
        """Lost nodes to parked standbys (``standby.promotions`` decides which to which)."""
        facts = [SlotFacts(s.node, s.attached, s.lost_at) for s in self.slots.values()]
        self.standbys.place(facts, self.heartbeat_s, closed=self._closed or self._events is None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections:
            if not self._unjoined:
                _flood_log.warning(
                    "agents' port: %d connections, every one a node's: refused a new one",
                    len(self._connections))
                writer.close()
                return
            oldest = min(self._unjoined, key=self._unjoined.__getitem__)
            del self._unjoined[oldest]
            oldest.close()
            _flood_log.warning("agents' port: %d connections (the cap): closed the oldest that had "
                               "not joined", len(self._connections))
        self._connections.add(writer)
        self._unjoined[writer] = time.monotonic()
        slot: NodeSlot | None = None
        # (first: the line a standby given a node sent first as the node's agent)
        session, first = "", b""
        try:
            line = await asyncio.wait_for(read_line(reader, _JOIN_LIMIT), self.join_wait_s)
            self._unjoined.pop(writer, None)
            join = decode_from_agent(line) if line else None
            if not isinstance(join, (AgentJoin, StandbyJoin)):
                return  # not an agent: nothing to say to it
            if isinstance(join, StandbyJoin):
                parked = await self._park(join.join, writer)
                try:  # (it passed the gate: its lines may be a node's, 16 MiB)
                    first = (await self.standbys.serve(parked, reader, _LINE_LIMIT)
                             if parked is not None else b"")
                # given a node: from now on (a failed read included) the connection is the node's
                finally:
                    if parked is not None and parked.seated is not None:
                        slot, session = self.slots[parked.seated[0]], parked.seated[1]
            else:
                slot, session = await self._admit(join, writer)
            if slot is None:
                return
            while True:
                line, first = first or await read_line(reader, _LINE_LIMIT), b""
                # This connection speaks for the node only while it is the slot's: the agent may
                # have resumed its session on a new one (then closing this one is no loss), or been
                # fenced.
                current = slot.session == session and slot.writer is writer
                if not line:
                    if current:
                        self._connection_ended(slot, f"node {slot.node} ({slot.host}): its agent's "
                                                     "connection closed")
                    return
                if not current:
                    return  # fenced, or resumed elsewhere meanwhile: whatever it says here is stale
                slot.heard_from()
                try:
                    reports = decode_from_agent(line)
                except MessageError as e:
                    log.warning("node %d: dropped a bad message: %s", slot.node, e)
                    continue
                if isinstance(reports, StandbyBeat):
                    continue  # a standby's last beat, sent as it was given this node
                if not isinstance(reports, NumberedReports):  # (a second AgentJoin)
                    log.warning("node %d: dropped an unexpected %s", slot.node,
                                type(reports).__name__)
                    continue
                assert self._events is not None
                self.reports.take(slot, session, writer, reports, self.received)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                ValueError) as e:
            if slot is not None and slot.session == session and session and slot.writer is writer:
                self._connection_ended(slot, f"node {slot.node} ({slot.host}): connection failed "
                                             f"({type(e).__name__}: {e})")
        finally:
            self._connections.discard(writer)
            self._unjoined.pop(writer, None)
            writer.close()

    async def _admit(self, join: AgentJoin,
                     writer: asyncio.StreamWriter) -> tuple[NodeSlot | None, str]:
        refusal = self._check(join)
        if refusal:
            log.warning("refused an agent from %s (node %d): %s", join.host, join.node, refusal)
            writer.write(encode(AgentRefused(refusal)))
            await writer.drain()
            return None, ""
        if self._events is None:
            # No manager yet: the first agent's flags make the job. Wait until it is bound.
            assert self._first_join is not None
            if not self._first_join.done():
                self._first_join.set_result(join)
            while self._events is None:
                await asyncio.sleep(0.01)
            refusal = self._check(join)  # now against the job its flags made
            if refusal:
                writer.write(encode(AgentRefused(refusal)))
                await writer.drain()
                return None, ""
        slot = self.slots[join.node]
        if join.session:
            current = slot.session or self.known_sessions.get(join.node, "")
            if join.session != current:
                lost = " (" + slot.lost_reason + ")" if slot.lost_reason else ""
                reason = (f"node {join.node}'s session {join.session} is stale: the node was "
                          f"declared lost{lost} and its ranks given away; stop every worker and "
                          "join again")
                log.warning("fenced the agent of node %d on %s: %s", join.node, join.host, reason)
                writer.write(encode(AgentFenced(reason)))
                await writer.drain()
                return None, ""
            session = join.session  # the same agent, back after a blip or a manager restart
            self.known_sessions.pop(join.node, None)
            self.received.setdefault(join.node, 0)
            if slot.writer is not None and slot.writer is not writer:
                slot.writer.close()  # its old connection: the agent already gave it up
        else:
            # (closed in a fresh window: see _connection_ended)
            if slot.writer is not None and slot.writer.is_closing():
                self.lose(slot, f"node {join.node} ({slot.host}): its agent's connection closed "
                                f"and a new agent joined for the node from {join.host}")
            if slot.attached:
                refusal = (f"node {join.node} already has an agent ({slot.host}, pid {slot.pid}); "
                           f"pass another --node-rank (0..{len(self.slots) - 1})")
                writer.write(encode(AgentRefused(refusal)))
                await writer.drain()
                return None, ""
            return slot, self._seat(join.node, join, writer)
        self._welcome(slot, join, writer, session)
        return slot, session

    def _seat(self, node: int, join: AgentJoin, writer: asyncio.StreamWriter) -> str:
        """A new agent for ``node`` (a host joining, or a standby given the node): a new session."""
        session = secrets.token_hex(8)
        self.received[node] = 0  # a new member numbers its reports from 1
        self._welcome(self.slots[node], join, writer, session)
        return session

    def _welcome(self, slot: NodeSlot, join: AgentJoin, writer: asyncio.StreamWriter,
                 session: str) -> None:
        events = self._node_events()
        slot.attach(writer, join, session)
        writer.write(encode(AgentWelcome(session, slot.node, self.control_port, self.job_dir,
                                         events.welcome_trace(),
                                         acked=self.received.get(slot.node, 0))))
        slot.send_waiting()
        log.info("node %d joined from %s (agent pid %d, session %s)", slot.node, join.host,
                 join.pid, session)
        events.on_node_joined(slot.node, session, join.host, slot.live)
        self._joined.set()
        self.on_change()

    async def _park(self, join: AgentJoin, writer: asyncio.StreamWriter) -> Parked | None:
        """A standby's join: checked as a node's would be (any node number), parked, maybe given a
        lost node."""
        while self._events is None:  # (the job's flags come from a node's join, never a standby's)
            await asyncio.sleep(0.05)
        parked = await self.standbys.park(join, writer, self._check,
                                          StandbyParked(self.control_port, self.job_dir,
                                                        self._node_events().welcome_trace()))
        self.place_standbys()  # a node lost before it came: it is given one at once
        return parked

    def _node_events(self) -> NodeEvents:
        assert self._events is not None
        return self._events
