"""The one conversation of a manager and its agent: every message has its handler, and the in-process line
carries each one encoded and decoded, as the network would, at once."""

from __future__ import annotations

import typing
from typing import Any

from undying.agent.commands import NODE_COMMANDS, NodeCommands
from undying.agent.remote import JOIN_ANSWERS, SESSION_MESSAGES
from undying.launch.in_process import InProcessLine, InProcessReports
from undying.manager.node_reports import NODE_REPORTS, NodeReports
from undying.manager.node_slot import NodeSlot
from undying.protocol import node_wire
from undying.protocol.codec import Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.kinds import WorkerPhase
from undying.protocol.node_wire import (
    FROM_WORKERS,
    AgentState,
    KillRank,
    NodeStep,
    RankExited,
    RankProgress,
    RanksStalled,
    SpawnRank,
)
from undying.protocol.worker_wire import StepCommitted
from undying.trace.switch import TraceSwitch


def test_every_command_of_the_wire_has_its_place_on_the_agents_side() -> None:
    to_agent = set(typing.get_args(node_wire.ToAgent))
    assert to_agent == {*NODE_COMMANDS, *SESSION_MESSAGES, *JOIN_ANSWERS}
    assert not {*NODE_COMMANDS} & {*SESSION_MESSAGES, *JOIN_ANSWERS}, "a message is a command or the session's"


def test_every_report_of_the_wire_has_its_place_on_the_managers_side() -> None:
    reports = set(typing.get_args(node_wire.Report))
    assert reports == {*NODE_REPORTS, *FROM_WORKERS, NodeStep}
    assert not set(NODE_REPORTS) & set(FROM_WORKERS)
    table = NodeReports(lambda: _Events(), lambda slot, reason: None).table
    assert table.missing(NODE_REPORTS) == []


class _Agent:
    """Stands in for the agent behind the command table: records each act (the table's only caller here)."""

    def __init__(self) -> None:
        self.acts: list[tuple[str, Any]] = []

    def zygote_pending(self) -> bool:
        return False

    def spares_ready(self) -> int:
        return 1

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool, resume_from: str = "",
              incarnation: int = 0) -> tuple[int, bool]:
        self.acts.append(("spawn", (rank, record.generation, joining, incarnation)))
        return 4000 + rank, joining

    def kill(self, rank: int, sig: int) -> bool:
        self.acts.append(("kill", (rank, int(sig))))
        return True


class _Events:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_messages(self, messages: list[Message]) -> None:
        self.calls.append(("messages", messages))

    def on_exit(self, rank: int, pid: int, returncode: int, t: float) -> None:
        self.calls.append(("exit", (rank, pid, returncode)))

    def on_spawned(self, rank: int, pid: int, warm: bool, incarnation: int) -> None:
        self.calls.append(("spawned", (rank, pid, warm, incarnation)))

    def on_hang(self, rank: int, pid: int, phase: str, last_seen: float, t: float) -> None:
        self.calls.append(("hang", rank))

    def on_stall(self, progress: list[RankProgress], limit: float, t: float) -> None:
        self.calls.append(("stall", (progress, limit)))

    def on_trace_file(self, switch: TraceSwitch) -> None:
        self.calls.append(("trace_file", switch))

    def on_trace_file_error(self, message: str) -> None:
        self.calls.append(("trace_file_error", message))

    def on_node_lost(self, node: int, reason: str, t: float) -> None:
        self.calls.append(("lost", node))

    def on_node_joined(self, node: int, session: str, host: str, live: dict[int, int]) -> None:
        self.calls.append(("joined", node))

    def welcome_trace(self) -> Any:
        return None

    def on_standby(self, what: str, detail: dict[str, Any]) -> None:
        self.calls.append(("standby", what))


def _in_process() -> tuple[NodeSlot, _Agent, _Events, list[Message], InProcessReports]:
    slot = NodeSlot(0)
    events = _Events()
    to_manager = InProcessReports(NodeReports(lambda: events, lambda slot, reason: None), slot)
    agent = _Agent()
    commands = NodeCommands(agent, to_manager.send)  # type: ignore[arg-type]
    seen: list[Message] = []

    def command(message: Message) -> None:
        seen.append(message)
        commands.handle(message)

    slot.attach_line(InProcessLine(command), host="localhost", pid=1, session="in-process")
    return slot, agent, events, seen, to_manager


def test_a_spawn_on_the_in_process_line_is_a_decoded_command_and_its_answer_comes_back_before_it_returns() -> None:
    slot, agent, events, seen, _ = _in_process()
    record = GenerationRecord(generation=3, world_size=4, store_host="127.0.0.1", store_port=1)
    assert slot.spawn(2, record, joining=True, incarnation=7) == (4002, True)
    (command,) = seen
    assert isinstance(command, SpawnRank) and command.record == record and command.incarnation == 7
    assert command.record is not record, "the command crossed as bytes, as on the network"
    assert agent.acts == [("spawn", (2, 3, True, 7))]
    assert events.calls == [("spawned", (2, 4002, True, 7))]
    assert slot.live == {2: 4002}
    assert slot.kill(2, 9) and agent.acts[-1] == ("kill", (2, 9)) and isinstance(seen[-1], KillRank)


def test_the_agents_reports_reach_the_managers_table_as_on_the_network() -> None:
    slot, _, events, _, to_manager = _in_process()
    slot.live[1] = 501
    to_manager.send(RankExited(1, 501, -9, 10.0))
    commit = StepCommitted(0, 0, 5, 11.0, {"loss": 1.0})
    to_manager.send(commit)
    progress = [RankProgress(0, 500, 0, WorkerPhase.STEP, 5, 3, 11.0)]
    to_manager.send(RanksStalled(progress, 30.0, 12.0))
    to_manager.send(AgentState(0, {"0": 500}, {"0": "step"}, 1, 12.5, zygote_pid=77))
    assert events.calls[0] == ("exit", (1, 501, -9)) and 1 not in slot.live
    kind, messages = events.calls[1]
    assert kind == "messages" and messages == [commit] and messages[0] is not commit
    assert events.calls[2] == ("stall", (progress, 30.0))
    assert slot.view()["zygote_pid"] == 77 and slot.spares_ready() == 1 and slot.phases() == {0: "step"}


def test_once_the_line_is_closed_nothing_crosses_it() -> None:
    slot, agent, events, seen, to_manager = _in_process()
    slot.detach("the job ended")
    record = GenerationRecord(generation=1, world_size=1, store_host="127.0.0.1", store_port=1)
    assert slot.spawn(0, record, joining=False) == (0, False)
    to_manager.send(RankExited(0, 1, 0, 1.0))
    assert seen == [] and agent.acts == [] and events.calls == []
