"""The manager proves the job's key to a command before the command shows it the token.

A command finds its manager's address in ``<job dir>/manager.json`` or in
``--manager``; either may name a listener that is not the job's manager (a
file planted or left stale, a port taken over after a crash). The token is
sent only on a connection where the listener first proved that it holds the
job's key:

1. the command opens a connection and sends ``GET /api/hello`` with a fresh
   32-byte nonce in ``X-Undying-Nonce`` (no token);
2. the manager answers ``{"job_id": J, "peer": P, "proof": HMAC(K, ...)}``
   where ``P`` is the command's address as the manager sees the connection
   and ``K = HMAC-SHA256(token, "undying API proof v1")`` (``proof_key``);
3. the command checks the proof in constant time (and ``J``, when it knows
   the job), and, where the manager runs on this host, that ``P`` is its own
   end of the connection; then it sends its request, with the token, on that
   same connection.

Neither the token nor ``K`` crosses the wire in the hello, and a fresh nonce
makes a recorded answer worthless. Binding ``P`` stops a relay: a listener
that forwards the hello to the real manager gets a proof for its own
connection, which the command rejects. Across hosts (NAT, a port-forward) the
manager may see another address, so ``P`` is checked only where both ends
are on one host; there the defence against an on-path relay is the network.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = [
    "HELLO_PATH", "NONCE_HEADER", "NONCE_BYTES", "proof_key", "proof_of", "peer_name",
    "parse_nonce",
]

HELLO_PATH = "/api/hello"
NONCE_HEADER = "X-Undying-Nonce"
NONCE_BYTES = 32
_LABEL = b"undying API proof v1"


def proof_key(token: str) -> bytes:
    """The key a manager proves itself with: derived from the token, never the token."""
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).digest()


def peer_name(address: object) -> str:
    """A socket address as both ends write it: ``host|port``, an IPv4-mapped IPv6 host as plain
    IPv4."""
    if not isinstance(address, tuple) or len(address) < 2:
        return "?"
    host = str(address[0])
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:"):]
    return f"{host}|{address[1]}"


def proof_of(key: bytes, nonce: bytes, job_id: str, peer: str) -> str:
    """The manager's answer to ``nonce``, hex: bound to the job and to the connection it came on."""
    message = b"\0".join([b"manager", nonce, job_id.encode("utf-8", "surrogateescape"),
                          peer.encode()])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def parse_nonce(raw: str | None) -> bytes | None:
    """The nonce of a hello (hex of ``NONCE_BYTES`` bytes), None when it is missing or malformed."""
    if raw is None or len(raw) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(raw)
    except ValueError:
        return None
