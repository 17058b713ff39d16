"""A real store server of the manager's kind (``undying.manager.stores``) for unit tests of the stores and of
the processes that use them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from undying.manager.stores import StoreServer
from undying.protocol.store_wire import store_key_from_token

__all__ = ["KEY", "serving"]

KEY = store_key_from_token("the job's token")


@contextlib.contextmanager
def serving() -> Iterator[StoreServer]:
    """A server on a free loopback port with the control store open, closed on the way out."""
    made = StoreServer("127.0.0.1", 0, KEY, handshake_timeout=1.0, max_pending=8)
    made.open("control")
    try:
        yield made
    finally:
        made.close()
