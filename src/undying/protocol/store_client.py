"""``JobStore``: a ``torch.distributed.Store`` on the manager's authenticated store server.

Workers use it wherever they used a ``TCPStore`` client: the control store,
and the store of each generation, which ``init_process_group`` and gloo's
rendezvous run on (``get``, ``set``, ``wait``; the rest of the Store API is
here for scripts and c10d helpers). A connection proves the job's store key
before its first request (``undying.protocol.store_wire``) and checks that the
server holds it too.

Errors are c10d's: ``DistNetworkError`` when the server cannot be reached or
closes the connection (a superseded generation's store, a restarted manager),
``DistStoreError`` when a wait runs out of time; their texts carry the
phrases (``Connection closed by peer``, ``timeout``) that callers classify.
Like ``TCPStore``'s client, one connection serves one call at a time: a
``wait`` holds it until its keys are set.

``use_for_env_rendezvous`` makes ``init_process_group("env://")`` in the
user's script meet its peers on this store (the worker's boot installs it).
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast
from urllib.parse import parse_qs, urlparse

import msgspec
import torch.distributed as dist

from undying.protocol.env import GENERATION_ENV, STORE_ADDR_ENV
from undying.protocol.store_wire import (
    NONCE_BYTES,
    Challenge,
    Proof,
    Refused,
    Reply,
    Request,
    Welcome,
    decode,
    frame,
    generation_store,
    key_from_environ,
    proof_of,
    read_frame_length,
)

__all__ = ["JobStore", "hold", "use_for_env_rendezvous"]

_RETRY_S = 0.05
_MARGIN_S = 30.0  # past an op's own timeout, before a silent server counts as gone


class JobStore(dist.Store):
    """Store ``name`` on the manager's store server at ``host``:``port``, reached with ``key``.

    Connecting retries until ``timeout`` (the server may not listen yet), as
    TCPStore's client does; ``timeout`` is also every wait's default.
    """

    def __init__(self, host: str, port: int, name: str, key: bytes, timeout: timedelta) -> None:
        super().__init__()
        dist.Store.set_timeout(self, timeout)
        self._address = (host, port)
        self._name = name
        self._key = key
        self._lock = threading.Lock()
        self._sock = self._connect(time.monotonic() + timeout.total_seconds())

    def __repr__(self) -> str:
        return f"JobStore({self._address[0]}:{self._address[1]}, {self._name!r})"

    # --- torch.distributed.Store --------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._call(Request("set", [key], [_bytes(value)]))

    def get(self, key: str) -> bytes:
        return self._call(Request("get", [key], timeout=self._wait_s())).values[0]

    def add(self, key: str, value: int) -> int:
        return self._call(Request("add", [key], number=int(value))).number

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        values = [_bytes(expected_value), _bytes(desired_value)]
        return self._call(Request("compare_set", [key], values)).values[0]

    def delete_key(self, key: str) -> bool:
        return bool(self._call(Request("delete_key", [key])).number)

    def num_keys(self) -> int:
        return self._call(Request("num_keys")).number

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(Request("check", list(keys))).number)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._wait_s() if timeout is None else timeout.total_seconds()
        self._call(Request("wait", list(keys), timeout=seconds))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(Request("multi_get", list(keys), timeout=self._wait_s())).values

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call(Request("multi_set", list(keys), [_bytes(v) for v in values]))

    def append(self, key: str, value: str | bytes) -> None:
        self._call(Request("append", [key], [_bytes(value)]))

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call(Request("list_keys")).values]

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> JobStore:
        copy = JobStore(*self._address, self._name, self._key, self._timeout())
        # Handed to C++, which does not keep the Python object alive (see hold)
        _clones.append(copy)
        return copy

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            self._sock.close()

    # --- the wire ------------------------------------------------------------

    def _timeout(self) -> timedelta:
        # The C++ Store's own field: init_process_group sets it through a PrefixStore, past any
        # override.
        return cast(timedelta, cast(Any, self).timeout)

    def _wait_s(self) -> float:
        return float(self._timeout().total_seconds())

    def _connect(self, deadline: float) -> socket.socket:
        last: BaseException | None = None
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection(self._address,
                                                timeout=max(0.5, min(remaining, 10.0)))
            except OSError as e:  # not listening yet, or gone: try again until the deadline
                last = e
            else:
                try:
                    self._handshake(sock)
                    sock.settimeout(None)
                    return sock
                except BaseException:
                    sock.close()
                    raise
            if time.monotonic() + _RETRY_S >= deadline:
                raise dist.DistNetworkError(
                    f"the job's store {self._name} at {self._address[0]}:{self._address[1]} is "
                    f"unreachable (Connection refused: {last}); is the job's manager running?")
            time.sleep(_RETRY_S)

    def _handshake(self, sock: socket.socket) -> None:
        challenge = decode(_recv_frame(sock, self._name), "handshake")
        if not isinstance(challenge, Challenge) or len(challenge.nonce) != NONCE_BYTES:
            raise dist.DistNetworkError(
                f"{self._address[0]}:{self._address[1]} is no undying store server")
        nonce = secrets.token_bytes(NONCE_BYTES)
        proof = proof_of(self._key, "client", challenge.nonce, nonce, self._name)
        sock.sendall(frame(Proof(self._name, nonce, proof)))
        answer = decode(_recv_frame(sock, self._name), "handshake")
        if isinstance(answer, Refused):
            raise dist.DistNetworkError(
                f"the job's store {self._name} refused this process: {answer.reason}")
        expected = proof_of(self._key, "server", challenge.nonce, nonce, self._name)
        if not isinstance(answer, Welcome) or not hmac.compare_digest(answer.proof, expected):
            raise dist.DistNetworkError(
                f"the store server at {self._address[0]}:{self._address[1]} did not prove the "
                "job's key: it is not this job's manager")

    def _call(self, request: Request) -> Reply:
        with self._lock:
            self._sock.settimeout(max(request.timeout, self._wait_s()) + _MARGIN_S)
            try:
                self._sock.sendall(frame(request))
                reply = decode(_recv_frame(self._sock, self._name), "reply")
            except TimeoutError as e:
                raise dist.DistStoreError(f"the job's store {self._name}: no answer to "
                                          f"{request.op}: Socket Timeout ({e})") from e
            except (OSError, msgspec.DecodeError, ValueError) as e:
                raise dist.DistNetworkError(f"the job's store {self._name}: Connection closed by "
                                            f"peer during {request.op} ({e})") from e
        if reply.ok:
            return reply
        if reply.kind == "timeout":
            raise dist.DistStoreError(f"the job's store {self._name}: {reply.error}")
        if reply.kind == "closed":
            raise dist.DistNetworkError(
                f"the job's store {self._name}: Connection closed by peer ({reply.error})")
        raise ValueError(f"the job's store {self._name}: {reply.error}")


# The Python side of every store C++ may still call (see ``hold``), by role.
_held: dict[str, JobStore] = {}
_clones: list[JobStore] = []


def hold(role: str, store: JobStore) -> JobStore:
    """Keep ``store``'s Python object alive while C++ holds it; close the one held before in
    ``role``.

    A ``torch.distributed.Store`` written in Python is a pybind11 trampoline: C++
    (a PrefixStore, a process group, ``new_group`` later on) keeps the C++ half
    alive, but the overrides live on the Python object, and once that is
    collected every call from C++ fails with "Not implemented". A process group
    outlives the function that built it, so the store it stands on is held here
    until the next one of its role (the next generation's) replaces it.
    """
    old = _held.get(role)
    _held[role] = store
    if old is not None and old is not store:
        old.close()  # its generation was superseded: its connection is of no use
    return store


def _bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _recv_exactly(sock: socket.socket, n: int, name: str) -> bytes:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        chunk = sock.recv_into(view[got:])
        if chunk == 0:
            raise ConnectionResetError(f"the job's store {name}: Connection closed by peer")
        got += chunk
    return bytes(buffer)


def _recv_frame(sock: socket.socket, name: str) -> bytes:
    return _recv_exactly(sock, read_frame_length(_recv_exactly(sock, 4, name)), name)


def use_for_env_rendezvous() -> None:
    """``init_process_group`` with ``env://`` (the default) meets the current generation on the
    job's store.

    torchrun's contract hands a script ``MASTER_ADDR``/``MASTER_PORT``; under
    undying they name the manager's store server, which only answers a client
    that proves the job's key, so the ``env`` handler is replaced in this
    process: with the key in the environment it opens the generation's
    ``JobStore`` (``UNDYING_GENERATION``), else it is torch's own.
    """
    # The module; the package exports a function
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    original = rdzv._rendezvous_handlers.get("env")
    if original is None or getattr(original, "_undying", False):
        return

    def handler(
        url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any
    ) -> Iterator[Any]:
        key = key_from_environ(os.environ)
        if key is None or GENERATION_ENV not in os.environ:
            yield from original(url, timeout=timeout, **kwargs)
            return
        query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
        rank = int(query.get("rank", os.environ["RANK"]))
        world_size = int(query.get("world_size", os.environ["WORLD_SIZE"]))
        # (MASTER_ADDR/PORT are the script's own store's, TORCHELASTIC_USE_AGENT_STORE=False; the
        # job's is here)
        host, _, port = os.environ.get(STORE_ADDR_ENV, "").rpartition(":")
        address = (host or os.environ["MASTER_ADDR"], int(port or os.environ["MASTER_PORT"]))
        generation = generation_store(int(os.environ[GENERATION_ENV]))
        store = hold("generation", JobStore(*address, generation, key, timeout))
        yield (store, rank, world_size)
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    handler._undying = True  # type: ignore[attr-defined]
    rdzv._rendezvous_handlers["env"] = handler
