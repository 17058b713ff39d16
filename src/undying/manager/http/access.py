"""The manager's check of the token a caller shows: over HTTP, and in a node's join.

Where the token is kept and how a caller finds and sends it is the job's
(``undying.jobfiles.tokens``); reading it back from a request and comparing it
with the job's is the manager's alone.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from undying.jobfiles.tokens import AUTH_HEADER, TOKEN_HEADER

__all__ = ["tokens_match", "token_from_headers"]

_BEARER = "bearer "


def tokens_match(given: str | None, expected: str) -> bool:
    """Whether ``given`` is the token, in time that does not depend on where they differ."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8"))


def token_from_headers(headers: Mapping[str, str]) -> str | None:
    """The token a request shows, from ``Authorization: Bearer`` or ``X-Undying-Token``;
    None if neither."""
    auth = headers.get(AUTH_HEADER, "")
    if auth[: len(_BEARER)].lower() == _BEARER:
        return auth[len(_BEARER):].strip()
    other = headers.get(TOKEN_HEADER)
    return other.strip() if other is not None else None
