"""What crosses the channel between an agent and its worker zygote (a Unix socket pair).

Length-prefixed frames (``undying.protocol.framing``), each a JSON object
whose ``op`` names it. Agent to zygote: ``Spawn`` (the descriptors named by
``stdio``, the agent's open ones of 0, 1, 2, ride with its first byte).
Zygote to agent: ``Ready`` or ``Unfit`` once, ``Spawned`` or ``Failed`` per
Spawn. No exit status crosses it: a worker is the agent's own child (the
zygote forks it detached), so the agent sees its exit itself, whatever the
zygote does. Each end decodes with one codec over what it may receive
(``ZygoteFrames``).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from undying.protocol import framing
from undying.protocol.codec import Codec

__all__ = ["Spawn", "Ready", "Unfit", "Spawned", "Failed", "ToZygote", "FromZygote",
           "MAX_FRAME", "encode_frame", "ZygoteFrames", "to_zygote", "from_zygote"]

MAX_FRAME = 16 << 20  # an environment is kilobytes; a length past this is a broken channel


class _Op(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    """Base of the zygote channel's frames: ``op`` names each."""


class Spawn(_Op, frozen=True, tag="spawn"):
    """Fork a worker: boot's arguments, its whole environment, its working directory, which of 0-2
    come."""

    id: int
    args: list[str]
    env: dict[str, str]
    cwd: str
    stdio: list[int]


class Ready(_Op, frozen=True, tag="ready"):
    pid: int


class Unfit(_Op, frozen=True, tag="unfit"):
    """The zygote cannot fork safely (a thread started at import, no pidfd_open): why."""

    error: str


class Spawned(_Op, frozen=True, tag="spawned"):
    id: int
    pid: int


class Failed(_Op, frozen=True, tag="failed"):
    id: int
    error: str


ToZygote = Spawn
FromZygote = Ready | Unfit | Spawned | Failed

T = TypeVar("T")


def encode_frame(message: _Op) -> bytes:
    return framing.pack(Codec.encode_object(message), MAX_FRAME)


class ZygoteFrames(Generic[T]):
    """Typed frames out of the channel's byte stream, read in pieces; ValueError on a bad one."""

    def __init__(self, union: Any, channel: str) -> None:
        self._bodies = framing.FrameReader(MAX_FRAME)
        self._codec: Codec[Any] = Codec(union, channel)

    def feed(self, data: bytes) -> list[T]:
        return [self._codec.decode(body) for body in self._bodies.feed(data)]


def to_zygote() -> ZygoteFrames[ToZygote]:
    """The zygote's reader of what its agent sends."""
    return ZygoteFrames(ToZygote, "zygote's channel from its agent")


def from_zygote() -> ZygoteFrames[FromZygote]:
    """The agent's reader of what its zygote sends."""
    return ZygoteFrames(FromZygote, "agent's channel from its zygote")
