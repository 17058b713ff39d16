"""Finding 1, "Open c10d stores" (the listening half): every socket of a single-node job is on loopback.

Before: the manager's control store and each generation's rendezvous store were
``TCPStore`` servers listening on every interface (``*:port``), reachable from
any network the machine is on. Now the manager binds them itself on the job's
address (``StoreServer``); gloo's data connections of a single-node job stay on
the loopback interface. The agent's worker channel is on loopback too, where any
local user can connect: it drops a connection whose first line is not its key
(``undying.protocol.channel_key``). That the stores answer only the job's own
processes is test_f1_strangers.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.jobs import events, manager_url, start_job, wait_running
from undying.manager.stores import StoreServer
from undying.protocol.worker_wire import FaultInjected, encode

LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")


def _descendants(pid: int) -> set[int]:
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child in (Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
                      if Path(f"/proc/{parent}").exists() else []):
            if int(child) not in found:
                found.add(int(child))
                frontier.append(int(child))
    return found


def _listening(pids: set[int]) -> list[str]:
    """``address:port`` of every TCP socket the processes ``pids`` listen on."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=10, check=True).stdout
    found = []
    for line in out.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            found.append(line.split()[3])
    return found


def _other_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: only the route is looked up, nothing is sent
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_a_store_listens_only_on_the_address_it_was_given() -> None:
    server = StoreServer("127.0.0.1", 0, os.urandom(32))
    try:
        server.open("control").set("k", "v")
        addresses = [a for a in _listening({os.getpid()}) if a.endswith(f":{server.port}")]
        assert addresses == [f"127.0.0.1:{server.port}"], addresses
        other = _other_address()
        if other is None:
            pytest.skip("this machine has no address but loopback to try from")
        with pytest.raises(OSError), socket.create_connection((other, server.port), timeout=2):
            pass
    finally:
        server.close()


def _agent_address(worker_pid: int) -> tuple[str, int]:
    """The agent's worker channel, as the agent told its worker (its environment)."""
    with open(f"/proc/{worker_pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    host, port = env[b"UNDYING_AGENT_ADDR"].decode().rsplit(":", 1)
    return host, int(port)


def test_every_socket_of_a_single_node_job_is_on_loopback(tmp_path: Path, reap: list[int]) -> None:
    """Launcher (manager, stores, HTTP API, agent), workers (gloo) and the warm spare: all on 127.0.0.1;
    and a local process without the agent's key cannot speak on the agent's worker channel."""
    job = start_job(tmp_path / "job", ["--epochs", "3", "--step-seconds", "0.05"], ranks=2, reap=reap,
                    run_args=["--spares", "1"])
    ranks = wait_running(manager_url(tmp_path / "job"), min_step=3)["ranks"]
    pids = _descendants(job.pid)
    assert len(pids) >= 4, pids  # the launcher, two ranks, a spare
    addresses = _listening(pids)
    assert len(addresses) >= 4, addresses  # control store, generation store, HTTP API, agent, gloo
    assert all(a.rsplit(":", 1)[0] in LOOPBACK for a in addresses), addresses

    # A stranger on the machine: a wrong key, then a report the manager would log as an injected fault.
    fake = FaultInjected(rank=1, kind="crash", step=1, phase="forward", t=time.time())
    with socket.create_connection(_agent_address(ranks[0]["pid"]), timeout=10) as sock:
        sock.sendall(b"not-the-key\n" + encode(fake))
        assert sock.recv(1024) == b"", "the agent kept a connection that showed no key"
    assert job.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-3000:]
    assert not events(tmp_path / "job" / "events.db", "fault_injected")
    assert "refused a local connection without the agent's key" in (tmp_path / "job.log").read_text()
