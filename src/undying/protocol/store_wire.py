"""The job's store on the wire: frames, the handshake that proves the job's key, the requests.

The manager's control store and each generation's rendezvous store hold what
the control plane relies on: the current generation, which process owns which
rank, the ranks' gloo addresses. c10d's ``TCPStore`` answers anyone who reaches
its port and lists its keys on request, so a secret key prefix would hide
nothing; undying serves these stores itself, behind a handshake, on one port.

Handshake (every connection, before any request), with ``K`` the store key
(``HMAC-SHA256(token, label)``, never the token itself):

1. server -> client: ``Challenge(nonce_s)``, 32 random bytes;
2. client -> server: ``Proof(store, nonce_c, HMAC(K, "client" | nonce_s | nonce_c | store))``;
3. server -> client: ``Welcome(HMAC(K, "server" | nonce_s | nonce_c | store))`` when the
   proof holds and the store is open, else ``Refused(reason)`` and the connection closes.

Both sides prove the key (a client talks only to the real manager), neither
sends it, and a fresh nonce each side makes a recorded exchange worthless. A
connection that does not finish the handshake within its deadline is closed;
requests then travel as length-prefixed msgpack frames of at most
``MAX_FRAME`` bytes. What this does not do is encrypt: docs/security.md says
what an eavesdropper on the network sees.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

import msgspec

from undying.protocol import framing
from undying.protocol.env import STORE_KEY_ENV

__all__ = [
    "CONTROL_STORE", "MAX_FRAME", "NONCE_BYTES",
    "store_key_from_token", "key_from_environ", "generation_store",
    "Challenge", "Proof", "Welcome", "Refused", "Request", "Reply",
    "proof_of", "frame", "read_frame_length", "decode",
]

CONTROL_STORE = "control"
# A store holds addresses and small records; a bigger frame is an attack or a bug
MAX_FRAME = 64 * 1024 * 1024
NONCE_BYTES = 32
_LABEL = b"undying store key v1"


def store_key_from_token(token: str) -> bytes:
    """The job's store key: derived from its token, so it is exactly as secret, and never the
    token."""
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).digest()


def key_from_environ(environ: Mapping[str, str]) -> bytes | None:
    """The key an agent handed its worker, None when it handed none (a malformed one is an
    error)."""
    value = environ.get(STORE_KEY_ENV, "")
    if not value:
        return None
    try:
        key = bytes.fromhex(value)
    except ValueError as e:
        raise ValueError(f"env {STORE_KEY_ENV} is not hex ({e}); it is set by undying's agent, "
                         "do not set it by hand") from e
    if len(key) < 16:
        raise ValueError(f"env {STORE_KEY_ENV} is {len(key)} bytes; undying's agent sets 32")
    return key


def generation_store(generation: int) -> str:
    """The name of generation ``generation``'s rendezvous store on the manager's store server."""
    return f"gen/{generation}"


class Challenge(msgspec.Struct, tag=True):
    nonce: bytes


class Proof(msgspec.Struct, tag=True):
    store: str
    nonce: bytes
    proof: bytes


class Welcome(msgspec.Struct, tag=True):
    proof: bytes


class Refused(msgspec.Struct, tag=True):
    reason: str


class Request(msgspec.Struct, array_like=True):
    """One store call: ``op`` with its arguments (keys are str, values bytes, timeouts seconds)."""

    op: str
    keys: list[str] = []
    values: list[bytes] = []
    number: int = 0
    timeout: float = 0.0


class Reply(msgspec.Struct, array_like=True):
    """``ok`` with what the call returns, or an ``error`` of a kind ("timeout", "closed", "bad")."""

    ok: bool
    values: list[bytes] = []
    number: int = 0
    error: str = ""
    kind: str = ""


_Handshake = Challenge | Proof | Welcome | Refused
_encoder = msgspec.msgpack.Encoder()
_handshake_decoder = msgspec.msgpack.Decoder(_Handshake)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def proof_of(key: bytes, side: str, server_nonce: bytes, client_nonce: bytes, store: str) -> bytes:
    """What ``side`` ("client" or "server") shows to prove it holds ``key`` for this exchange."""
    message = b"|".join([side.encode(), server_nonce, client_nonce, store.encode()])
    return hmac.new(key, message, hashlib.sha256).digest()


def frame(message: msgspec.Struct) -> bytes:
    """``message`` with its length in front (``undying.protocol.framing``)."""
    return framing.pack(_encoder.encode(message), MAX_FRAME)


def read_frame_length(header: bytes) -> int:
    """The body length a 4-byte header announces; ValueError past ``MAX_FRAME``."""
    return framing.body_length(header, MAX_FRAME)


def decode(body: bytes, kind: str) -> Any:
    """A handshake message, a Request or a Reply; msgspec.DecodeError on anything else."""
    decoders: dict[str, msgspec.msgpack.Decoder[Any]] = {
        "handshake": _handshake_decoder, "request": _request_decoder, "reply": _reply_decoder}
    return decoders[kind].decode(body)
