"""The manager<->agent protocol's rules, on real sockets on 127.0.0.1.

The manager's side is the shipped ``AgentServer`` with the shipped join gate
of ``undying manager`` (``service._Gate``); one test runs the whole
``undying.launch.manager_service`` in-process. The agent's side is a small client
speaking the real messages, numbering its reports with the agent's own
``ManagerClient``. The one stand-in is the manager's ``NodeEvents``: a
recorder, because a real ``Manager`` would drive torch processes and here the
question is only what reached it, and how many times.

"Nothing changed" after a refusal is checked on everything a join could
touch: the node's slot (attached, session, host, pid), the reports counted
for the node, and the calls made to the manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from undying.agent.reports import ManagerClient
from undying.config import JobConfig, ManagerOptions, Timeouts
from undying.jobfiles.events import EventLog, LogReader, read_job, read_job_table
from undying.jobfiles.tokens import TOKEN_ENV
from undying.launch.manager_service import _Gate, _serve
from undying.manager.manager import Manager
from undying.manager.nodes import AgentServer, JobFacts, NodeSlot
from undying.protocol.codec import Codec, Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.node_wire import (
    Acked,
    AgentFenced,
    AgentJoin,
    AgentRefused,
    AgentState,
    AgentWelcome,
    JobEnded,
    ManagerBeat,
    NodeLeaving,
    NodeStep,
    NodeStopped,
    NumberedReports,
    RankExited,
    RankProgress,
    RankSpawned,
    SpawnRank,
    StopNode,
    decode_agent_report,
    decode_from_agent,
    decode_to_agent,
    encode,
    reports_line,
)
from undying.protocol.trace_switch import TraceSwitch
from undying.protocol.worker_wire import Fatal, Hello, Progress, StepCommitted, TraceSet

JOB = "nodes-test"
TOKEN = "test-token-0123456789"
NNODES = 2
NPROC = 2
# Every wait in a test is bounded by this; a test as a whole by TEST_LIMIT_S.
WAIT_S = 5.0
TEST_LIMIT_S = 30.0

T = TypeVar("T")


def run(body: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(body, TEST_LIMIT_S))


async def until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


class Recorder:
    """The manager's NodeEvents, recorded: what reached the manager, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.batches: list[list[str]] = []  # each on_messages call: the workers' messages it took together

    def named(self, name: str) -> list[Any]:
        return [args for n, args in self.calls if n == name]

    def on_exit(self, rank: int, pid: int, returncode: int, t: float) -> None:
        self.calls.append(("exit", (rank, pid, returncode)))

    def on_message(self, message: Message) -> None:
        self.calls.append(("message", message))

    def on_messages(self, messages: list[Message]) -> None:
        # A node's commits of a step come as one NodeStep record: recorded as the commits it carries.
        taken = [one for m in messages for one in (m.commits() if isinstance(m, NodeStep) else [m])]
        self.batches.append([type(m).__name__ for m in taken])
        for message in taken:
            self.on_message(message)

    def on_hang(self, rank: int, pid: int, phase: str, last_seen: float, t: float) -> None:
        self.calls.append(("hang", (rank, pid, phase)))

    def on_stall(self, progress: list[RankProgress], limit: float, t: float) -> None:
        self.calls.append(("stall", progress))

    def on_trace_file(self, switch: TraceSwitch) -> None:
        self.calls.append(("trace_file", switch))

    def on_trace_file_error(self, message: str) -> None:
        self.calls.append(("trace_file_error", message))

    def on_spawned(self, rank: int, pid: int, warm: bool, incarnation: int) -> None:
        self.calls.append(("spawned", (rank, pid, incarnation)))

    def on_node_lost(self, node: int, reason: str, t: float) -> None:
        self.calls.append(("lost", (node, reason)))

    def on_node_joined(self, node: int, session: str, host: str, live: dict[int, int]) -> None:
        self.calls.append(("joined", (node, session, host)))

    def welcome_trace(self) -> TraceSet:
        return TraceSet(True, False, "test", 1.0)


def job_config(job_dir: Path, **changes: Any) -> JobConfig:
    """The flags every agent of the test job passes (as `undying run` builds them)."""
    config = JobConfig(job_id=JOB, job_dir=str(job_dir), nproc_per_node=NPROC, nnodes=NNODES, spares=0)
    return dataclasses.replace(config, **changes)


def join_message(job_dir: Path, node: int, *, token: str = TOKEN, session: str = "", job_id: str = JOB,
                 config: JobConfig | None = None, live: dict[str, int] | None = None) -> AgentJoin:
    config = dataclasses.replace(config or job_config(job_dir), node_rank=max(node, 0))
    return AgentJoin(job_id=job_id, node=node, nnodes=config.nnodes, nproc_per_node=config.nproc_per_node,
                     token=token, session=session, pid=40_000 + node, host=f"host-{node}",
                     config=config.to_dict(), live=live or {}, t=time.time())


class Agent:
    """One agent's end of the connection: a join, then numbered reports (ManagerClient) and the manager's lines."""

    def __init__(self, port: int, client: ManagerClient | None = None) -> None:
        self.port = port
        self.client = client or ManagerClient()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.welcome: AgentWelcome | None = None

    async def join(self, join: AgentJoin) -> Message:
        """Connect and join; the manager's first reply. Online with the client only when welcomed."""
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.write(encode(join))
        reply = await self.read()
        if isinstance(reply, AgentWelcome):
            self.welcome = reply
            self.client.connected(self.writer, reply.acked)
        return reply

    async def read(self, timeout_s: float = WAIT_S) -> Message:
        assert self.reader is not None
        line = await asyncio.wait_for(self.reader.readline(), timeout_s)
        if not line:
            raise ConnectionError("the manager closed the connection")
        message = decode_to_agent(line)
        if isinstance(message, Acked):
            self.client.acked(message.seq)  # as NodeRunner does: the log has them, stop keeping them
        return message

    async def next(self, kind: type[T], timeout_s: float = WAIT_S) -> T:
        """The next message of ``kind``, skipping the manager's beats and whatever else comes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = await self.read(max(0.01, deadline - time.monotonic()))
            if isinstance(message, kind):
                return message

    async def acked_through(self, seq: int, timeout_s: float = 3.0) -> None:
        """Read on until the manager's Acked covers ``seq`` (an earlier beat may still carry an older position)."""
        deadline = time.monotonic() + timeout_s
        while (await self.next(Acked, max(0.01, deadline - time.monotonic()))).seq < seq:
            pass

    async def closed_by_manager(self, timeout_s: float = WAIT_S) -> bool:
        """True once the manager closed the connection (anything it sent first is skipped)."""
        assert self.reader is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = await asyncio.wait_for(self.reader.readline(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return False
            except ConnectionError:
                return True
            if not line:
                return True
        return False

    def send(self, message: Message) -> None:
        self.client.send(message)

    def send_raw(self, line: bytes) -> None:
        assert self.writer is not None
        self.writer.write(line)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.client.disconnected()


def commit(rank: int, step: int) -> StepCommitted:
    return StepCommitted(rank=rank, step=step, generation=0, t=time.time(), metrics={"loss": float(step)})


def state(node: int, live: dict[int, int]) -> AgentState:
    return AgentState(node=node, live={str(r): p for r, p in live.items()}, phases={str(r): "step" for r in live},
                      spares_ready=0, t=time.time())


async def with_server(body: Callable[[AgentServer, Recorder, Path], Awaitable[None]], job_dir: Path, *,
                      heartbeat_s: float = 30.0) -> None:
    """An AgentServer behind the real gate, bound to a job as ``undying manager`` binds it after the first join."""
    options = ManagerOptions(job_id=JOB, job_dir=str(job_dir), host="127.0.0.1", port=0, http_port=0)
    gate = _Gate(options, TOKEN)
    server = AgentServer("127.0.0.1", 0, gate, heartbeat_s=heartbeat_s)
    await server.start()
    gate.bind(dataclasses.replace(job_config(job_dir), port=server.port + 1), lambda host: "")
    recorder = Recorder()
    server.bind(JobFacts(recorder, NNODES, heartbeat_s, 12345, str(job_dir)))
    try:
        await body(server, recorder, job_dir)
    finally:
        await server.close()


def snapshot(server: AgentServer) -> list[tuple[Any, ...]]:
    """What a join may change on the manager's side."""
    return [(s.node, s.attached, s.session, s.host, s.pid, dict(s.live)) for s in server.slots.values()] + [
        (dict(server.received),)]


# --- joins the gate refuses ---------------------------------------------------------


def _refusal_cases(job_dir: Path) -> list[tuple[AgentJoin, list[str]]]:
    """Each bad join, and the words its refusal must carry (what is wrong, and what to pass)."""
    other_flags = job_config(job_dir, max_restarts=7, timeouts=Timeouts(heartbeat_timeout=5.0))
    return [
        (join_message(job_dir, 0, token="not-the-token"), ["wrong or missing token", "UNDYING_TOKEN"]),
        (join_message(job_dir, 0, token=""), ["wrong or missing token", "--token-file"]),
        (join_message(job_dir, 0, job_id="another-job"), [f"runs job {JOB!r}", "'another-job'", f"--job-id {JOB}"]),
        (join_message(job_dir, 2), ["--node-rank 2 is outside 0..1", "--nnodes 2"]),
        (join_message(job_dir, -1), ["--node-rank -1 is outside 0..1"]),
        (join_message(job_dir, 1, config=other_flags),
         ["flags differ", "max_restarts, timeouts.heartbeat_timeout", "same `undying run` flags"]),
        (join_message(job_dir, 1, config=job_config(job_dir, nproc_per_node=4)),
         ["--nproc-per-node 2", "this agent has 2 and 4"]),
    ]


def test_bad_joins_are_refused_with_the_reason_and_change_nothing(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        # One agent is in already: a refusal must not disturb it either.
        first = Agent(server.port)
        assert isinstance(await first.join(join_message(job_dir, 0)), AgentWelcome)
        first.send(state(0, {0: 100, 1: 101}))
        await until(lambda: server.slots[0].live == {0: 100, 1: 101}, "the first agent's state")
        before, calls_before = snapshot(server), list(recorder.calls)
        for join, words in _refusal_cases(job_dir):
            agent = Agent(server.port)
            reply = await agent.join(join)
            assert isinstance(reply, AgentRefused), (join, reply)
            for word in words:
                assert word in reply.reason, (word, reply.reason)
            assert await agent.closed_by_manager(), f"the connection stayed open after refusing {join}"
            assert snapshot(server) == before, reply.reason
            assert recorder.calls == calls_before, reply.reason
        # The agent that was in is still served: its reports still reach the manager.
        first.client.send(commit(0, 1))
        await until(lambda: len(recorder.named("message")) == 1, "the first agent's report after the refusals")
        first.close()

    run(with_server(body, tmp_path))


def test_a_taken_node_refuses_a_second_agent_and_keeps_the_first(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        first = Agent(server.port)
        welcome = await first.join(join_message(job_dir, 1))
        assert isinstance(welcome, AgentWelcome) and welcome.node == 1 and welcome.session
        before = snapshot(server)
        second = Agent(server.port)
        other = msgspec.structs.replace(join_message(job_dir, 1), pid=99_999, host="intruder")
        reply = await second.join(other)
        assert isinstance(reply, AgentRefused)
        assert "node 1 already has an agent (host-1, pid 40001)" in reply.reason
        assert "another --node-rank (0..1)" in reply.reason
        assert await second.closed_by_manager()
        assert snapshot(server) == before
        assert server.slots[1].session == welcome.session
        assert [args[0] for args in recorder.named("joined")] == [1]
        first.send(RankExited(2, 300, -9, time.time()))
        await until(lambda: recorder.named("exit") == [(2, 300, -9)], "the first agent's report")
        first.close()

    run(with_server(body, tmp_path))


def test_a_join_is_welcomed_with_a_session_the_control_port_and_the_trace_switch(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        welcome = await agent.join(join_message(job_dir, 0, live={"0": 500}))
        assert isinstance(welcome, AgentWelcome)
        assert (welcome.node, welcome.control_port, welcome.job_dir, welcome.acked) == (0, 12345, str(job_dir), 0)
        assert welcome.trace is not None and welcome.trace.step is True and welcome.trace.by == "test"
        slot = server.slots[0]
        assert slot.attached and slot.session == welcome.session and slot.live == {0: 500}
        assert (slot.host, slot.pid) == ("host-0", 40_000)
        assert recorder.named("joined") == [(0, welcome.session, "host-0")]
        # Sessions are not guessable from each other: a second member gets another.
        other = Agent(server.port)
        welcome_1 = await other.join(join_message(job_dir, 1))
        assert isinstance(welcome_1, AgentWelcome) and welcome_1.session != welcome.session
        assert len(welcome.session) >= 16
        # The manager beats every attached agent, and says what its log holds.
        await agent.next(ManagerBeat, timeout_s=2.0)
        assert (await agent.next(Acked, timeout_s=2.0)).seq == 0
        agent.close()
        other.close()

    run(with_server(body, tmp_path))


# --- sessions and fencing ------------------------------------------------------------


def test_a_lost_nodes_stale_session_is_fenced_and_a_fresh_join_takes_the_waiting_spawns(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        welcome = await agent.join(join_message(job_dir, 1, live={"2": 200, "3": 201}))
        assert isinstance(welcome, AgentWelcome)
        old = welcome.session
        # The manager declares the node lost (its link is cut, or it stayed silent): the connection goes.
        server.lose(server.slots[1], "node 1 cut off by the test")
        assert recorder.named("lost") == [(1, "node 1 cut off by the test")]
        assert await agent.closed_by_manager()
        slot = server.slots[1]
        assert not slot.attached and slot.session == "" and slot.live == {}
        # Its ranks' replacements wait in the slot for the next agent of node 1 (as the Manager spawns them).
        record = GenerationRecord(1, NNODES * NPROC, "127.0.0.1", 23456, reason="node 1 lost")
        assert slot.spawn(2, record, joining=True, incarnation=5) == (0, False)
        assert slot.view()["waiting_spawns"] == [2]
        # The cut-off agent comes back with its old session: fenced, nothing of it taken.
        back = Agent(server.port)
        reply = await back.join(join_message(job_dir, 1, session=old, live={"2": 200, "3": 201}))
        assert isinstance(reply, AgentFenced), reply
        assert f"session {old} is stale" in reply.reason and "node 1 cut off by the test" in reply.reason
        assert "stop every worker and join again" in reply.reason
        assert await back.closed_by_manager()
        assert not slot.attached and slot.live == {} and len(recorder.named("joined")) == 1
        # A session this manager never gave out is fenced as well.
        forged = Agent(server.port)
        assert isinstance(await forged.join(join_message(job_dir, 0, session="0123456789abcdef")), AgentFenced)
        assert not server.slots[0].attached
        # Fenced, the agent kills its workers and joins afresh: a new member, numbering from 1, given the spawns.
        fresh = Agent(server.port)
        welcome = await fresh.join(join_message(job_dir, 1))
        assert isinstance(welcome, AgentWelcome)
        assert welcome.session not in ("", old) and welcome.acked == 0
        spawn = await fresh.next(SpawnRank)
        assert (spawn.rank, spawn.joining, spawn.incarnation, spawn.record.generation) == (2, True, 5, 1)
        assert slot.view()["waiting_spawns"] == []
        fresh.close()

    run(with_server(body, tmp_path))


def test_an_agent_back_with_its_session_on_a_new_connection_keeps_its_node(tmp_path: Path) -> None:
    """The agent gave up on a silent link and connected again while the manager still held the old one.

    The manager closes the old connection; that close is no node loss. The
    welcome's ``acked`` is what the manager took, so the agent resends only
    what never arrived.
    """

    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        old = Agent(server.port)
        welcome = await old.join(join_message(job_dir, 0))
        assert isinstance(welcome, AgentWelcome)
        old.send(RankExited(0, 100, 1, 0.0))
        await until(lambda: len(recorder.named("exit")) == 1, "report 1")
        # The link goes quiet: reports 2 and 3 are kept by the agent and never reach the manager.
        old.client.disconnected()
        old.send(RankExited(0, 101, 1, 0.0))
        old.send(RankExited(0, 102, 1, 0.0))
        back = Agent(server.port, old.client)
        again = await back.join(join_message(job_dir, 0, session=welcome.session))
        assert isinstance(again, AgentWelcome) and again.session == welcome.session and again.acked == 1
        assert await old.closed_by_manager()
        await until(lambda: len(recorder.named("exit")) == 3, "the two reports kept while away")
        await asyncio.sleep(0.5)  # the old connection's end has been handled by now
        assert recorder.named("lost") == []
        assert server.slots[0].attached and server.slots[0].session == welcome.session
        assert [pid for _, pid, _ in recorder.named("exit")] == [100, 101, 102]
        back.send(RankExited(0, 103, 1, 0.0))
        await until(lambda: len(recorder.named("exit")) == 4, "a report on the new connection")
        back.close()

    run(with_server(body, tmp_path))


def test_a_node_silent_past_the_heartbeat_timeout_is_lost_and_a_beating_one_is_not(tmp_path: Path) -> None:
    heartbeat_s = 0.6

    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        silent, beating = Agent(server.port), Agent(server.port)
        assert isinstance(await silent.join(join_message(job_dir, 0)), AgentWelcome)
        joined = time.monotonic()  # the manager last heard node 0 just before its welcome
        assert isinstance(await beating.join(join_message(job_dir, 1)), AgentWelcome)

        async def beat() -> None:
            while True:
                beating.send(state(1, {2: 20, 3: 21}))
                await asyncio.sleep(0.1)

        beats = asyncio.ensure_future(beat())
        try:
            await until(lambda: bool(recorder.named("lost")), "node 0's loss", timeout_s=heartbeat_s + 3.0)
            took = time.monotonic() - joined
            node, reason = recorder.named("lost")[0]
            assert node == 0 and "silent for" in reason and f"heartbeat timeout {heartbeat_s:g}s" in reason
            # Not before the timeout (less the welcome's way here), and within it plus the watch's period
            # (0.2 s) and slack for a busy machine.
            assert heartbeat_s - 0.05 <= took < heartbeat_s + 2.0, took
            assert await silent.closed_by_manager()
            assert not server.slots[0].attached
            # The beating node stays, for several timeouts more.
            await asyncio.sleep(3 * heartbeat_s)
            assert [n for n, _ in recorder.named("lost")] == [0]
            assert server.slots[1].attached and server.slots[1].live == {2: 20, 3: 21}
        finally:
            beats.cancel()
            silent.close()
            beating.close()

    run(with_server(body, tmp_path, heartbeat_s=heartbeat_s))


def test_an_agent_that_says_it_leaves_is_lost_at_once(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        assert isinstance(await agent.join(join_message(job_dir, 0)), AgentWelcome)
        agent.send(NodeLeaving(0, "SIGTERM to the agent of node 0", time.time()))
        await until(lambda: bool(recorder.named("lost")), "node 0's loss")
        assert "is leaving: SIGTERM to the agent of node 0" in recorder.named("lost")[0][1]
        assert await agent.closed_by_manager()
        agent.close()

    run(with_server(body, tmp_path))


# --- numbered reports ----------------------------------------------------------------


def test_a_numbered_report_sent_twice_is_taken_once(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        assert isinstance(await agent.join(join_message(job_dir, 0)), AgentWelcome)
        lines = [reports_line(seq, [Codec.encode_object(RankExited(0, 100 + seq, 1, 0.0))]) for seq in (1, 2, 3)]
        # 1, 2, then 2 again (a resend after a break), 1 again (older still), then 3, then 3 again.
        for line in (lines[0], lines[1], lines[1], lines[0], lines[2], lines[2]):
            agent.send_raw(line)
        # A sentinel after them: once it is taken, every line before it was handled.
        agent.send_raw(reports_line(4, [Codec.encode_object(RankExited(1, 999, 1, 0.0))]))
        await until(lambda: (1, 999, 1) in recorder.named("exit"), "the sentinel report")
        assert recorder.named("exit") == [(0, 101, 1), (0, 102, 1), (0, 103, 1), (1, 999, 1)]
        assert server.received[0] == 4
        # The log commits them: the next beat's Acked says so, and the agent may forget them.
        assert server.positions() == {"0": 4}
        await agent.acked_through(4)
        agent.close()

    run(with_server(body, tmp_path))


def test_unnumbered_and_malformed_lines_do_not_break_the_session(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        assert isinstance(await agent.join(join_message(job_dir, 0)), AgentWelcome)
        agent.send_raw(b"{not json\n")
        agent.send_raw(b'{"type": "NoSuchMessage"}\n')
        # A worker's report with a field of the wrong type, numbered and sent as any other.
        agent.client.send(StepCommitted(rank="broken worker message", generation=0, step=1, t=0.0))  # type: ignore[arg-type]
        agent.client.send(commit(1, 7))
        await until(lambda: bool(recorder.named("message")), "the good report")
        [message] = recorder.named("message")
        assert isinstance(message, StepCommitted) and (message.rank, message.step) == (1, 7)
        assert server.slots[0].attached and not recorder.named("lost")
        agent.close()

    run(with_server(body, tmp_path))


def test_after_a_manager_restart_the_agent_resends_only_what_the_log_lacks(tmp_path: Path) -> None:
    """The welcome's ``acked`` (the restarted manager's log position) trims ManagerClient's kept reports."""

    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        # The restarted manager read from its log: node 0's agent had session S, and reports 1..3 are in the log.
        server.known_sessions = {0: "5e55105e55105e55"}
        server.received = {0: 3}
        server.persisted = {0: 3}
        # The agent kept reports 1..5 while the manager was down (none acked yet).
        client = ManagerClient()
        for step in range(1, 6):
            client.send(commit(0, step))
        assert client.has_kept()
        agent = Agent(server.port, client)
        welcome = await agent.join(join_message(job_dir, 0, session="5e55105e55105e55"))
        assert isinstance(welcome, AgentWelcome)
        assert welcome.session == "5e55105e55105e55" and welcome.acked == 3
        assert server.known_sessions == {}
        await until(lambda: len(recorder.named("message")) >= 2, "the resent reports")
        await asyncio.sleep(0.2)  # nothing more comes
        assert [m.step for m in recorder.named("message")] == [4, 5]
        # Reports after the restart number on from 6, and the log's Acked lets the agent forget them all.
        client.send(commit(0, 6))
        await until(lambda: len(recorder.named("message")) == 3, "report 6")
        assert server.received[0] == 6
        assert client.has_kept()
        assert server.positions() == {"0": 6}
        await agent.acked_through(6)
        assert not client.has_kept()
        agent.close()

    run(with_server(body, tmp_path))


class Sink:
    """A writer that keeps the lines written to it (ManagerClient's connection)."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.lines.extend(data.splitlines(keepends=True))

    def is_closing(self) -> bool:
        return False


class Tap(Sink):
    """A connection's writer that also keeps what passes through it (the lines an agent writes)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        super().__init__()
        self.writer = writer

    def write(self, data: bytes) -> None:
        super().write(data)
        self.writer.write(data)

    def is_closing(self) -> bool:
        return self.writer.is_closing()


def tap(agent: Agent) -> Tap:
    assert agent.writer is not None
    tapped = Tap(agent.writer)
    agent.client.writer = tapped  # type: ignore[assignment]
    return tapped


def reports_of(lines: list[bytes]) -> list[tuple[int, Message]]:
    """(number, report) of every report in NumberedReports lines, in order."""
    out: list[tuple[int, Message]] = []
    for line in lines:
        batch = decode_from_agent(line)
        assert isinstance(batch, NumberedReports), line
        assert encode(batch) == line  # the client frames its lines exactly as encode would
        seq = batch.first
        for body in batch.reports:
            report = decode_agent_report(body)
            # A NodeStep stands for its commits, numbered one each.
            for message in report.commits() if isinstance(report, NodeStep) else [report]:
                out.append((seq, message))
                seq += 1
    return out


def test_manager_client_keeps_reports_until_acked_and_resends_them_in_order() -> None:
    """ManagerClient alone (no event loop: each report is written as it is made): what ``connected`` writes."""
    client = ManagerClient()
    for rank in range(5):
        client.send(RankExited(rank, 10 + rank, 1, 0.0))  # offline: kept, nothing written
    sink = Sink()
    assert client.connected(sink, 2) == 3  # type: ignore[arg-type]
    assert len(sink.lines) == 1  # what the manager lacks, in one line
    assert [(seq, m.rank) for seq, m in reports_of(sink.lines)] == [(3, 2), (4, 3), (5, 4)]  # type: ignore[attr-defined]
    client.acked(4)
    client.send(RankExited(9, 19, 1, 0.0))  # online: written at once, numbered on
    assert [seq for seq, _ in reports_of(sink.lines[1:])] == [6]
    again = Sink()
    assert client.connected(again, 4) == 2  # type: ignore[arg-type]
    assert [seq for seq, _ in reports_of(again.lines)] == [5, 6]
    client.new_session()  # fenced: nothing of the old session is resent, numbering restarts
    assert not client.has_kept()
    client.disconnected()
    client.send(RankExited(0, 1, 1, 0.0))
    fresh = Sink()
    assert client.connected(fresh, 0) == 1  # type: ignore[arg-type]
    assert [seq for seq, _ in reports_of(fresh.lines)] == [1]


def test_manager_client_splits_what_it_resends_into_lines_the_manager_takes() -> None:
    """Reports kept through a long outage go out in order, numbered on, in lines far below the manager's limit."""
    client = ManagerClient()
    big = "x" * 300_000
    for i in range(40):
        if i % 4 == 0:
            client.send(Fatal(rank=i, step=i, error="boom", traceback=big, t=0.0))
        else:
            client.send(commit(i, i))
    sink = Sink()
    assert client.connected(sink, 0) == 40  # type: ignore[arg-type]
    assert len(sink.lines) > 1
    assert max(map(len, sink.lines)) < 2 * 1024 * 1024
    taken = reports_of(sink.lines)
    assert [seq for seq, _ in taken] == list(range(1, 41))
    assert [m.rank for _, m in taken] == list(range(40))  # type: ignore[attr-defined]
    assert [type(m) for _, m in taken[:2]] == [Fatal, StepCommitted]


def test_a_pass_of_commits_travels_as_one_node_step_a_step_and_a_partial_resend_gives_only_the_rest(
        tmp_path: Path) -> None:
    """The wire unit: a node's commits of a step are one NodeStep, numbered a commit each; the manager takes each once."""

    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        assert isinstance(await agent.join(join_message(job_dir, 0)), AgentWelcome)
        lines = tap(agent)
        for step in (1, 2):
            for rank in (0, 1, 2):
                agent.client.send(commit(rank, step))
        await until(lambda: len(recorder.named("message")) == 6, "the six commits")
        [line] = lines.lines
        batch = decode_from_agent(line)
        assert isinstance(batch, NumberedReports) and batch.first == 1
        steps = [decode_agent_report(body) for body in batch.reports]
        assert [(type(s).__name__, s.step, s.ranks) for s in steps] == [  # type: ignore[attr-defined]
            ("NodeStep", 1, [0, 1, 2]), ("NodeStep", 2, [0, 1, 2])]
        assert recorder.batches == [["StepCommitted"] * 6] and server.received[0] == 6
        # A resend that overlaps what the manager has (4..6 held as 5, 6, 7 after a break): only 7 is new.
        again = node_wire_step(3, [0, 1, 2])
        agent.send_raw(reports_line(5, [Codec.encode_object(again)]))
        await until(lambda: server.received[0] == 7, "the resent step's new commit")
        assert [(m.rank, m.step) for m in recorder.named("message")][6:] == [(2, 3)]
        agent.close()

    run(with_server(body, tmp_path))


def node_wire_step(step: int, ranks: list[int]) -> NodeStep:
    return NodeStep(0, step, ranks, [time.time()] * len(ranks), [{"loss": float(step)}] * len(ranks))


def test_what_an_agent_reports_in_one_pass_is_one_line_acked_and_then_dropped(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        assert isinstance(await agent.join(join_message(job_dir, 0)), AgentWelcome)
        lines = tap(agent)
        # One pass of the agent's loop: its beat and its two ranks' commits of two steps.
        agent.send(state(0, {0: 100, 1: 101}))
        for step in (1, 2):
            for rank in (0, 1):
                agent.client.send(commit(rank, step))
        assert lines.lines == []  # written once the pass is over
        await until(lambda: len(recorder.named("message")) == 4, "the four commits")
        assert len(lines.lines) == 1
        assert [seq for seq, _ in reports_of(lines.lines)] == [1, 2, 3, 4, 5]
        # The manager took the commits in one go, and the beat as the agent's own.
        assert recorder.batches == [["StepCommitted"] * 4]
        assert [(m.rank, m.step) for m in recorder.named("message")] == [(0, 1), (1, 1), (0, 2), (1, 2)]
        assert server.slots[0].live == {0: 100, 1: 101}
        assert server.received[0] == 5
        # Kept until the log has them; the Acked after the log's commit lets the agent drop the whole batch.
        assert agent.client.has_kept()
        assert server.positions() == {"0": 5}
        await agent.acked_through(5)
        assert not agent.client.has_kept()
        # The next pass is the next line, numbered on.
        agent.client.send(commit(0, 3))
        await until(lambda: len(recorder.named("message")) == 5, "the next pass's commit")
        assert [seq for seq, _ in reports_of(lines.lines[1:])] == [6]
        agent.close()

    run(with_server(body, tmp_path))


def test_a_batch_keeps_the_order_of_the_agents_reports_and_its_workers_messages(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        assert isinstance(await agent.join(join_message(job_dir, 0)), AgentWelcome)
        lines = tap(agent)
        agent.send(RankSpawned(0, 100, False, 1))
        agent.client.send(Hello(0, 100, 0, False, time.time()))
        agent.client.send(commit(0, 1))
        agent.send(state(0, {0: 100, 1: 101}))
        agent.client.send(commit(1, 1))
        agent.send(RankExited(1, 101, 1, 0.0))
        agent.client.send(Progress(0, 0, "group_rebuilt", time.time()))
        await until(lambda: len(recorder.named("message")) == 4, "the whole batch")
        assert len(lines.lines) == 1
        assert [name for name, _ in recorder.calls[1:]] == ["spawned", "message", "message", "message", "exit",
                                                            "message"]
        assert [type(m).__name__ for m in recorder.named("message")] == [
            "Hello", "StepCommitted", "StepCommitted", "Progress"]
        assert recorder.batches == [["Hello", "StepCommitted"], ["StepCommitted"], ["Progress"]]
        assert server.slots[0].live == {0: 100}  # its beat said 0 and 1, then rank 1 exited
        assert server.received[0] == 7
        agent.close()

    run(with_server(body, tmp_path))


def test_a_bad_report_in_a_batch_is_dropped_and_the_rest_is_taken(tmp_path: Path) -> None:
    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        agent = Agent(server.port)
        assert isinstance(await agent.join(join_message(job_dir, 0)), AgentWelcome)
        good = encode(commit(1, 7))[:-1].decode()
        agent.send_raw(b'{"first":"1","reports":[],"type":"NumberedReports"}\n')
        agent.send_raw(b'{"first":1,"reports":{},"type":"NumberedReports"}\n')
        agent.send_raw(f'{{"first":1,"reports":[{{"type":"Nope"}},7,{good}],"type":"NumberedReports"}}\n'.encode())
        await until(lambda: bool(recorder.named("message")), "the good report")
        assert [(m.rank, m.step) for m in recorder.named("message")] == [(1, 7)]
        assert server.received[0] == 3 and server.slots[0].attached
        agent.close()

    run(with_server(body, tmp_path))


def test_after_a_manager_restart_a_whole_batch_sent_again_gives_only_what_the_log_lacks(tmp_path: Path) -> None:
    """An agent that leaves resends everything it keeps (its welcome unseen); the manager takes each report once."""

    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        server.known_sessions = {0: "5e55105e55105e55"}
        server.received = {0: 3}
        server.persisted = {0: 3}
        client = ManagerClient()
        for step in range(1, 6):
            client.send(commit(0, step))
        agent = Agent(server.port, client)
        welcome = await agent.join(join_message(job_dir, 0, session="5e55105e55105e55"))
        assert isinstance(welcome, AgentWelcome) and welcome.acked == 3
        await until(lambda: len(recorder.named("message")) == 2, "the reports the log lacks")
        assert agent.writer is not None
        client.connected(agent.writer, 0)  # the whole kept batch again, 4 and 5 among it
        sentinel = Sink()
        again = ManagerClient()
        for step in range(1, 7):
            again.send(commit(0, step))
        again.connected(sentinel, 0)  # type: ignore[arg-type]
        agent.send_raw(sentinel.lines[0])  # 1..6: only 6 is new
        await until(lambda: len(recorder.named("message")) == 3, "report 6")
        await asyncio.sleep(0.2)
        assert [m.step for m in recorder.named("message")] == [4, 5, 6]
        assert server.received[0] == 6
        agent.close()

    run(with_server(body, tmp_path))


def test_a_batch_sent_again_after_a_manager_restart_is_not_applied_twice(tmp_path: Path) -> None:
    """The real Manager and its log: commits sent again (whole batches, overlapping ones) are each one steps row.

    The first manager takes two batches but dies before its log commits the
    second; a manager restarted from the log welcomes the agent back with the
    position the log holds, the agent resends the second batch, and copies of
    both batches arrive too. The log ends with every commit once and no step
    counted as re-run.
    """
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    db_path = job_dir / "events.db"
    options = ManagerOptions(job_id=JOB, job_dir=str(job_dir), host="127.0.0.1", port=0, http_port=0)

    async def start(restart: bool) -> tuple[AgentServer, Manager, EventLog]:
        gate = _Gate(options, TOKEN)
        prior = read_job_table(db_path) if restart else {}
        acked = {int(n): int(seq) for n, seq in prior.get("acked", {}).items()}
        server = AgentServer("127.0.0.1", 0, gate, heartbeat_s=30.0, acked=acked)
        await server.start()
        config = dataclasses.replace(job_config(job_dir), port=server.port + 1)
        events = EventLog(db_path)
        events.before_flush(lambda: events.set_job("acked", server.positions()))  # as `undying manager` does
        manager = Manager(config, events, restoring=restart)
        gate.bind(config, lambda host: "")
        known = manager.restore() if restart else {}
        server.bind(JobFacts(manager, NNODES, 30.0, 12345, str(job_dir), known_sessions=known))
        return server, manager, events

    def rows() -> list[tuple[int, int]]:
        with LogReader(db_path) as reader:
            return sorted(((c.rank, c.step) for c in reader.commits()), key=lambda rs: (rs[1], rs[0]))

    async def body() -> None:
        server, manager, events = await start(restart=False)
        agent = Agent(server.port)
        welcome = await agent.join(join_message(job_dir, 0))
        assert isinstance(welcome, AgentWelcome)
        lines = tap(agent)
        for step in (1, 2):  # one pass: reports 1..4
            for rank in (0, 1):
                agent.client.send(commit(rank, step))
        await until(lambda: manager.ranks[1].step == 2, "steps 1 and 2")
        events.flush()  # the log holds reports 1..4
        for rank in (0, 1):  # the next pass: reports 5, 6, taken but never committed to the log
            agent.client.send(commit(rank, 3))
        await until(lambda: manager.ranks[1].step == 3, "step 3")
        assert [len(reports_of([line])) for line in lines.lines] == [4, 2]
        # The manager dies: its open transaction is lost; the agent's link breaks with it.
        agent.client.disconnected()
        await server.close()
        events.db.close()
        agent.close()

        server, manager, events = await start(restart=True)
        assert manager.ranks[1].step == 2 and server.received == {0: 4}
        back = Agent(server.port, agent.client)
        again = await back.join(join_message(job_dir, 0, session=welcome.session))
        assert isinstance(again, AgentWelcome) and again.acked == 4  # the agent resends 5 and 6
        await until(lambda: manager.ranks[1].step == 3, "step 3 again, from the agent's kept reports")
        for line in lines.lines:  # and copies of both batches arrive as well
            back.send_raw(line)
        back.client.send(commit(0, 4))  # report 7: once it is taken, every line before it was
        await until(lambda: manager.ranks[0].step == 4, "report 7")
        assert server.received[0] == 7
        events.flush()
        assert rows() == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3), (0, 4)]
        assert manager.rerun_steps == set()
        await back.acked_through(7)
        assert not back.client.has_kept()
        back.close()
        await server.close()
        manager.close()

    run(body())


# --- the whole `undying manager`, in-process -----------------------------------------


def _free_port_pair() -> int:
    """A port P with P and P + 1 free (the agents' port and the control store's).

    Below the kernel's ephemeral range, where no other process's outgoing
    connection takes P + 1 before the manager's control store binds it.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(10_000, max(10_002, low - 2))
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


class ServedNode:
    """An agent for the whole service: answers SpawnRank with RankSpawned and StopNode with NodeStopped."""

    def __init__(self, agent: Agent, node: int) -> None:
        self.agent, self.node = agent, node
        self.spawned: dict[int, int] = {}
        self.ended: JobEnded | None = None

    async def serve(self) -> None:
        while True:
            try:
                message = await self.agent.read(timeout_s=TEST_LIMIT_S)
            except ConnectionError:
                return
            if isinstance(message, SpawnRank):
                pid = 50_000 + message.rank
                self.spawned[message.rank] = pid
                self.agent.send(RankSpawned(message.rank, pid, False, message.incarnation))
            elif isinstance(message, StopNode):
                self.agent.send(NodeStopped(message.seq))
            elif isinstance(message, JobEnded):
                self.ended = message
                return


def test_the_manager_service_takes_the_first_agents_flags_refuses_others_and_runs_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`undying manager` in-process: the first join makes the job; a differing one is refused; the job runs."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    job_dir = tmp_path / "job"
    port = _free_port_pair()
    options = ManagerOptions(job_id=JOB, job_dir=str(job_dir), host="127.0.0.1", port=port, http_port=0)
    flags = job_config(job_dir, max_restarts=2, timeouts=Timeouts(heartbeat_timeout=4.0, stop_grace=1.0))

    async def body() -> None:
        service = asyncio.ensure_future(_serve(options))
        try:
            first = Agent(port)
            for _ in range(200):  # the service's listener comes up
                with contextlib.suppress(OSError):
                    welcome = await first.join(join_message(job_dir, 0, config=flags))
                    break
                await asyncio.sleep(0.02)
            assert isinstance(welcome, AgentWelcome) and welcome.control_port == port + 1
            # A second agent whose flags differ from the first's is refused, naming each flag.
            differing = dataclasses.replace(flags, max_restarts=3, spares=1)
            refused = Agent(port)
            reply = await refused.join(join_message(job_dir, 1, config=differing))
            assert isinstance(reply, AgentRefused)
            assert "differ from the job's in max_restarts, spares" in reply.reason
            assert await refused.closed_by_manager()
            # The job has the first agent's heartbeat timeout (not the manager's default).
            second = Agent(port)
            assert isinstance(await second.join(join_message(job_dir, 1, config=flags)), AgentWelcome)
            nodes = [ServedNode(first, 0), ServedNode(second, 1)]
            serving = [asyncio.ensure_future(n.serve()) for n in nodes]
            # Every node joined: generation 0 starts every rank on its node.
            await until(lambda: all(len(n.spawned) == NPROC for n in nodes), "generation 0's spawns")
            assert sorted(nodes[0].spawned) == [0, 1] and sorted(nodes[1].spawned) == [2, 3]
            for n in nodes:
                n.agent.send(state(n.node, n.spawned))
                for rank, pid in n.spawned.items():
                    n.agent.client.send(commit(rank, 1))
                    n.agent.send(RankExited(rank, pid, 0, time.time()))
            assert await asyncio.wait_for(service, 15.0) == 0
            await asyncio.wait_for(asyncio.gather(*serving), 5.0)
            assert all(n.ended is not None and n.ended.state == "succeeded" and n.ended.exit_code == 0
                       for n in nodes)
        finally:
            service.cancel()
            with contextlib.suppress(BaseException):
                await service

    run(body())
    job = read_job(job_dir / "events.db")
    assert job["job"]["state"] == "succeeded"
    assert job["job"]["config"]["timeouts"]["heartbeat_timeout"] == 4.0 and job["job"]["config"]["max_restarts"] == 2
    assert sorted((s["rank"], s["step"]) for s in job["steps"]) == [(r, 1) for r in range(NNODES * NPROC)]
    # Every report an agent numbered before the job ended (its spawns, its state, a commit and an exit per
    # rank) is in the log's position for its node.
    reports = NPROC + 1 + 2 * NPROC
    assert sorted(job["job"]["acked"]) == ["0", "1"] and all(v >= reports for v in job["job"]["acked"].values())
    assert os.stat(job_dir / "token").st_mode & 0o077 == 0


def test_a_remote_agent_slot_queues_commands_while_detached() -> None:
    """NodeSlot without a connection: spawns wait, everything else is refused (False), nothing raised."""
    slot = NodeSlot(3)
    record = GenerationRecord(2, 8, "127.0.0.1", 1, reason="x")
    assert slot.spawn(6, record, joining=True, incarnation=9) == (0, False)
    assert slot.kill(6, signal.SIGKILL) is False
    assert slot.tell(6, TraceSet(True, False, "", 0.0)) is False
    assert slot.spares_ready() == 0 and not slot.attached
    assert slot.view()["waiting_spawns"] == [6]
