"""Finding 1 (issue #14), "Open c10d stores": a job's sockets listen only where it was told.

TCPStore's server bound every interface whatever host it was given, so a
single-node job's control store and per-generation stores answered from any
network the machine was on. These tests read the kernel's own table of
listening sockets for every process of a running job.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from tests.integration.jobs import events, manager_url, start_job, wait_running
from undying.messages import FaultInjected, encode

ARGS = ["--epochs", "2", "--step-seconds", "0.05"]
_LISTEN = "0A"


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it, from /proc's children lists."""
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        seen.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return seen


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except (FileNotFoundError, PermissionError):
            continue
    return inodes


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    if len(host) == 8:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    else:
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", int(host[i:i + 8], 16))
                                                         for i in range(0, 32, 8)))
    return f"{ip}:{int(port, 16)}"


def listening(pids: list[int]) -> list[str]:
    """Every TCP address (ip:port) one of ``pids`` listens on, from /proc/net/tcp{,6}."""
    inodes = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == _LISTEN and cols[9] in inodes:
                    found.append(_address(cols[1]))
    return found


def _agent_address(worker_pid: int) -> tuple[str, int]:
    with open(f"/proc/{worker_pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    host, port = env[b"UNDYING_AGENT_ADDR"].decode().rsplit(":", 1)
    return host, int(port)


def test_a_single_node_job_listens_on_loopback_only_and_its_agent_ignores_strangers(
        tmp_path: Path, reap: list[int]) -> None:
    """Finding 1: every listening socket of a single-node job (stores, HTTP API, agent, spares, gloo) is on
    127.0.0.1, and a local process without the agent's key cannot speak on the agent's worker channel."""
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, ARGS, ranks=2, reap=reap, run_args=["--spares", "1"])
    try:
        url = manager_url(job_dir)
        ranks = wait_running(url, min_step=2)["ranks"]
        reap.extend(r["pid"] for r in ranks)
        addresses = listening(_descendants(launcher.pid))
        # the control store, the generation's store and the HTTP API at least: a test that cannot fail is a defect
        assert len(addresses) >= 3, addresses
        assert all(a.startswith("127.0.0.1:") for a in addresses), addresses

        # A stranger on the machine: a wrong key, then a report the manager would log as an injected fault.
        fake = FaultInjected(rank=1, kind="crash", step=1, phase="forward", t=time.time())
        with socket.create_connection(_agent_address(ranks[0]["pid"]), timeout=10) as sock:
            sock.sendall(b"not-the-key\n" + encode(fake))
            assert sock.recv(1024) == b"", "the agent kept a connection that showed no key"
        assert launcher.wait(timeout=120) == 0, (tmp_path / "job.log").read_text(errors="replace")[-3000:]
        assert not events(job_dir / "events.db", "fault_injected")
        assert "refused a local connection without the agent's key" in (tmp_path / "job.log").read_text()
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
