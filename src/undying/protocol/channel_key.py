"""The key a process must show before its agent listens to it.

The agent's worker channel listens on loopback, where every local user can
connect; without a key, another user's process could report fake steps or
failures for any rank, or pose as a warm spare (issue #14, finding 1). The
agent makes a fresh random key, gives it to the processes it starts in their
environment (readable only by the same user, through /proc), and drops every
connection whose first line is not that key. The key never leaves the machine.
"""

from __future__ import annotations

import hmac
import os
import secrets

from undying.protocol.env import AGENT_KEY_ENV

__all__ = ["hello_line", "new_key", "shows_key"]


def new_key() -> str:
    return secrets.token_hex(16)


def hello_line(key: str | None = None) -> bytes:
    """The first line a worker or spare sends its agent (the key from its environment by
    default)."""
    return (os.environ.get(AGENT_KEY_ENV, "") if key is None else key).encode() + b"\n"


def shows_key(line: bytes, key: str) -> bool:
    """Whether ``line`` (a connection's first line) is ``key``, compared in constant time."""
    return hmac.compare_digest(line.strip(), key.encode())
