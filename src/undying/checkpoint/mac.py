"""Keyed integrity of checkpoints: an HMAC-SHA256 over the manifest, under a key only the job holds.

A checksum in the manifest tells a torn or bit-rotted file from a good one, but
whoever can write a checkpoint folder can recompute it: a plain digest proves
nothing about who wrote the file. So every manifest a job commits carries
``mac``, an HMAC-SHA256 of its canonical JSON (everything but ``mac`` itself)
under the job's checkpoint key, and every file it lists is checksummed with
SHA-256. A reader that holds the key recomputes the MAC before it trusts a
single byte: a changed tensor, a swapped file or a recomputed digest all fail
it, and the checkpoint is skipped with the reason.

The key is derived from the job's token (``HMAC-SHA256(token, label)``), so it
is exactly as secret as the token (``<job dir>/token``, mode 0600, or env
``UNDYING_TOKEN``) and needs no second secret to distribute: every process that
may talk to the manager may also sign and check its checkpoints. Jobs that share
a token (a relaunch, a job resumed from another job's folder under the same
token) share the key; a checkpoint signed under another token fails the MAC.

The key is configured once per process at its entry point (the launcher, the
manager, an agent for its workers, ``undying checkpoints``): library calls made
outside a job neither sign nor check, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from undying.protocol.env import CHECKPOINT_KEY_ENV

__all__ = [
    "key_from_token",
    "set_key",
    "using_key",
    "current_key",
    "key_from_environ",
    "mac_of",
    "mac_problem",
    "signed_by_us",
]

_LABEL = b"undying checkpoint MAC v1"
_state: dict[str, bytes | None] = {"key": None}


def key_from_token(token: str) -> bytes:
    """The job's checkpoint key: derived from its token, never the token itself."""
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).digest()


def set_key(key: bytes | None) -> None:
    """Sign every manifest this process commits, and check every one it reads, with ``key`` (None:
    neither)."""
    _state["key"] = key


@contextlib.contextmanager
def using_key(key: bytes | None) -> Iterator[None]:
    """``set_key(key)`` for the duration of a block (a command inside a longer-lived process, a
    test)."""
    before = _state["key"]
    _state["key"] = key
    try:
        yield
    finally:
        _state["key"] = before


def current_key() -> bytes | None:
    return _state["key"]


def key_from_environ(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The key an agent handed its worker (env ``UNDYING_CHECKPOINT_KEY``), None when it handed
    none."""
    value = (os.environ if environ is None else environ).get(CHECKPOINT_KEY_ENV, "")
    if not value:
        return None
    try:
        key = bytes.fromhex(value)
    except ValueError:
        return None
    return key if len(key) == 32 else None


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def mac_of(manifest: Mapping[str, Any], key: bytes) -> str:
    """The MAC of a manifest (its ``to_dict()``), hex."""
    return hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()


def mac_problem(manifest: Mapping[str, Any], key: bytes) -> str | None:
    """Why a manifest fails the job's MAC, or None when it passes."""
    claimed = manifest.get("mac")
    if not isinstance(claimed, str) or not claimed:
        return ("it has no MAC: it was not written by this job (or was written by an undying "
                "before MACs); its contents cannot be trusted")
    if not hmac.compare_digest(claimed, mac_of(manifest, key)):
        return ("its MAC does not match: the manifest or its files were changed after the job "
                "wrote them, or another job's token signed it")
    weak = [f.get("path") for f in manifest.get("files", [])
            if isinstance(f, Mapping) and "sha256" not in f]
    if weak:
        return (f"file(s) {', '.join(map(str, weak))} have no SHA-256 digest, which the MAC "
                "needs to vouch for them")
    return None


def signed_by_us(manifest: Mapping[str, Any]) -> bool:
    """Whether this process may replace or delete the checkpoint of ``manifest``: its own key signed
    it.

    With a key: the MAC verifies under it. Without one (library use outside a
    job): the manifest carries no MAC, so no job signed it. A checkpoint that
    fails this is another job's (or a stranger's, or altered): the job never
    overwrites nor prunes it (discovery.prune, commit; it may set it aside).
    """
    key = current_key()
    if key is None:
        return not manifest.get("mac")
    claimed = manifest.get("mac")
    return (isinstance(claimed, str) and bool(claimed)
            and hmac.compare_digest(claimed, mac_of(manifest, key)))
