"""The wire formats between worker, agent, zygote and manager (undying.protocol)."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from undying.protocol import kinds, node_wire, worker_wire, zygote_wire
from undying.protocol.codec import Codec, Handlers, Message, MessageError, members
from undying.protocol.generations import GenerationRecord

# Every channel's union and the one decode its receiver uses.
CHANNELS: dict[str, tuple[Any, Callable[[Any], Any]]] = {
    "worker -> agent": (worker_wire.WorkerReport, worker_wire.decode_from_worker),
    "agent -> worker": (worker_wire.WorkerCommand, worker_wire.decode_to_worker),
    "agent -> manager (lines)": (node_wire.FromAgent, node_wire.decode_from_agent),
    "agent -> manager (reports)": (node_wire.Report, node_wire.decode_agent_report),
    "manager -> agent": (node_wire.ToAgent, node_wire.decode_to_agent),
}
CASES = [(channel, cls) for channel, (union, _) in CHANNELS.items() for cls in members(union)]


def _sample_value(tp: Any, name: str, n: int) -> Any:
    """A distinct, non-default value of type ``tp``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None, or a union of messages
        return _sample_value(typing.get_args(tp)[-1 if type(None) not in typing.get_args(tp) else 0], name, n)
    if tp is int:
        return 10 + n
    if tp is float:
        return 1700000000.125 + n
    if tp is bool:
        return True
    if tp is str:
        return f"{name} \u2713 \"quoted\"\n"
    if tp is msgspec.Raw:
        return msgspec.Raw(Codec.encode_object(worker_wire.Done(1, 2, "d", 3.0)))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return [_sample_value(args[0], name, n)]
    if origin is dict:
        value = {"loss": 0.1 + 0.2, "lr": 1e-3} if args[1] is float else (
            {"donor": 1, "receivers": [0, 2]} if args[1] is Any else {"2": _sample_value(args[1], name, n)})
        return value
    if tp is GenerationRecord:
        return GenerationRecord(3, 8, "10.0.0.1", 29500, members={"0": 0, "5": 1}, purpose="regroup")
    if tp is node_wire.RankProgress:
        return node_wire.RankProgress(1, 4242, 3, "step", 7, 12, 1700000000.5)
    if isinstance(tp, type) and issubclass(tp, Message):
        return _sample(tp)
    raise AssertionError(f"no sample value for {name}: {tp}")


def _sample(cls: type[Message]) -> Message:
    """An instance with a distinct, non-default value in every field."""
    fields = msgspec.structs.fields(cls)
    return cls(**{f.name: _sample_value(f.type, f.name, n) for n, f in enumerate(fields)})


def test_every_message_class_travels_on_a_channel() -> None:
    exported = {getattr(module, name) for module in (worker_wire, node_wire) for name in module.__all__
                if isinstance(getattr(module, name), type) and issubclass(getattr(module, name), Message)}
    on_channels = {cls for _, cls in CASES}
    assert exported == on_channels
    for channel, (union, _) in CHANNELS.items():
        names = [cls.__name__ for cls in members(union)]
        assert len(names) == len(set(names)), channel  # one tag, one class


@pytest.mark.parametrize(("channel", "cls"), CASES, ids=[f"{c}:{k.__name__}" for c, k in CASES])
def test_round_trip(channel: str, cls: type[Message]) -> None:
    decode = CHANNELS[channel][1]
    original = _sample(cls)
    line = Codec.encode(original)
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # one message a line
    assert json.loads(line)["type"] == cls.__name__
    again = decode(line)
    assert type(again) is cls
    assert Codec.encode(again) == line
    if cls is not node_wire.NumberedReports:  # (its reports stay raw bytes: compared by the encoding above)
        assert again == original
    assert Codec.encode(decode(line.decode())) == line  # str works too
    assert Codec.encode(decode(line.rstrip(b"\n"))) == line


def test_defaults_survive_the_round_trip() -> None:
    m = worker_wire.ArmFault(kind="crash", at_step=3)
    assert worker_wire.decode_to_worker(Codec.encode(m)) == worker_wire.ArmFault("crash", 3, "step")
    p = worker_wire.Progress(rank=0, generation=1, phase="group_rebuilt", t=1.0)
    assert worker_wire.decode_from_worker(Codec.encode(p)) == p


def test_floats_are_exact() -> None:
    loss = 0.1 + 0.2  # not representable in few digits
    m = worker_wire.StepCommitted(rank=0, generation=0, step=1, t=1.0, metrics={"loss": loss})
    again = worker_wire.decode_from_worker(Codec.encode(m))
    assert isinstance(again, worker_wire.StepCommitted) and again.metrics["loss"] == loss


def test_a_command_for_one_worker_travels_as_itself_inside_tell_rank() -> None:
    tell = node_wire.TellRank(2, worker_wire.StopAt(41, 3.5))
    again = node_wire.decode_to_agent(Codec.encode(tell))
    assert isinstance(again, node_wire.TellRank) and again.command == worker_wire.StopAt(41, 3.5)
    with pytest.raises(ValueError, match="bad fields for TellRank"):  # a report is no command
        node_wire.decode_to_agent(Codec.encode(node_wire.TellRank(2, worker_wire.Done(1, 2, "d", 3.0))))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (b'{"type":"Nope","rank":1}', "unknown message type"),
        (b'{"type":"Message"}', "unknown message type"),
        (b'{"type":"Preempt","generation":1,"reason":"x"}', "unknown message type"),  # a command, not a report
        (b"{not json", "malformed"),
        (b"", "malformed"),
        (b'{"type":"Hello"', "malformed"),
        (b'{"rank":1}', "without a type"),
        (b"[1, 2]", "without a type"),
        (b"null", "without a type"),
        (b'"Hello"', "without a type"),
        (b'{"type":"Hello","rank":0}', "bad fields for Hello"),
        (b'{"type":"Hello","rank":"0","pid":1,"generation":0,"joining":false,"t":1.0}', "bad fields for Hello"),
        (b'{"type":"SpareReady","pid":1,"t":1.0,"bogus":2}', "bad fields for SpareReady"),
    ],
)
def test_bad_lines_raise_value_error(line: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        worker_wire.decode_from_worker(line)
    assert isinstance(caught.value, MessageError)
    assert "worker's channel" in str(caught.value)  # which channel said it


def test_an_unknown_field_of_a_command_is_refused() -> None:
    with pytest.raises(ValueError, match="bad fields for ArmFault"):
        worker_wire.decode_to_worker(b'{"type":"ArmFault","kind":"crash","at_step":1,"bogus":2}')


@pytest.mark.parametrize("line", [b'{"type":[]}', b'{"type":{}}', b'{"type":1}'])
def test_an_unhashable_type_field_raises_value_error(line: bytes) -> None:
    # The agent drops bad worker messages by catching ValueError; anything else
    # escapes its reader loop.
    with pytest.raises(ValueError, match="unknown message type"):
        worker_wire.decode_from_worker(line)


def test_an_error_quotes_a_bounded_part_of_the_line() -> None:
    with pytest.raises(ValueError) as caught:
        worker_wire.decode_from_worker(b'{"type":"Nope","pad":"' + b"x" * 100_000 + b'"}')
    assert len(str(caught.value)) < 1000


def test_numbered_reports_lines_are_what_encode_writes() -> None:
    reports = [Codec.encode_object(worker_wire.StepCommitted(0, 1, 2, 3.0)), Codec.encode_object(
        node_wire.RankExited(1, 2, -9, 4.0))]
    line = node_wire.reports_line(7, reports)
    batch = node_wire.decode_from_agent(line)
    assert isinstance(batch, node_wire.NumberedReports) and batch.first == 7
    assert Codec.encode(batch) == line
    assert [node_wire.decode_agent_report(r) for r in batch.reports] == [
        worker_wire.StepCommitted(0, 1, 2, 3.0), node_wire.RankExited(1, 2, -9, 4.0)]


def test_forwarded_are_every_report_a_worker_sends_about_the_job(tmp_path: Path) -> None:
    """The manager routes a report by FROM_WORKERS (a worker's, or the agent's word on spares): a new one must be listed."""
    kept_by_the_agent = {worker_wire.Heartbeat, worker_wire.SpareReady, worker_wire.SpareTaken}
    assert set(worker_wire.FORWARDED) == set(members(worker_wire.WorkerReport)) - kept_by_the_agent
    assert {*worker_wire.FORWARDED, node_wire.SpareEvent} == node_wire.FROM_WORKERS
    assert set(members(node_wire.Report)) >= node_wire.FROM_WORKERS
    from undying.config import JobConfig
    from undying.jobfiles.events import EventLog
    from undying.manager.manager import Manager

    manager = Manager(JobConfig(job_id="m", job_dir=str(tmp_path)), EventLog(tmp_path / "events.db"))
    for cls in node_wire.FROM_WORKERS:
        assert cls in manager.handlers, cls.__name__
    manager.close()


def test_handlers_call_the_one_for_the_class_and_refuse_the_rest() -> None:
    seen: list[tuple[str, Any]] = []
    table = Handlers[bool]({worker_wire.Hello: lambda m, line: seen.append(("hello", line)) or True,
                            worker_wire.Done: lambda m, line: False})
    assert table.handle(worker_wire.Hello(1, 2, 3, False, 4.0), "line-1") is True
    assert seen == [("hello", "line-1")]
    assert table.handle(worker_wire.Done(1, 2, "d", 3.0), "line-2") is False
    with pytest.raises(MessageError, match="no handler for StopAt"):
        table.handle(worker_wire.StopAt(1, 1.0), "line-3")
    assert table.missing(members(worker_wire.WorkerCommand)) == [c.__name__ for c in members(worker_wire.WorkerCommand)]
    fallback = Handlers[str]({}, otherwise=lambda m: type(m).__name__)
    assert fallback.handle(worker_wire.Stop("x")) == "Stop"


def test_choices_answer_for_plain_strings_and_travel_as_them() -> None:
    assert "crash" in kinds.InjectKind and "comm-error" in kinds.InjectKind
    assert "explode" not in kinds.InjectKind and 3 not in kinds.InjectKind
    assert kinds.SlowPhase.DATA not in kinds.InjectPhase
    assert kinds.InjectKind.names() == "crash, hang, comm-error, slow, nan, bitflip, leave"
    assert ", ".join(kinds.HangHow) == "stop, spin, block"
    assert [p.value for p in kinds.RecoveryPhase] == ["detected", "decided", "replacement_ready", "group_rebuilt",
                                                       "state_restored", "first_step_done"]
    beat = worker_wire.Heartbeat(0, 1.0, phase=kinds.WorkerPhase.STEP)
    assert b'"phase":"step"' in Codec.encode(beat)
    assert worker_wire.decode_from_worker(Codec.encode(beat)) == beat


@pytest.mark.parametrize("frame", [
    zygote_wire.Spawn(3, ["--spare", "train.py"], {"RANK": "1"}, "/tmp", [0, 1, 2]),
])
def test_zygote_frames_to_the_zygote(frame: Any) -> None:
    data = zygote_wire.encode_frame(frame)
    reader = zygote_wire.to_zygote()
    assert reader.feed(data[:3]) == []  # a frame read in pieces
    assert reader.feed(data[3:] + data) == [frame, frame]


def test_zygote_frames_from_the_zygote_and_a_bad_one() -> None:
    frames = [zygote_wire.Ready(1), zygote_wire.Unfit("no"), zygote_wire.Spawned(1, 2), zygote_wire.Failed(1, "e")]
    assert zygote_wire.from_zygote().feed(b"".join(map(zygote_wire.encode_frame, frames))) == frames
    with pytest.raises(ValueError, match="unknown message type 'spawn'"):  # the agent's own frame, sent back
        zygote_wire.from_zygote().feed(zygote_wire.encode_frame(zygote_wire.Spawn(1, [], {}, "/", [])))
    with pytest.raises(ValueError, match="malformed"):  # the type read before the end was seen
        zygote_wire.from_zygote().feed(b"\x00\x00\x00\x0c" + b'{"op":"nope"')
    with pytest.raises(ValueError, match="over the limit|announced"):
        zygote_wire.from_zygote().feed(b"\xff\xff\xff\xff")


def test_a_generation_record_reads_back_and_a_bad_one_says_so() -> None:
    record = GenerationRecord(4, 2, "h", 1, status="superseded", superseded_by=5, members={"3": 0})
    assert GenerationRecord.from_json(record.to_json()) == record
    assert GenerationRecord.from_json(record.to_json().decode()) == record
    with pytest.raises(ValueError, match="not a generation record"):
        GenerationRecord.from_json(b'{"generation": "4"}')


def test_a_node_step_gathers_a_run_of_commits_and_gives_them_back() -> None:
    commits = [worker_wire.StepCommitted(r, 2, 9, 100.0 + r, {"loss": r / 3}) for r in (4, 5, 6)]
    later = worker_wire.StepCommitted(4, 2, 10, 200.0)
    steps = node_wire.NodeStep.gather([*commits, later])
    assert [(s.step, s.ranks, s.width) for s in steps] == [(9, [4, 5, 6], 3), (10, [4], 1)]
    assert steps[0].t == [104.0, 105.0, 106.0]  # each rank's own commit time: per-rank step times stay
    again = node_wire.decode_agent_report(Codec.encode(steps[0]))
    assert isinstance(again, node_wire.NodeStep) and again.commits() == commits
    assert node_wire.width(again) == 3 and node_wire.width(later) == 1 and node_wire.width(None) == 1
    # One record a node a step: far fewer bytes than a report a rank.
    assert len(Codec.encode(steps[0])) < sum(len(Codec.encode(c)) for c in commits)


@pytest.mark.parametrize("body", [
    '"ranks":[1,2],"t":[1.0],"metrics":[{},{}]',
    '"ranks":[1],"t":[1.0],"metrics":[{}],"fingerprints":["a","b"]',
    '"ranks":[],"t":[],"metrics":[]',
])
def test_a_node_step_whose_lists_disagree_is_refused(body: str) -> None:
    with pytest.raises(ValueError, match="bad fields for NodeStep"):
        node_wire.decode_agent_report(f'{{"type":"NodeStep","generation":0,"step":1,{body}}}')
