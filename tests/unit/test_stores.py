"""The job's stores: the handshake, c10d's semantics, closing, bounds (real sockets, real processes)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.store_server import KEY, serving
from undying.manager.stores import StoreServer
from undying.protocol.env import STORE_KEY_ENV
from undying.protocol.store_client import JobStore
from undying.protocol.store_wire import (
    MAX_FRAME,
    Challenge,
    Welcome,
    decode,
    frame,
    key_from_environ,
    store_key_from_token,
)

T = timedelta(seconds=5)


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with serving() as made:
        yield made


def client(server: StoreServer, name: str = "control", key: bytes = KEY) -> JobStore:
    return JobStore("127.0.0.1", server.port, name, key, T)


def test_the_store_key_is_derived_from_the_token_and_is_not_it() -> None:
    assert store_key_from_token("a") != store_key_from_token("b")
    assert len(KEY) == 32 and b"token" not in KEY
    assert key_from_environ({STORE_KEY_ENV: KEY.hex()}) == KEY
    assert key_from_environ({}) is None
    with pytest.raises(ValueError, match=STORE_KEY_ENV):
        key_from_environ({STORE_KEY_ENV: "not hex"})


def test_c10d_semantics(server: StoreServer) -> None:
    store = client(server)
    store.set("a", "1")
    store.set("b", b"\x00\xff")
    assert store.get("a") == b"1" and store.get("b") == b"\x00\xff"
    assert store.check(["a", "b"]) and not store.check(["a", "nope"])
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2 and store.get("n") == b"2"
    assert store.compare_set("c", "", "new") == b"new"          # missing, expected "": set
    assert store.compare_set("c", "old", "x") == b"new"         # mismatch: the current value
    assert store.compare_set("c", "new", "newer") == b"newer"   # match: set
    assert store.compare_set("d", "expected", "x") == b"expected" and not store.check(["d"])
    store.multi_set(["m1", "m2"], ["x", "y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]
    store.append("m1", "z")
    assert store.get("m1") == b"xz"
    assert store.delete_key("m1") and not store.delete_key("m1")
    assert store.num_keys() == 5 and sorted(store.list_keys()) == ["a", "b", "c", "m2", "n"]
    # The manager's own handle sees the same keys.
    handle = server.open("other")
    handle.set("k", "v")
    assert client(server, "other").get("k") == b"v"


def test_a_wait_ends_when_its_keys_are_set_and_times_out_otherwise(server: StoreServer) -> None:
    store = client(server)
    threading.Timer(0.2, lambda: client(server).set("late", "1")).start()
    started = time.monotonic()
    store.wait(["late"])
    assert time.monotonic() - started < 4
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.wait(["never"], timedelta(seconds=0.2))
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.get("never")
    store.set("after", "still usable")
    assert store.get("after") == b"still usable"


def test_closing_a_store_fails_its_waits_at_once_and_refuses_new_clients(server: StoreServer) -> None:
    generation = server.open("gen/3")
    waiting = client(server, "gen/3")
    threading.Timer(0.2, generation.close).start()
    started = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="Connection closed by peer"):
        waiting.wait(["x"], timedelta(seconds=30))
    assert time.monotonic() - started < 5
    with pytest.raises(dist.DistNetworkError, match="closed"):
        client(server, "gen/3")
    client(server).set("control", "unaffected")


def test_a_wrong_key_is_refused_and_reads_nothing(server: StoreServer) -> None:
    client(server).set("rank/1/owner", "3")
    with pytest.raises(dist.DistNetworkError, match="key was not shown"):
        client(server, key=os.urandom(32))
    assert server.refused == 1
    assert client(server).get("rank/1/owner") == b"3"


def test_a_client_refuses_a_server_that_does_not_hold_the_key() -> None:
    """A fake manager that sends a challenge and welcomes anyone: the client will not talk to it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def fake() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(frame(Challenge(os.urandom(32))))
            conn.recv(4096)
            conn.sendall(frame(Welcome(os.urandom(32))))
            conn.recv(4096)

    threading.Thread(target=fake, daemon=True).start()
    with pytest.raises(dist.DistNetworkError, match="did not prove the job's key"):
        JobStore("127.0.0.1", listener.getsockname()[1], "control", KEY, T)
    listener.close()


def test_unproven_connections_are_bounded_in_number_and_time(server: StoreServer) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    time.sleep(0.3)
    # Past max_pending (8) the server closes at once; the first 8 it closes after the 1 s handshake deadline.
    assert _closed_at_once(idle) >= 8
    time.sleep(1.5)
    for s in idle:
        assert _closed_by_server(s), "an unproven connection outlived the handshake deadline"
        s.close()
    # The job's own client still gets in.
    client(server).set("k", "v")


def test_refused_clients_do_not_loosen_the_cap_on_unproven_connections(server: StoreServer) -> None:
    """Each refused handshake once counted twice off the unproven connections, loosening the cap by one."""
    for _ in range(10):
        with pytest.raises(dist.DistNetworkError, match="key was not shown"):
            client(server, key=os.urandom(32))
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    time.sleep(0.3)
    closed = _closed_at_once(idle)
    for s in idle:
        s.close()
    assert closed >= 12  # 20 against a cap of 8


def _closed_at_once(sockets: list[socket.socket]) -> int:
    """How many the server closed on accept (a pending one got the challenge first, or nothing yet)."""
    closed = 0
    for s in sockets:
        s.settimeout(0.05)
        with contextlib.suppress(TimeoutError):
            closed += not s.recv(4096)
    return closed


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (within 2 s); anything it sends before (the challenge) is skipped."""
    sock.settimeout(2)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_an_oversized_frame_closes_the_connection(server: StoreServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.recv(4096)  # the challenge
        s.sendall(struct.pack(">I", MAX_FRAME + 1))
        assert s.recv(4096) == b""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=0, max_size=300))
def test_random_bytes_never_get_in_nor_break_the_server(server: StoreServer, garbage: bytes) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        challenge = decode(s.recv(4096)[4:], "handshake")
        assert isinstance(challenge, Challenge)
        with_length = struct.pack(">I", len(garbage)) + garbage
        for payload in (garbage, with_length):
            try:
                s.sendall(payload)
            except OSError:
                break
    assert client(server).check([]) is True


def test_a_gloo_group_forms_on_the_store_and_env_rendezvous_finds_it(server: StoreServer, tmp_path: Path) -> None:
    """Two real processes: one builds its group on a JobStore, the other with init_process_group("env://");
    then a group made later from C++ (new_group) still reaches the store's Python side."""
    generation = server.open("gen/0")
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import gc, os, sys
        from datetime import timedelta
        import torch, torch.distributed as dist
        from undying.protocol.store_client import JobStore, hold, use_for_env_rendezvous
        from undying.protocol.store_wire import key_from_environ
        rank = int(os.environ["RANK"])

        def build():  # as the worker does: the store's only Python reference is gone on return
            store = hold("generation", JobStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                "gen/0", key_from_environ(os.environ), timedelta(seconds=30)))
            dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0, world_size=2)

        if rank == 0:
            build()
        else:
            use_for_env_rendezvous()
            dist.init_process_group("gloo")
        gc.collect()
        later = dist.new_group(backend="gloo")  # a group made later, on the same store, from C++
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=later)
        print(t.item())
        dist.destroy_process_group()
        from undying.worker.boot import end_process
        end_process()  # as a worker ends, not by the interpreter's teardown of gloo's threads
    """))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "WORLD_SIZE": "2",
           STORE_KEY_ENV: KEY.hex(), "UNDYING_GENERATION": "0", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=90) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == ["3.0", "3.0"]
    assert client(server, "gen/0").num_keys() > 0  # gloo's rendezvous ran on the job's store
    generation.close()
