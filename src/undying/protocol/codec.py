"""One codec for every message channel: typed messages as tagged msgspec structs.

A message is a frozen ``msgspec.Struct`` whose JSON object carries its class
name in ``"type"``. Each receiving end decodes its channel's lines with one
``Codec`` built over the union of what may arrive there, so a line is checked
once, at the boundary, and comes out typed: an unknown type, a missing or
unknown field, a field of the wrong type is a ``MessageError`` (a
``ValueError``) naming the line, never an error deep inside a handler.

Framing: one JSON object per line (``encode`` ends it with a newline; JSON
text never holds a raw one). ``Handlers`` maps a decoded message's class to
the receiver's handler for it, so no receiver dispatches by ``isinstance``.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import msgspec

__all__ = ["Message", "MessageError", "Codec", "Handlers", "Choice", "members"]

M = TypeVar("M", bound=msgspec.Struct)
R = TypeVar("R")

_SHOWN = 200  # how much of a bad line an error quotes


class Message(msgspec.Struct, frozen=True, tag_field="type", tag=True, forbid_unknown_fields=True,
              omit_defaults=True):
    """Base of every message: its class name travels as ``"type"``; unknown fields are refused.

    A field at its default is left out of the line (the receiver fills it in): fewer bytes a
    message.
    """


class MessageError(ValueError):
    """A line that is no message of its channel: malformed JSON, an unknown type, bad fields."""


def members(union: Any) -> tuple[type[msgspec.Struct], ...]:
    """The message classes of a union (``A | B`` or ``Union[A, B]``), in order."""
    found = typing.get_args(union) or (union,)
    return tuple(typing.cast(type[msgspec.Struct], cls) for cls in found)


class Codec(Generic[M]):
    """Encode any message; decode a line into one of ``union``'s messages, or raise
    ``MessageError``."""

    def __init__(self, union: Any, channel: str) -> None:
        self.types = members(union)
        self.channel = channel
        self._tag_field = str(self.types[0].__struct_config__.tag_field)
        self._tags = {str(cls.__struct_config__.tag) for cls in self.types}
        self._decoder: msgspec.json.Decoder[M] = msgspec.json.Decoder(union)

    def decode(self, line: Any) -> M:
        """``line``: bytes, str, or a buffer such as a report's ``msgspec.Raw``."""
        try:
            return self._decoder.decode(line)
        except msgspec.ValidationError as e:
            raise MessageError(self._explain(line, str(e))) from None
        except msgspec.DecodeError as e:
            raise MessageError(f"malformed message on the {self.channel} ({e}): "
                               f"{_quote(line)}") from None

    def _explain(self, line: Any, error: str) -> str:
        """A validation error said in the channel's words: which type, which field."""
        try:
            body = msgspec.json.decode(line)
        except msgspec.DecodeError as e:  # the type was checked before the JSON's end was seen
            return f"malformed message on the {self.channel} ({e}): {_quote(line)}"
        kind = body.get(self._tag_field) if isinstance(body, dict) else None
        if kind is None:
            return f"a message without a type on the {self.channel} ({error}): {_quote(line)}"
        if not isinstance(kind, str) or kind not in self._tags:
            return (f"unknown message type {kind!r:.50} on the {self.channel} (expected one of "
                    f"{', '.join(sorted(self._tags))}): {_quote(line)}")
        return f"bad fields for {kind} on the {self.channel}: {error}: {_quote(line)}"

    @staticmethod
    def encode(message: msgspec.Struct) -> bytes:
        """The message as one line (its JSON object and a newline)."""
        return _encoder.encode(message) + b"\n"

    @staticmethod
    def encode_object(message: msgspec.Struct) -> bytes:
        """The message's JSON object alone (a report inside a line of several)."""
        return _encoder.encode(message)


_encoder = msgspec.json.Encoder()


def _quote(line: Any) -> str:
    text = line if isinstance(line, str | bytes) else bytes(memoryview(line))
    return f"{text!r:.{_SHOWN}}"


class Handlers(Generic[R]):
    """A receiver's table from message class to handler, built once; ``handle`` calls the one for a
    message.

    ``Handlers({StepCommitted: self._on_commit, Hello: self._on_hello})``;
    ``handle(message, *context)`` calls ``handler(message, *context)`` (the
    connection it came on, say). A message of a class with no handler goes to
    ``otherwise``; without one, that is a ``MessageError`` (a message this
    receiver does not take is a bug of its sender).
    """

    def __init__(self, table: Mapping[type[Any], Callable[..., R]],
                 otherwise: Callable[..., R] | None = None) -> None:
        self._table = dict(table)
        self._otherwise = otherwise

    def __contains__(self, cls: object) -> bool:
        return cls in self._table

    def handle(self, message: Any, *context: Any) -> R:
        handler = self._table.get(type(message))
        if handler is not None:
            return handler(message, *context)
        if self._otherwise is not None:
            return self._otherwise(message, *context)
        raise MessageError(f"no handler for {type(message).__name__} here: {message!r:.{_SHOWN}}")

    def missing(self, types: Iterable[type[Any]]) -> list[str]:
        """The names of ``types`` this table has no handler for (a test's check that a receiver
        takes them all)."""
        return [cls.__name__ for cls in types if cls not in self._table]


class _ChoiceType(enum.EnumMeta):
    """``"crash" in InjectKind`` answers for plain strings too (Python 3.12's rule; 3.11 raises
    TypeError)."""

    def __contains__(cls, value: object) -> bool:
        if isinstance(value, enum.Enum):
            return isinstance(value, cls)
        return value in cls._value2member_map_


class Choice(enum.StrEnum, metaclass=_ChoiceType):
    """A closed set of names that travel as plain strings (``str(member)`` is its value)."""

    @classmethod
    def names(cls) -> str:
        """The values joined for an error message: ``crash, hang, comm-error, slow``."""
        return ", ".join(member.value for member in cls)
