"""The wire format between worker, agent and manager."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from undying import messages
from undying.messages import Message, decode, encode


def _sample(cls: type[Message]) -> Message:
    """An instance with a distinct, non-default value in every field."""
    values: dict[str, Any] = {}
    for n, f in enumerate(dataclasses.fields(cls)):
        kind = str(f.type)
        if kind == "int":
            values[f.name] = 10 + n
        elif kind == "float":
            values[f.name] = 1700000000.125 + n
        elif kind == "bool":
            values[f.name] = True
        elif kind == "str":
            values[f.name] = f"{f.name} \u2713 \"quoted\"\n"
        elif kind.startswith("dict[str, str]"):
            values[f.name] = {"RANK": "3", "UNDYING_JOB_ID": "job \u2713"}
        elif kind.startswith("dict[str, float]"):
            values[f.name] = {"loss": 0.1 + 0.2, "lr": 1e-3}
        elif kind.startswith("dict[str, Any]"):
            values[f.name] = {"donor": 1, "receivers": [0, 2]}
        elif kind.startswith("dict[str, int]"):
            values[f.name] = {"2": 4242, "3": 4243}
        elif kind.startswith("list[dict[str, Any]]"):
            values[f.name] = [{"rank": 1, "phase": "step"}]
        else:
            raise AssertionError(f"no sample value for {cls.__name__}.{f.name}: {kind}")
    return cls(**values)


def test_every_message_class_is_registered() -> None:
    exported = {name for name in messages.__all__ if isinstance(getattr(messages, name), type)}
    exported -= {"Message"}
    assert exported == set(Message.registry)
    assert "Message" not in Message.registry


@pytest.mark.parametrize("name", sorted(Message.registry))
def test_round_trip(name: str) -> None:
    cls = Message.registry[name]
    original = _sample(cls)
    line = encode(original)
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # one message a line
    assert json.loads(line)["type"] == name
    again = decode(line)
    assert type(again) is cls
    assert again == original
    assert decode(line.decode()) == original  # str works too
    assert decode(line.rstrip(b"\n")) == original


def test_defaults_survive_the_round_trip() -> None:
    m = messages.ArmFault(kind="crash", at_step=3)
    assert decode(encode(m)) == messages.ArmFault("crash", 3, "step")
    p = messages.Progress(rank=0, generation=1, phase="group_rebuilt", t=1.0)
    assert decode(encode(p)) == p


def test_floats_are_exact() -> None:
    loss = 0.1 + 0.2  # not representable in few digits
    m = messages.StepCommitted(rank=0, generation=0, step=1, t=1.0, metrics={"loss": loss})
    assert decode(encode(m)).metrics["loss"] == loss  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (b'{"type":"Nope","rank":1}', "unknown message type"),
        (b'{"type":"Message"}', "unknown message type"),
        (b"{not json", "malformed"),
        (b"", "malformed"),
        (b'{"type":"Hello"', "malformed"),
        (b'{"rank":1}', "without a type"),
        (b"[1, 2]", "without a type"),
        (b"null", "without a type"),
        (b'"Hello"', "without a type"),
        (b'{"type":"Hello","rank":0}', "bad fields for Hello"),
        (b'{"type":"ArmFault","kind":"crash","at_step":1,"bogus":2}', "bad fields for ArmFault"),
    ],
)
def test_bad_lines_raise_value_error(line: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode(line)


@pytest.mark.parametrize("line", [b'{"type":[]}', b'{"type":{}}'])
def test_an_unhashable_type_field_raises_value_error(line: bytes) -> None:
    # The agent drops bad worker messages by catching ValueError; anything else
    # escapes its reader loop.
    with pytest.raises(ValueError):
        decode(line)


def test_worker_messages_are_every_message_a_worker_sends_that_its_agent_forwards() -> None:
    """The manager routes a report by WORKER_MESSAGES (a worker's, or the agent's own): a new one must be listed."""
    names = list(Message.registry)
    sent_by_workers = names[names.index("Hello"):names.index("Preempt")]  # the "worker -> agent" section
    kept_by_the_agent = {"Heartbeat", "SpareReady", "RankProgress"}
    assert {cls.__name__ for cls in messages.WORKER_MESSAGES} == set(sent_by_workers) - kept_by_the_agent
    from undying.manager.manager import HANDLERS

    for cls in messages.WORKER_MESSAGES:
        assert cls in HANDLERS, cls.__name__
