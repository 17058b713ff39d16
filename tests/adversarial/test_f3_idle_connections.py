"""Finding 3 of issue 14, "Connections that never end": half-open HTTP connections were never timed
out, a few hundred idle sockets used up the manager's file descriptors, the next fault failed the job
("Too many open files"), and every malformed request logged a traceback (19 MB of log).

Against a real ``undying run`` job (real processes, real sockets): 400 connections that send half a
request header and never finish it are held while a rank is crashed through the HTTP API; the job
recovers with losses identical to the fault-free run, the server closes every one of those
connections within its header timeout, never holds more than --max-connections of them, and the
manager's descriptor count returns to its baseline. Then 10,000 malformed requests of every kind
grow the job's log by less than 1 MB, and the API still answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import socket
import time
import urllib.parse
from pathlib import Path

from tests.integration.jobs import manager_url, start_job, wait_for, wait_running
from tests.oracle import Oracle
from undying.cli.client import api_get, api_post
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.jobdir import JobDir
from undying.manager.nodes import AgentServer

# 2 ranks, 2 epochs of 32 steps at 0.25 s: ~16 s of training, long enough to watch the sockets close
# while the job still runs (the crash comes ~2 s in, the sockets are closed and the fds back ~3 s
# later on a loaded 2-core machine). --step-seconds changes no loss: the reference runs at full
# speed, and it is the 2-rank, 2-epoch one other tests use. (It was 8 epochs at 0.1 s: 26 s of
# training, 23 of them after the checks.)
ARGS = ["--epochs", "2", "--step-seconds", "0.25"]
REFERENCE_ARGS = ["--epochs", "2"]
HEADER_TIMEOUT_S = 2.0
CAP = 100
HELD = 400


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _half_open(address: tuple[str, int]) -> socket.socket:
    """A connection that starts a request and never finishes its headers."""
    s = socket.create_connection(address, timeout=5)
    s.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    s.setblocking(False)
    return s


def _wait_all_closed(sockets: list[socket.socket], timeout_s: float) -> list[socket.socket]:
    """The sockets the server has not closed (EOF or reset) within ``timeout_s``."""
    sel = selectors.DefaultSelector()
    for s in sockets:
        sel.register(s, selectors.EVENT_READ)
    open_ = set(sockets)
    deadline = time.monotonic() + timeout_s
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(4096)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            except BlockingIOError:
                continue
            if not data or data.startswith(b"HTTP/1.1 503"):
                sel.unregister(s)
                open_.discard(s)
    sel.close()
    return list(open_)


def test_half_open_connections_are_closed_and_a_crash_is_still_recovered(
        tmp_path: Path, reap: list[int], oracle: Oracle) -> None:
    """Finding 3: 400 half-open connections and a crash; recovered, connections closed, fds back to baseline."""
    job_dir = tmp_path / "f3-idle"
    process = start_job(job_dir, ARGS, ranks=2, reap=reap, run_args=[
        "--spares", "0", "--job-id", "f3-idle", "--http-header-timeout", str(HEADER_TIMEOUT_S),
        "--http-idle-timeout", str(HEADER_TIMEOUT_S), "--max-connections", str(CAP)])
    url = manager_url(job_dir)
    wait_running(url, min_step=3)
    info = JobDir(job_dir).read_manager()
    assert info is not None
    pid = int(info["pid"])
    assert pid == process.pid  # the manager runs in the launcher
    baseline = _fds(pid)

    held: list[socket.socket] = []
    most = 0
    try:
        for _ in range(HELD):
            held.append(_half_open(_address(url)))
            if len(held) % 50 == 0:
                most = max(most, _fds(pid))
        most = max(most, _fds(pid))
        # The cap held: the manager never had more than CAP of these open, plus the sockets its event loop
        # accepted but had not yet handed to the guard, plus the few the job's own use. asyncio accepts a batch
        # of up to the listen backlog (128) per pass of its loop and the guard sees them a pass or two later,
        # so while the flood lasts two batches can be in flight (a fresh clone's run on a loaded machine saw
        # 275 fds over a baseline of 27: CAP + 148). The settled count is checked next, against CAP alone.
        assert most <= baseline + CAP + 2 * 128 + 8, \
            f"{most} fds with {HELD} half-open connections (baseline {baseline})"
        wait_for(lambda: _fds(pid) <= baseline + CAP + 8, 5, f"at most {CAP} connections held")
        # The operator still gets in while the flood is held: a crash through the API, with the token.
        answer = api_post(url, "/api/inject", {"kind": "crash", "rank": 1})
        assert answer["rank"] == 1 and answer["when"] == "now", answer
        still_open = _wait_all_closed(held, HEADER_TIMEOUT_S + 8)
        assert not still_open, f"{len(still_open)} of {HELD} half-open connections were never closed"
        assert process.poll() is None, "the job ended before its connections could be checked"
        wait_for(lambda: _fds(pid) <= baseline + 2, 15, f"the manager's fds back to {baseline}")
    finally:
        for s in held:
            s.close()

    assert process.wait(timeout=180) == 0, (job_dir.parent / "f3-idle.log").read_text()[-3000:]
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(oracle.baseline(REFERENCE_ARGS, 2), run)
    assert comparison.identical, comparison.reasons
    assert comparison.lost_steps == 0
    crashes = [i for i in run.incidents if i["rank"] == 1]
    assert crashes and all(i["status"] == "recovered" for i in crashes), run.incidents


_MALFORMED = [
    b"\x00\xff\xfe garbage that is no HTTP at all\r\n\r\n",
    b"GET /api/status HTTP/1.1\r\nHost: x\r\nBroken header line without a colon\r\n\r\n",
    b"GET /api/status HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n",
    b"GET /api/status HTTP/9.9\r\n\r\n",
    b"GET /api/status HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"POST /api/inject HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",  # no token: 401
    b"GET /api/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n",  # a wrong token: 401
    b"GET /nowhere/%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n",
    FORGED := b"GET /x%0a%5bundying%2000:00:00%20ERROR%5d%20forged HTTP/1.1\r\nHost: x\r\n\r\n",  # a log line
]


async def _flood(address: tuple[str, int], count: int, token: str, concurrency: int = 32) -> int:
    """``count`` malformed requests, each on its own connection; how many got any answer."""
    authed = [f"POST /api/inject HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body
              for body in (b"[" * 5000, b'{"rank": ' + b"9" * 5000 + b"}", b'{"rank": NaN}', b"\xff\xfe")]
    kinds = _MALFORMED + authed
    answered = 0
    queue = list(range(count))

    async def worker() -> None:
        nonlocal answered
        while queue:
            i = queue.pop()
            try:
                reader, writer = await asyncio.open_connection(*address)
                writer.write(kinds[i % len(kinds)])
                await writer.drain()
                if await asyncio.wait_for(reader.read(64), 10):
                    answered += 1
                writer.close()
            except (ConnectionError, asyncio.TimeoutError):
                continue

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answered


def test_ten_thousand_malformed_requests_grow_the_log_by_less_than_a_megabyte(
        tmp_path: Path, reap: list[int], job_token: str) -> None:
    """Finding 3: every malformed request logged a traceback; now the log grows < 1 MB for 10,000."""
    job_dir = tmp_path / "f3-log"
    process = start_job(job_dir, ["--epochs", "400", "--step-seconds", "0.1"], ranks=1, reap=reap,
                        run_args=["--spares", "0", "--job-id", "f3-log"])
    url = manager_url(job_dir)
    wait_running(url, min_step=1)
    log = job_dir.parent / "f3-log.log"

    def size() -> int:
        return log.stat().st_size + sum(p.stat().st_size for p in job_dir.glob("events.db*"))

    before = size()
    with socket.create_connection(_address(url), timeout=5) as s:  # first, so that it is among the lines logged
        s.sendall(FORGED)
        assert s.recv(64).startswith(b"HTTP/1.1 401")
    answered = asyncio.run(_flood(_address(url), 10_000, job_token))
    assert answered >= 9_000, f"only {answered} of 10,000 malformed requests got an answer"
    assert process.poll() is None, log.read_text()[-3000:]
    assert api_get(url, "/api/status")["state"] == "running"  # still serving, still training
    grown = size() - before
    assert grown < 1_000_000, f"the log grew by {grown} bytes for 10,000 malformed requests"
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert "held back" in text  # the flood is summarised, not dropped in silence
    assert not any(line.startswith("[undying 00:00:00") for line in text.splitlines()), "a request forged a log line"


def test_the_agents_port_caps_its_connections_and_closes_silent_ones() -> None:
    """Finding 3, the agents' port: silent connections never outnumber the cap and close at the join deadline."""

    async def scenario() -> None:
        server = AgentServer("127.0.0.1", 0, lambda join: "no", heartbeat_s=30.0, max_connections=8,
                             join_wait_s=HEADER_TIMEOUT_S)
        await server.start()
        links = []
        try:
            for _ in range(30):
                links.append(await asyncio.open_connection("127.0.0.1", server.port))
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            assert len(server._connections) <= 8, len(server._connections)
            closed = 0
            for reader, _ in links:
                try:
                    if await asyncio.wait_for(reader.read(1), HEADER_TIMEOUT_S + 5) == b"":
                        closed += 1
                except ConnectionError:
                    closed += 1
            assert closed == 30, f"{30 - closed} silent connections were never closed"
            assert not server._connections
        finally:
            for _, writer in links:
                writer.close()
            await server.close()

    asyncio.run(scenario())


def test_an_unjoined_connection_cannot_make_the_agents_port_buffer_a_long_line() -> None:
    """Finding 3, the agents' port: before its join, a connection may send 64 KiB, not 16 MB, without a newline.

    Anyone who can reach the port can connect; with the cap's connections each holding a 16 MB
    line in memory, the manager's memory was the attacker's. Sent 1 MB without a newline, the
    server drops the connection at once instead of buffering until the join deadline.
    """

    async def scenario() -> None:
        server = AgentServer("127.0.0.1", 0, lambda join: "no", heartbeat_s=30.0, max_connections=8,
                             join_wait_s=60.0)
        await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(b"x" * (1024 * 1024))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            started = time.monotonic()
            try:
                ended = await asyncio.wait_for(reader.read(1), 10.0) == b""
            except ConnectionError:
                ended = True
            assert ended and time.monotonic() - started < 10.0, "the server kept buffering the line"
            await asyncio.sleep(0.1)
            assert not server._connections
        finally:
            writer.close()
            await server.close()

    asyncio.run(scenario())
