"""The job's stores, served by the manager on one port, to clients that prove the job's key.

The control store (the current generation, which process owns which rank) and
each generation's rendezvous store (the ranks' gloo addresses) are what the
control plane relies on. c10d's ``TCPStore`` server binds every interface and
answers anyone, and lists its keys on request; so the manager serves these
stores itself (the wire and the handshake are ``undying.protocol.store_wire``):

- on one listening socket, bound to the job's address only (loopback for a
  single-node job), never ``0.0.0.0``;
- each connection names a store and proves the job's store key before its
  first request; one that does not within ``handshake_timeout`` is closed, and
  at most ``max_pending`` connections may be unproven at once;
- closing a store (a generation superseded) closes every connection to it,
  which fails every wait on it at once, as closing a TCPStore did.

The server runs its own event loop in a thread of its own, so a manager busy
deciding a recovery still answers the ranks, as TCPStore's C++ thread did.
The manager reaches its stores in-process through ``StoreHandle`` (no socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec

from undying.protocol.store_wire import (
    MAX_FRAME,
    NONCE_BYTES,
    Challenge,
    Proof,
    Refused,
    Reply,
    Request,
    Welcome,
    decode,
    frame,
    proof_of,
    read_frame_length,
)

__all__ = ["StoreServer", "StoreHandle", "StoreClosedError"]

log = logging.getLogger(__name__)

_BACKLOG = 512
_MAX_STORE_NAME = 200
_MAX_KEYS = 65536  # keys in one request
_T = TypeVar("_T")


class StoreClosedError(RuntimeError):
    """The store was closed (its generation superseded, the server stopped)."""


class _Timeout(Exception):
    pass


class _Store:
    """One named store: its keys, and the waits on them. Touched only in the server's loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.data: dict[str, bytes] = {}
        self.closed = False
        self.connections: set[asyncio.StreamWriter] = set()
        self._waiters: set[asyncio.Future[None]] = set()

    def changed(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def close(self) -> None:
        self.closed = True
        self.changed()
        for writer in list(self.connections):
            writer.transport.abort()  # the client's next read fails at once: its waits end
        self.connections.clear()

    async def until(self, keys: list[str], timeout: float) -> None:
        """Return when every key is set; _Timeout after ``timeout`` s; StoreClosedError if
        closed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while True:
            if self.closed:
                raise StoreClosedError(f"store {self.name} was closed")
            if all(key in self.data for key in keys):
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _Timeout(f"wait timeout after {timeout:.1f}s for keys {keys[:4]}")
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.add(waiter)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waiter, remaining)
            self._waiters.discard(waiter)

    async def call(self, request: Request) -> Reply:
        """One store call, with c10d's semantics (``get`` and ``multi_get`` wait for their keys)."""
        op, keys, values = request.op, request.keys, request.values
        if len(keys) > _MAX_KEYS:
            return Reply(False, error=f"{len(keys)} keys in one request (at most {_MAX_KEYS})",
                         kind="bad")
        try:
            if op == "set" and len(keys) == 1 == len(values):
                self.data[keys[0]] = values[0]
                self.changed()
                return Reply(True)
            if op in ("get", "multi_get"):
                await self.until(keys, request.timeout)
                return Reply(True, values=[self.data[k] for k in keys])
            if op == "wait":
                await self.until(keys, request.timeout)
                return Reply(True)
            if op == "check":
                return Reply(True, number=int(all(k in self.data for k in keys)))
            if op == "add" and len(keys) == 1:
                number = int(self.data.get(keys[0], b"0")) + request.number
                self.data[keys[0]] = str(number).encode()
                self.changed()
                return Reply(True, number=number)
            if op == "compare_set" and len(keys) == 1 and len(values) == 2:
                return Reply(True, values=[self._compare_set(keys[0], values[0], values[1])])
            if op == "delete_key" and len(keys) == 1:
                return Reply(True, number=int(self.data.pop(keys[0], None) is not None))
            if op == "num_keys":
                return Reply(True, number=len(self.data))
            if op == "multi_set" and len(keys) == len(values):
                self.data.update(zip(keys, values, strict=True))
                self.changed()
                return Reply(True)
            if op == "append" and len(keys) == 1 == len(values):
                self.data[keys[0]] = self.data.get(keys[0], b"") + values[0]
                self.changed()
                return Reply(True)
            if op == "list_keys":
                return Reply(True, values=[k.encode() for k in self.data])
        except _Timeout as e:
            return Reply(False, error=str(e), kind="timeout")
        except ValueError as e:  # add on a value that is no number
            return Reply(False, error=f"{op}: {e}", kind="bad")
        return Reply(False, error=f"unknown or malformed store call {op!r}", kind="bad")

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self.data.get(key)
        if current is None:
            if expected:
                return expected
        elif current != expected:
            return current
        self.data[key] = desired
        self.changed()
        return desired


class StoreServer:
    """The manager's stores, on ``host``:``port`` (0: a free port) and nowhere else.

    Raises OSError when the address cannot be bound (in use, not this host's).
    """

    def __init__(self, host: str, port: int, key: bytes, *, handshake_timeout: float = 5.0,
                 max_pending: int = 256, max_connections: int = 16384) -> None:
        self._key = key
        self._handshake_timeout = handshake_timeout
        self._max_pending = max_pending
        self._max_connections = max_connections
        self._stores: dict[str, _Store] = {}
        self._pending = 0
        self._connections = 0
        self.refused = 0  # connections that did not prove the key (for tests, metrics and the log)
        self._last_refusal_log = 0.0
        sock = _bind(host, port)
        self.host = host
        self.port: int = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        started = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(sock, started, failed),
                                        name="undying-store-server", daemon=True)
        self._thread.start()
        started.wait(10.0)
        if failed:
            raise failed[0]

    # --- the manager's side -------------------------------------------------

    def open(self, name: str) -> StoreHandle:
        """A new, empty store ``name`` (an open one of that name is closed first)."""
        async def create() -> None:
            old = self._stores.get(name)
            if old is not None:
                old.close()
            self._stores[name] = _Store(name)
        self._in_loop(create(), 10.0)
        return StoreHandle(self, name)

    def drop(self, name: str) -> None:
        """Close store ``name``: its connections close and every wait on it fails now."""
        async def close() -> None:
            store = self._stores.pop(name, None)
            if store is not None:
                store.close()
        if self._loop.is_running():
            self._in_loop(close(), 10.0)

    def close(self) -> None:
        """Stop serving: every store closes, the port is released."""
        if not self._loop.is_running():
            return
        async def stop() -> None:
            for store in list(self._stores.values()):
                store.close()
            self._stores.clear()
            if self._server is not None:
                self._server.close()
        with contextlib.suppress(Exception):
            self._in_loop(stop(), 10.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)

    def call(self, name: str, request: Request) -> Reply:
        async def run() -> Reply:
            store = self._stores.get(name)
            if store is None:
                raise StoreClosedError(f"store {name} is closed")
            return await store.call(request)
        return self._in_loop(run(), request.timeout + 10.0)

    def _in_loop(self, work: Coroutine[Any, Any, _T], timeout: float) -> _T:
        """Run ``work`` on the server's loop (its stores are touched there only) and wait for it."""
        if not self._loop.is_running():
            work.close()
            raise StoreClosedError("the store server is stopped")
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout)

    # --- the network's side -------------------------------------------------

    def _run(self, sock: socket.socket, started: threading.Event,
             failed: list[BaseException]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, sock=sock, limit=MAX_FRAME))
        except BaseException as e:
            failed.append(e)
            sock.close()
            started.set()
            return
        started.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._server.wait_closed())
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._pending >= self._max_pending or self._connections >= self._max_connections:
            writer.transport.abort()  # the cap: a flood of connections costs the job nothing
            return
        self._connections += 1
        self._pending += 1
        store: _Store | None = None
        try:
            try:
                store = await self._handshake(reader, writer)
            finally:
                self._pending -= 1  # proven, refused or gone: no longer pending, whichever
            if store is None:
                return
            store.connections.add(writer)
            while not store.closed:
                # no deadline: a rank may train for days between calls
                body = await _read_frame(reader)
                try:
                    request = decode(body, "request")
                except msgspec.DecodeError as e:
                    reply = Reply(False, error=f"a malformed store request ({e})", kind="bad")
                else:
                    try:
                        reply = await store.call(request)
                    except StoreClosedError as e:
                        reply = Reply(False, error=str(e), kind="closed")
                writer.write(frame(reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.TimeoutError,
                OSError):
            pass
        finally:
            if store is not None:
                store.connections.discard(writer)
            self._connections -= 1
            writer.transport.abort()

    async def _handshake(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> _Store | None:
        """The store the client proved the key for; None (connection refused) otherwise."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        writer.write(frame(Challenge(nonce)))
        try:
            body = await asyncio.wait_for(_read_frame(reader), self._handshake_timeout)
            proof = decode(body, "handshake")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, msgspec.DecodeError,
                OSError):
            self._refuse("no handshake")
            return None
        if (not isinstance(proof, Proof) or len(proof.nonce) != NONCE_BYTES
                or len(proof.store) > _MAX_STORE_NAME
                or not hmac.compare_digest(
                    proof.proof, proof_of(self._key, "client", nonce, proof.nonce, proof.store))):
            self._refuse("a wrong proof of the job's key")
            writer.write(frame(Refused("the job's store key was not shown; only the job's own "
                                       "processes may use its stores")))
            await _drain(writer)
            return None
        store = self._stores.get(proof.store)
        if store is None or store.closed:
            writer.write(
                frame(Refused(f"store {proof.store!r} is closed (Connection closed by peer)")))
            await _drain(writer)
            return None
        writer.write(frame(Welcome(proof_of(self._key, "server", nonce, proof.nonce, proof.store))))
        await _drain(writer)
        return store

    def _refuse(self, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        # a flood of strangers grows the log by a line per 10 s
        if now - self._last_refusal_log >= 10.0:
            self._last_refusal_log = now
            log.warning("store server on %s:%d: refused a connection (%s); %d refused so far",
                        self.host, self.port, why, self.refused)


class StoreHandle:
    """The manager's own hold on one of its stores: the calls it needs, in-process, thread-safe."""

    def __init__(self, server: StoreServer, name: str) -> None:
        self._server = server
        self.name = name

    @property
    def port(self) -> int:
        return self._server.port

    def set(self, key: str, value: str | bytes) -> None:
        self._checked(Request("set", [key], [value.encode() if isinstance(value, str) else value]))

    def get(self, key: str) -> bytes:
        """The value of ``key``, which must be set (the manager reads only what it wrote)."""
        return self._checked(Request("get", [key])).values[0]

    def list_keys(self) -> list[str]:
        return [key.decode() for key in self._checked(Request("list_keys")).values]

    def close(self) -> None:
        self._server.drop(self.name)

    def _checked(self, request: Request) -> Reply:
        reply = self._server.call(self.name, request)
        if not reply.ok:
            raise KeyError(reply.error) if reply.kind == "timeout" else RuntimeError(reply.error)
        return reply


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    length = read_frame_length(await reader.readexactly(4))
    return await reader.readexactly(length)


async def _drain(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        await asyncio.wait_for(writer.drain(), 5.0)


def _bind(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock
