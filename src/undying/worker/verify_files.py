"""The files of ``verify/`` under the job's MAC: whoever can write the folder cannot make a rank
load a byte.

A rank and the job's verifier meet through files in ``<job dir>/verify/``
(``worker.verify``): pre-step states, batches, requests, verdicts. A rank
loads a pre-step state on a roll-back and rank 0 acts on the verdicts, so a
file planted there (another local user, a shared folder) would be loaded into
every rank. So every file is *sealed*: ``MAGIC``, then an HMAC-SHA256 of the
file's name and its bytes under the job's *verify key*, then the bytes. The
name is in the MAC, so a sealed file moved to another slot (another step, an
older round) fails too. A reader opens a file only through ``unseal``: an
unsigned, forged or torn file raises ``ForgedFile`` with the reason, and its
bytes are never decoded (no ``torch.load`` of them, no JSON).

The verify key is derived from the job's checkpoint key (``checkpoint.mac``,
which the agent hands every rank), as that key is from the token: a rank
holds it already. The verifier, which gets none of the job's keys, gets this
one only (``VERIFY_KEY_ENV``): it can seal its verdicts and check what the
ranks sealed, and sign no checkpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from undying.checkpoint.mac import key_from_environ
from undying.errors import UndyingError
from undying.protocol.env import VERIFY_KEY_ENV

__all__ = ["ForgedFile", "verify_key", "key_for_verifier", "seal", "unseal", "save_sealed",
           "load_sealed"]

MAGIC = b"undying-verify-1\n"
_LABEL = b"undying verify files v1"
_MAC_BYTES = 32


class ForgedFile(UndyingError):
    """A file of ``verify/`` that does not carry the job's MAC: not written by the job, never
    loaded."""


def verify_key(checkpoint_key: bytes) -> bytes:
    """The job's verify key: derived from its checkpoint key, never that key itself."""
    return hmac.new(checkpoint_key, _LABEL, hashlib.sha256).digest()


def key_for_verifier(environ: Mapping[str, str] | None = None) -> bytes | None:
    """This process's verify key: the verifier's own (VERIFY_KEY_ENV), or a rank's from its
    checkpoint key."""
    env = os.environ if environ is None else environ
    given = env.get(VERIFY_KEY_ENV, "")
    if given:
        try:
            key = bytes.fromhex(given)
        except ValueError:
            return None
        return key if len(key) == _MAC_BYTES else None
    checkpoint_key = key_from_environ(env)
    return verify_key(checkpoint_key) if checkpoint_key is not None else None


def _mac(key: bytes, name: str, data: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + data, hashlib.sha256).digest()


def seal(path: Path, data: bytes, key: bytes) -> None:
    """Write ``data`` to ``path`` whole (aside, then renamed) with its MAC; the reader never sees
    half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + _mac(key, path.name, data) + data)
    os.replace(tmp, path)


def unseal(path: Path, key: bytes) -> bytes:
    """The bytes a sealed file holds, once its MAC is the job's; ``ForgedFile`` says why not
    (OSError: unreadable)."""
    raw = path.read_bytes()
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + _MAC_BYTES:
        raise ForgedFile(f"verify/{path.name} carries no MAC of the job: another process wrote "
                         "it (or it is torn); refused, not loaded")
    claimed = raw[len(MAGIC):len(MAGIC) + _MAC_BYTES]
    data = raw[len(MAGIC) + _MAC_BYTES:]
    if not hmac.compare_digest(claimed, _mac(key, path.name, data)):
        raise ForgedFile(f"verify/{path.name} fails the job's MAC: written or changed by a "
                         "process without the job's key, or moved from another name; refused, "
                         "not loaded")
    return data


def save_sealed(path: Path, obj: Any, key: bytes) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    seal(path, buffer.getvalue(), key)


def load_sealed(path: Path, key: bytes) -> Any:
    """A sealed ``torch.save`` file, loaded with ``weights_only=True`` once its MAC is the job's."""
    return torch.load(io.BytesIO(unseal(path, key)), weights_only=True)
