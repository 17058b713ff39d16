"""Warm standby agents: which standby takes which lost node (a table), and the manager's side on real sockets.

The socket tests run the shipped ``AgentServer`` behind the shipped join gate
on 127.0.0.1, with the test agents of ``test_nodes`` speaking the real
messages; the manager's ``NodeEvents`` is that module's recorder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_nodes import (
    NNODES,
    NPROC,
    TOKEN,
    Agent,
    Recorder,
    job_config,
    join_message,
    run,
    state,
)
from undying.cli.main import main
from undying.config import ManagerOptions
from undying.launch.manager_service import _Gate
from undying.manager.nodes import AgentServer, JobFacts
from undying.manager.standbys.policy import Promote, SlotFacts, StandbyFacts, promotions
from undying.protocol.generations import GenerationRecord
from undying.protocol.node_wire import (
    AgentRefused,
    AgentWelcome,
    JobEnded,
    ManagerBeat,
    RankExited,
    SpawnRank,
    StandbyBeat,
    StandbyJoin,
    StandbyParked,
    encode,
)

LIMIT = 3.0


def slot(node: int, *, attached: bool = True, lost_at: float = 0.0) -> SlotFacts:
    return SlotFacts(node, attached, lost_at)


def standby(key: int, spares: int = 2, parked_at: float = 0.0, silent_s: float = 0.1) -> StandbyFacts:
    return StandbyFacts(key, spares, parked_at, silent_s)


@pytest.mark.parametrize(
    ("slots", "standbys", "closed", "expected"),
    [
        # Nothing lost: every standby stays parked.
        ([slot(0), slot(1)], [standby(1)], False, []),
        # A node that never joined (the job's start) is its own host's, not a standby's.
        ([slot(0), slot(1, attached=False)], [standby(1)], False, []),
        # A lost node goes to the standby.
        ([slot(0), slot(1, attached=False, lost_at=5.0)], [standby(1)], False, [(1, 1)]),
        # No standby: nothing to do (the node waits for a host, then --node-wait).
        ([slot(1, attached=False, lost_at=5.0)], [], False, []),
        # The one with more warm spares first, then the one parked longest.
        ([slot(1, attached=False, lost_at=5.0)], [standby(1, spares=1), standby(2, spares=2)], False, [(2, 1)]),
        ([slot(1, attached=False, lost_at=5.0)], [standby(1, parked_at=9.0), standby(2, parked_at=3.0)], False,
         [(2, 1)]),
        # A standby silent past the limit (its host cut off) is passed over.
        ([slot(1, attached=False, lost_at=5.0)], [standby(1, spares=2, silent_s=9.0), standby(2, spares=0)], False,
         [(2, 1)]),
        # Two lost nodes, one standby: the node lost first gets it.
        ([slot(0, attached=False, lost_at=7.0), slot(1, attached=False, lost_at=5.0)], [standby(1)], False, [(1, 1)]),
        ([slot(0, attached=False, lost_at=7.0), slot(1, attached=False, lost_at=5.0)], [standby(1), standby(2)],
         False, [(1, 1), (2, 0)]),
        # The job is over: nothing moves.
        ([slot(1, attached=False, lost_at=5.0)], [standby(1)], True, []),
    ],
)
def test_a_lost_node_goes_to_the_best_standby_still_heard_from(
        slots: list[SlotFacts], standbys: list[StandbyFacts], closed: bool, expected: list[tuple[int, int]]) -> None:
    done = promotions(slots, standbys, silence_limit_s=3.0, closed=closed)
    assert [(p.standby, p.node) for p in done] == expected
    assert all(isinstance(p, Promote) and f"node {p.node} was lost" in p.reason for p in done)


class StandbyRecorder(Recorder):
    def on_standby(self, what: str, detail: dict[str, Any]) -> None:
        self.calls.append((what, detail))


async def _server(job_dir: Path, heartbeat_s: float = 30.0) -> tuple[AgentServer, StandbyRecorder]:
    options = ManagerOptions(job_id="nodes-test", job_dir=str(job_dir), host="127.0.0.1", port=0, http_port=0)
    gate = _Gate(options, TOKEN)
    server = AgentServer("127.0.0.1", 0, gate, heartbeat_s=heartbeat_s)
    await server.start()
    gate.bind(dataclasses.replace(job_config(job_dir), port=server.port + 1), lambda host: "")
    recorder = StandbyRecorder()
    server.bind(JobFacts(recorder, NNODES, heartbeat_s, 12345, str(job_dir)))
    return server, recorder


async def _until(check: Any, what: str) -> None:
    deadline = time.monotonic() + LIMIT
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_parked_standby_is_given_a_lost_node_with_its_waiting_spawns_on_the_same_connection(tmp_path: Path) -> None:
    async def body() -> None:
        server, recorder = await _server(tmp_path)
        try:
            node1 = Agent(server.port)
            assert isinstance(await node1.join(join_message(tmp_path, 1, live={"2": 200, "3": 201})), AgentWelcome)
            spare = Agent(server.port)
            spare.reader, spare.writer = await asyncio.open_connection("127.0.0.1", server.port)
            spare.writer.write(encode(StandbyJoin(join_message(tmp_path, 0))))
            parked = await spare.read()
            assert isinstance(parked, StandbyParked)
            assert (parked.control_port, parked.job_dir) == (12345, str(tmp_path)) and parked.trace is not None
            spare.writer.write(encode(StandbyBeat(NPROC, time.time())))
            await _until(lambda: [v["spares_ready"] for v in server.standbys.views()] == [NPROC], "its beat")
            assert isinstance(await spare.next(ManagerBeat), ManagerBeat)  # beaten like a node
            # Node 1 is lost; its ranks' replacements wait in its slot (as the Manager spawns them).
            server.lose(server.slots[1], "node 1's host killed by the test")
            record = GenerationRecord(1, NNODES * NPROC, "127.0.0.1", 23456, reason="node 1 lost")
            for rank in (2, 3):
                server.slots[1].spawn(rank, record, joining=True, incarnation=rank)
            welcome = await spare.next(AgentWelcome)
            assert welcome.node == 1 and welcome.session and welcome.acked == 0
            spare.client.connected(spare.writer, welcome.acked)
            spawns = [await spare.next(SpawnRank), await spare.next(SpawnRank)]
            assert sorted(s.rank for s in spawns) == [2, 3] and all(s.joining for s in spawns)
            assert server.slots[1].attached and server.slots[1].host == "host-0" and server.standbys.views() == []
            assert recorder.named("joined")[-1][:2] == (1, welcome.session)
            promoted = recorder.named("standby_promoted")
            assert len(promoted) == 1 and promoted[0]["node"] == 1 and promoted[0]["spares_ready"] == NPROC
            # A beat still in flight is no report; the node's numbered reports count from 1.
            spare.writer.write(encode(StandbyBeat(NPROC, time.time())))
            spare.client.send(RankExited(2, 300, 1, time.time()))
            await _until(lambda: recorder.named("exit") == [(2, 300, 1)], "the new node's first report")
            assert server.received[1] == 1
            spare.close()
            node1.close()
        finally:
            await server.close()

    run(body())


def test_a_standby_parked_after_the_loss_takes_the_node_at_once_and_a_silent_one_is_dropped(tmp_path: Path) -> None:
    async def body() -> None:
        server, recorder = await _server(tmp_path, heartbeat_s=0.6)
        try:
            node0 = Agent(server.port)
            assert isinstance(await node0.join(join_message(tmp_path, 0)), AgentWelcome)
            node1 = Agent(server.port)
            assert isinstance(await node1.join(join_message(tmp_path, 1)), AgentWelcome)
            node1.close()  # its host died: the connection closes, the node is lost
            await _until(lambda: not server.slots[1].attached, "the loss")
            late = Agent(server.port)
            late.reader, late.writer = await asyncio.open_connection("127.0.0.1", server.port)
            late.writer.write(encode(StandbyJoin(join_message(tmp_path, 0))))
            assert isinstance(await late.read(), StandbyParked)
            assert (await late.next(AgentWelcome)).node == 1
            # A second standby that never beats is dropped past the heartbeat timeout; node 0 beats on.
            mute = Agent(server.port)
            mute.reader, mute.writer = await asyncio.open_connection("127.0.0.1", server.port)
            mute.writer.write(encode(StandbyJoin(join_message(tmp_path, 0))))
            assert isinstance(await mute.read(), StandbyParked)
            for _ in range(12):
                node0.send(state(0, {}))
                late.writer.write(encode(StandbyBeat(0, time.time())))
                await asyncio.sleep(0.1)
            assert server.standbys.views() == []
            assert [d["standby"] for d in recorder.named("standby_dropped")] == [2]
            assert await mute.closed_by_manager()
            node0.close()
            late.close()
        finally:
            await server.close()

    run(body())


def test_a_standby_with_other_flags_is_refused_and_one_parked_hears_the_jobs_end(tmp_path: Path) -> None:
    async def body() -> None:
        server, _ = await _server(tmp_path)
        try:
            wrong = Agent(server.port)
            wrong.reader, wrong.writer = await asyncio.open_connection("127.0.0.1", server.port)
            wrong.writer.write(encode(StandbyJoin(join_message(tmp_path, 0, token="not-the-token"))))
            refused = await wrong.read()
            assert isinstance(refused, AgentRefused) and "wrong or missing token" in refused.reason
            assert server.standbys.views() == []
            good = Agent(server.port)
            good.reader, good.writer = await asyncio.open_connection("127.0.0.1", server.port)
            good.writer.write(encode(StandbyJoin(join_message(tmp_path, 0))))
            assert isinstance(await good.read(), StandbyParked)
            server.standbys.tell_all(JobEnded("succeeded", "done", 0))
            assert (await good.next(JobEnded)).exit_code == 0
            good.close()
        finally:
            await server.close()

    run(body())


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["run", "--standby", "--job-id", "j", "t.py"], ["--standby needs --manager HOST:PORT"]),
        (["run", "--standby", "--manager", "10.0.0.1:29400", "--node-rank", "1", "--nnodes", "2", "--job-id", "j",
          "t.py"], ["takes no --node-rank", "the manager gives a standby the rank of the node it replaces"]),
    ],
)
def test_a_standby_without_a_manager_or_with_a_node_rank_is_refused_saying_why(
        argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_run_help_explains_standby(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help-all"])  # (--help names it; --help-all says what it does)
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--standby" in help_text and "takes that node's rank" in help_text
