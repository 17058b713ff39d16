"""A judge's own clock (undying.protocol.judge_clock): silence counts only over time the judge ran.

The rule alone on fake clocks, then the judges that use it: the agent's
judgement of a rank and a spare (``agent.liveness``), and the manager's of its
nodes on real sockets, whose own event loop really stalls (blocked, as a
stopped process's is) while its agents beat, or give up on it and connect again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_nodes import Agent, Recorder, join_message, run, state, until, with_server
from undying.agent.liveness import judge_silence
from undying.config import Timeouts
from undying.manager.nodes import AgentServer
from undying.protocol.codec import Codec
from undying.protocol.judge_clock import JudgeClock, stall_limit
from undying.protocol.node_wire import (
    AgentJoin,
    AgentWelcome,
    decode_to_agent,
    encode,
    reports_line,
)


class Clocks:
    """A monotonic and a wall clock the test moves by hand (the wall 1,000,000 s ahead of the monotonic)."""

    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t + 1_000_000.0

    def advance(self, seconds: float) -> None:
        self.t += seconds


def judge(clocks: Clocks, period_s: float = 0.2, window_s: float = 3.0) -> JudgeClock:
    clock = JudgeClock(period_s, window_s, "the test's judge", monotonic=clocks.monotonic, wall=clocks.wall)
    clock.tick()
    return clock


def running(clocks: Clocks, clock: JudgeClock, seconds: float) -> None:
    """The judge runs for ``seconds``, ticking at its pace."""
    steps = round(seconds / clock.period_s)
    for _ in range(steps):
        clocks.advance(seconds / steps)
        clock.tick()


def test_the_stall_limit_is_half_the_window_and_at_least_three_periods() -> None:
    assert stall_limit(0.2, 3.0) == 1.5
    assert stall_limit(0.2, 30.0) == 15.0
    assert stall_limit(0.1, 0.5) == pytest.approx(0.3)  # a tiny window: three periods of jitter are no stall


def test_ticks_at_their_pace_or_lagging_under_load_are_no_stall_and_silence_is_plain() -> None:
    clocks = Clocks()
    clock = judge(clocks)
    heard = clocks.t
    for gap in (0.2, 0.2, 0.9, 1.4, 0.2, 1.5):  # a busy host lags by tenths of a second, up to the limit
        clocks.advance(gap)
        clock.tick()
    assert clock.stalls == 0
    assert clock.silent_s(heard) == pytest.approx(4.4)  # every second counts: the judge was running


def test_after_a_stall_of_its_own_every_peer_gets_a_fresh_window() -> None:
    clocks = Clocks()
    clock = judge(clocks)
    long_silent, just_heard = clocks.t - 2.9, clocks.t  # one close to its limit, one fine
    clocks.advance(8.0)  # the judge stopped: SIGSTOP, a paused VM, a blocked loop
    assert clock.tick() == pytest.approx(8.0)
    assert (clock.stalls, clock.last_stall_s) == (1, pytest.approx(8.0))
    assert clock.silent_s(long_silent) == 0.0 and clock.silent_s(just_heard) == 0.0
    assert clock.fresh()
    running(clocks, clock, 2.8)
    assert clock.silent_s(long_silent) == pytest.approx(2.8)  # not yet (the window is 3 s): a whole window
    running(clocks, clock, 0.4)
    assert clock.stalls == 1
    assert clock.silent_s(long_silent) == pytest.approx(3.2)  # past the window: a peer that is gone is declared
    assert not clock.fresh()
    heard_after = clocks.t - 1.0
    assert clock.silent_s(heard_after) == pytest.approx(1.0)  # a word after the return counts from itself


def test_a_judgement_made_before_the_loops_own_tick_still_sees_the_stall() -> None:
    """After a stall, a callback (a socket's close, a read) may run before the loop's next tick."""
    clocks = Clocks()
    clock = judge(clocks)
    heard = clocks.t
    clocks.advance(6.0)
    assert clock.silent_s(heard) == 0.0 and clock.stalls == 1  # silent_s ticked first
    clocks.advance(6.0)
    assert clock.fresh() and clock.stalls == 2  # so did fresh


def test_the_wall_clock_and_the_monotonic_one_give_the_same_judgement() -> None:
    clocks = Clocks()
    clock = judge(clocks)
    heard_wall, heard = clocks.wall(), clocks.monotonic()
    clocks.advance(5.0)
    clock.tick()
    running(clocks, clock, 1.0)
    assert clock.silent_s(heard_wall, wall=True) == pytest.approx(1.0) == clock.silent_s(heard)
    assert clock.counts_from(heard_wall, wall=True) == clock.resumed_wall


def test_the_first_tick_starts_the_clock_and_the_window_follows_the_jobs_flag() -> None:
    clocks = Clocks()
    clock = JudgeClock(0.2, 30.0, "late start", monotonic=clocks.monotonic, wall=clocks.wall)
    clocks.advance(100.0)  # made long before its loop started
    clock.tick()
    assert clock.stalls == 0
    clock.window_s = 3.0  # (the manager learns the job's --heartbeat-timeout from the first join)
    assert clock.stall_s == 1.5
    with pytest.raises(ValueError, match="positive"):
        JudgeClock(0.0, 3.0, "bad")
    with pytest.raises(ValueError, match="positive"):
        clock.window_s = -1.0


def test_the_agent_declares_no_rank_or_spare_silent_for_its_own_stall() -> None:
    timeouts = Timeouts(heartbeat_timeout=3.0, init_timeout=60.0)
    clocks = Clocks()
    clock = judge(clocks)
    last_seen, started = clocks.wall() - 0.3, clocks.wall() - 50.0
    clocks.advance(8.0)  # the agent was stopped; its ranks beat on into its socket
    now = clocks.wall()
    assert judge_silence(now, started, last_seen, timeouts, True) is not None  # the old rule: hung
    assert judge_silence(now, started, last_seen, timeouts, True, clock) is None
    assert judge_silence(now, started, 0.0, timeouts, True, clock) is None  # in init: a fresh init window too
    running(clocks, clock, 3.4)  # a rank silent a whole window after the agent's return is hung
    silence = judge_silence(clocks.wall(), started, last_seen, timeouts, True, clock)
    assert silence is not None and silence.phase == "heartbeat" and silence.silent_s == pytest.approx(3.4)


# --- the manager's judgement of its nodes, its own event loop stalled ---------------------------------


class RawNode:
    """Node 0's agent on plain sockets: it connects and beats while the manager's loop does not run."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.seq = 0

    def connect(self, join: AgentJoin) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=5.0)
        self.sock.sendall(encode(join))

    def welcome(self) -> AgentWelcome:
        assert self.sock is not None
        reply = decode_to_agent(self.sock.makefile("rb").readline())
        assert isinstance(reply, AgentWelcome), reply
        return reply

    def beat(self) -> None:
        if self.sock is not None:
            self.seq += 1
            self.sock.sendall(reports_line(self.seq, [Codec.encode_object(state(0, {0: 10, 1: 11}))]))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def test_a_stalled_manager_gives_its_nodes_a_fresh_window_and_takes_back_those_that_connected_again(
        tmp_path: Path) -> None:
    """The manager's event loop blocked for three heartbeat timeouts (a stopped manager's is).

    Meanwhile node 0's agent gave up on it and connected again with its session
    (its old connection's close waits in the manager's socket with the new
    join), and node 1's beats waited unread. Neither is lost: node 0 resumes its
    session, node 1 stays. Then node 0's agent dies during a second stall: it is
    lost once a fresh window after the stall passed in silence, not at once.
    """
    heartbeat_s = 0.4

    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        node0 = RawNode(server.port)
        await asyncio.to_thread(node0.connect, join_message(job_dir, 0))
        session = (await asyncio.to_thread(node0.welcome)).session
        node1 = Agent(server.port)
        assert isinstance(await node1.join(join_message(job_dir, 1)), AgentWelcome)

        async def beat() -> None:
            while True:
                node1.send(state(1, {2: 20, 3: 21}))
                with contextlib.suppress(OSError):
                    node0.beat()
                await asyncio.sleep(0.1)

        beats = asyncio.ensure_future(beat())
        try:
            await asyncio.sleep(0.5)
            # The stall: nothing in the manager's loop runs (blocked, as a SIGSTOP would stop it).
            node0.close()
            node0.connect(join_message(job_dir, 0, session=session))
            time.sleep(3 * heartbeat_s)
            assert (await asyncio.to_thread(node0.welcome)).session == session
            await asyncio.sleep(2 * heartbeat_s)  # past the old rule's verdict, and a window more of beats
            assert recorder.named("lost") == [] and server.clock.stalls >= 1
            assert server.slots[0].attached and server.slots[0].session == session and server.slots[1].attached
            # Node 0's agent dies during a second stall; node 1's beats on after it.
            node0.close()
            time.sleep(3 * heartbeat_s)
            back = time.monotonic()
            await until(lambda: bool(recorder.named("lost")), "node 0's loss", timeout_s=heartbeat_s + 3.0)
            took = time.monotonic() - back
            node, reason = recorder.named("lost")[0]
            assert node == 0 and "silent for" in reason and heartbeat_s - 0.1 <= took, (reason, took)
            await asyncio.sleep(heartbeat_s)
            assert [n for n, _ in recorder.named("lost")] == [0] and server.slots[1].attached
        finally:
            beats.cancel()
            node0.close()
            node1.close()

    run(with_server(body, tmp_path, heartbeat_s=heartbeat_s))


def test_a_socket_wait_of_a_paused_process_finds_the_answer_that_came_meanwhile() -> None:
    """Why the store client (protocol/store_client.py) needs no judge clock: its waits are a socket timeout,
    and the kernel's poll looks at the socket before the deadline. A client process stopped past its timeout
    while the answer arrived reads the answer when it continues, not a timeout."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        child = subprocess.Popen([sys.executable, "-c", (
            "import socket, sys\n"
            f"s = socket.create_connection(('127.0.0.1', {server.getsockname()[1]}))\n"
            "s.settimeout(0.3)\n"
            "try:\n    print(s.recv(16).decode())\nexcept TimeoutError:\n    print('timed out')\n")],
            stdout=subprocess.PIPE, text=True)
        try:
            conn, _ = server.accept()
            with conn:
                time.sleep(0.1)  # (into its 0.3 s wait)
                os.kill(child.pid, signal.SIGSTOP)
                time.sleep(0.1)
                conn.sendall(b"answer")
                time.sleep(1.0)  # the client's deadline passes while it is stopped
                os.kill(child.pid, signal.SIGCONT)
                out, _ = child.communicate(timeout=10)
        finally:
            child.kill()
            child.wait()
    assert out.strip() == "answer", out


def test_a_new_agent_for_a_node_whose_connection_closed_in_the_stall_takes_the_node_at_once(tmp_path: Path) -> None:
    """Node 0's agent died and a new one (no session: a restarted process) joined while the manager was stalled:
    the old agent's node is lost then and the newcomer seated, not refused as a second agent of the node."""

    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        old = RawNode(server.port)
        await asyncio.to_thread(old.connect, join_message(job_dir, 0))
        session = (await asyncio.to_thread(old.welcome)).session
        await asyncio.sleep(0.3)
        old.close()  # the stall: the old agent's close and the new one's join wait in the manager's sockets
        new = RawNode(server.port)
        new.connect(join_message(job_dir, 0))
        time.sleep(1.5)
        try:
            welcome = await asyncio.to_thread(new.welcome)
            assert welcome.session != session and server.slots[0].session == welcome.session
            [(node, reason)] = recorder.named("lost")
            assert node == 0 and "a new agent joined for the node" in reason, reason
        finally:
            new.close()

    run(with_server(body, tmp_path, heartbeat_s=0.4))


def test_a_manager_stalled_before_its_watch_first_ran_still_sees_its_stall(tmp_path: Path) -> None:
    """A restarted manager paused a second after its start (the soak's manager kill, then a pause): its
    watch had not yet ticked, and a close read after the pause lost every node. Its clock runs from start."""

    async def body(server: AgentServer, recorder: Recorder, job_dir: Path) -> None:
        time.sleep(1.0)  # the loop blocked before the watch's first pass (heartbeat 0.4 s: a stall past 0.6 s)
        assert server.clock.fresh() and server.clock.stalls == 1

    run(with_server(body, tmp_path, heartbeat_s=0.4))


def test_a_judge_that_starts_late_counts_no_stall_before_its_start() -> None:
    """A manager's watch built, then the job's start-up (seconds), then its loop: no stall, no warning."""
    clocks = Clocks()
    clock = judge(clocks)
    clocks.advance(10.0)  # the start-up's work before the loop runs
    clock.start()
    running(clocks, clock, 1.0)
    assert clock.stalls == 0 and clock.resumed == 0.0
    clocks.advance(2.0)  # a real stall of the loop, once it runs
    clock.tick()
    assert clock.stalls == 1
