"""Length-prefixed frames: a 4-byte big-endian length, then the body.

One framing for undying's binary channels (the job's stores, an agent's zygote),
each with its own bound: a length past it is a broken or hostile peer, refused
before a byte of the body is buffered.
"""

from __future__ import annotations

import struct

__all__ = ["HEADER", "pack", "body_length", "FrameReader"]

HEADER = struct.Struct(">I")


def pack(body: bytes, limit: int) -> bytes:
    """``body`` with its length in front; ValueError past ``limit``."""
    if len(body) > limit:
        raise ValueError(f"a message of {len(body)} bytes is over the limit of {limit}")
    return HEADER.pack(len(body)) + body


def body_length(header: bytes, limit: int) -> int:
    """The body length a header announces; ValueError past ``limit``."""
    (length,) = HEADER.unpack(header)
    if length > limit:
        raise ValueError(f"a frame of {length} bytes announced (the limit is {limit})")
    return int(length)


class FrameReader:
    """Bodies out of a byte stream read in pieces (a non-blocking socket)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        bodies = []
        while len(self._buffer) >= HEADER.size:
            length = body_length(bytes(self._buffer[:HEADER.size]), self._limit)
            if len(self._buffer) < HEADER.size + length:
                break
            bodies.append(bytes(self._buffer[HEADER.size:HEADER.size + length]))
            del self._buffer[:HEADER.size + length]
        return bodies
