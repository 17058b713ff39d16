"""Control plane at scale: simulated agents against one real manager (issue #7).

Method
------
One real ``undying manager`` (``undying.launch.manager_service``, run in its own
process by this script with ``--manager-child``: the shipped service, with
timing wrappers around three of its methods, see below) and, in this process,
N simulated agents: asyncio clients speaking the real protocol on real TCP
sockets, with no torch and no workers. Each one:

* joins with ``AgentJoin`` (the job's token, the job's flags, its node rank)
  and is welcomed with ``AgentWelcome``;
* answers the manager's commands as an agent does (``SpawnRank`` with
  ``RankSpawned``, ``StopNode`` with ``NodeStopped``, ``KillRank`` with
  ``RankExited``; ``Acked`` trims its kept reports);
* sends its beat (``AgentState``: live ranks, their phases) every 0.5 s, the
  agent's own rate, each node at its own phase;
* forwards its ranks' worker messages as a real agent does, with the agent's
  own ``ManagerClient``: every report numbered, what the agent reports in one
  pass of its event loop in one ``NumberedReports`` line (a node's commits of
  a step, with whatever else it said in that pass), worker messages as
  objects. Workers' heartbeats stay in the agent (as in ``undying run``); what
  reaches the manager in steady state is one ``StepCommitted`` per rank per
  step (``--step-s``, default 1 s).

Steps are synchronous, as under DDP: at each step boundary every rank of every
node commits. ``--spread`` says over what share of a step the commits are sent
(0, the default: all at once, as fast as this process sends them, which is
the burst a real DDP job makes after each all-reduce; 1: evenly over the
step). ``--step-s 0`` sends no steps: the agents' beats only (the load of
the heartbeat rate alone; crash trials then time the decision only, as
nothing completes a recovery).

The simulated agents speak through ``undying run``'s own ``ManagerClient``
(numbering, batching per loop pass, keeping until acknowledged), and the
manager reads their lines with the shipped codec (``undying.protocol``);
``check_encoding`` proves at start, in an event loop, that the lines carry
what was sent, the resend after a reconnect included.

The sizes step through ``--nodes`` (default 8, 64, 256, 1024) at
``--ranks-per-node`` (default 8). At each size:

1. Start-up: the manager starts, every agent joins (64 connecting at a time),
   generation 0 spawns every rank (a ``SpawnRank`` each, answered).
2. ``--warmup-s`` of steps, then a measuring window of ``--window-s``.
3. ``--crashes`` crash trials under the same load: a simulated agent reports
   ``RankExited`` for one of its ranks (as the agent's child watch does); the
   manager decides and sends ``SpawnRank`` for a replacement; the simulated
   agent starts it (``RankSpawned``, the worker's ``Hello``), every rank moves
   to the new generation (each sends ``Progress`` group_rebuilt and
   state_restored, then its commits carry the new generation) and the
   incident closes as recovered. The next trial waits for that.
4. The manager is stopped (SIGINT: it stops every node, which answer, and
   says JobEnded).

Definitions
-----------
* Handling latency of a report: from when the simulated agent wrote it (the
  ``t`` it stamps on it right before the socket write; the report's own field
  for ``StepCommitted`` and ``AgentState``) to when the manager's handler for
  it returned (``Manager.on_messages``, which takes a node's run of worker
  messages in one call, or ``Manager.on_message``, for a worker's message;
  the handler table's ``handle`` for the agent's own). Both clocks are this host's.
  It includes the kernel, the wait in the manager's socket buffer and event
  loop behind other work (a burst of commits, a log flush), the line's
  decode and the manager's handling itself (its SQLite rows). The
  manager's own handling time (the handler's duration alone) is reported
  beside it, and so are its log flushes and its event-loop lag (a 50 ms sleep's
  overshoot).
* Held (sustained): over the window, p99 handling latency of the commits and
  of the beats under ``--target-p99-ms`` (100), every report written in the
  window handled within ``--drain-s`` after it (the manager kept up), no node
  lost, and at least 97% of the nominal load offered (the simulated agents
  kept up).
* Detection-to-decision of a crash: the incident's ``decided`` minus its
  ``detected`` phase, read from the manager's SQLite log. ``detected`` is the
  ``t`` of the agent's ``RankExited`` (when the agent saw the exit: here,
  right before it is written), ``decided`` when the policy's decision was
  made. Beside it, measured by the agent: from writing ``RankExited`` to the
  ``SpawnRank`` of the replacement arriving (the decision, plus opening the
  new generation's TCPStore, plus the way back).
* Report to Acked: from writing a report to the ``Acked`` that covers it (the
  log committed it). Bounded below by the manager's flush period (0.25 s) and
  beat (0.5 s), so it is a durability lag, not a handling time.
* The manager's own decision time: the duration of every ``Recoveries.handle``
  (decide, plan the restore, open the next generation, spawn), timed in the
  manager over the crash trials.

Where the time goes (``--micro-steps``, after the sizes, at the largest): the
manager's work per message timed in this process with the shipped Manager and
event log and no profiler: the wire line's decode (a node's ``NumberedReports``
line), then ``Manager.on_messages`` of a node's commits and
``Manager.on_message`` of one, and apart their log rows, the log flush of one
step, a beat round, a crash's ``on_exit`` and the restore planner alone. ``--profile`` adds cProfile of the live manager's window.

The manager's CPU use over the window (its process, all threads; also per
report offered, the figure least sensitive to the machine's load) and this
process's (the simulated agents) are reported: on 2 cores, this process takes
one of them, and a sender that cannot keep up shows as late steps and as a
share of the nominal load offered below 100%. Each size records ``uptime``'s
load average before, during and after: other sessions share the machine.

``--profile`` runs the manager's window under cProfile and prints where its
time goes (the wrapped handlers time the same; cProfile slows them, so
latencies from a profiled run are not the headline ones).

File descriptors: 1,024 simulated nodes take 1,024 sockets here and as many in
the manager (plus a TCPStore per generation); the soft ``ulimit -n`` of both
processes is raised to the hard limit (``--nofile`` caps it), and the figure is
reported.

Run it from the repository root::

    python bench/control_plane.py                          # 8 .. 1024 nodes x 8 ranks, about 5 min
    python bench/control_plane.py --nodes 8,64 --window-s 10 --crashes 2
    python bench/control_plane.py --nodes 1024 --profile   # where the manager's time goes

With ``--json`` the text report goes to stderr and the last stdout line is one
JSON object. With ``--out DIR`` the manager's log and job dir are kept there.
The manager process is stopped on exit, Ctrl-C and SIGTERM included (SIGINT,
then SIGKILL), by its PID.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import cProfile
import dataclasses
import io
import json
import logging
import os
import pstats
import random
import resource
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery import interrupt, publish  # noqa: E402  (bench/ is a folder of scripts)

from undying.agent.reports import ManagerClient  # noqa: E402
from undying.config import JobConfig, Timeouts  # noqa: E402
from undying.jobfiles.tokens import TOKEN_ENV  # noqa: E402
from undying.protocol.codec import Message  # noqa: E402
from undying.protocol.node_wire import (  # noqa: E402
    Acked,
    AgentFenced,
    AgentJoin,
    AgentRefused,
    AgentState,
    AgentWelcome,
    JobEnded,
    KillRank,
    NodeStep,
    NodeStopped,
    NumberedReports,
    RankExited,
    RankSpawned,
    SpawnRank,
    StopNode,
    decode_agent_report,
    decode_from_agent,
    decode_to_agent,
    encode,
)
from undying.protocol.worker_wire import Hello, Progress, StepCommitted  # noqa: E402

DEFAULT_NODES = (8, 64, 256, 1024)
TARGET_P99_MS = 100.0
TARGET_DECISION_S = 1.0
AGENT_BEAT_S = 0.5  # undying.agent.remote._STATE_EVERY_S: an agent's AgentState rate
CONNECT_AT_ONCE = 64
# Below this share of the nominal load offered, the simulated agents fell behind: no size is "held" on it.
OFFERED_SHARE_MIN = 0.97
MANAGER_CHILD_FLAG = "--manager-child"
JOB_ID = "control-plane"


# --- small helpers ---------------------------------------------------------------------


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def raise_fd_limit(cap: int) -> int:
    """The soft RLIMIT_NOFILE raised to the hard limit (at most ``cap``); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else cap
    want = min(want, cap)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def percentiles(values: Iterable[float], scale: float = 1000.0) -> dict[str, Any]:
    """n, p50, p90, p99, max of ``values`` (seconds), in milliseconds by default."""
    data = sorted(values)
    if not data:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}

    def at(q: float) -> float:
        return round(data[min(len(data) - 1, int(q * len(data)))] * scale, 3)

    return {"n": len(data), "p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": round(data[-1] * scale, 3)}


def free_port_pair() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (agents join on P, the control store takes P + 1).

    Taken below the kernel's ephemeral range, so that no outgoing connection of
    another process on this busy machine takes P + 1 while the manager starts.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.SystemRandom().randrange(10_000, max(10_002, low - 2))
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1 below the ephemeral range")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the manager, in its own process ---------------------------------------------------


class Probe:
    """Timing wrappers around the manager's handlers; a window starts on SIGUSR1 and is written out on SIGUSR2.

    The wrappers call the shipped methods unchanged; outside a window they add
    one attribute read per message.
    """

    def __init__(self, out: Path, profile: bool) -> None:
        self.out = out
        self.profile = profile
        self.on = False
        self.started = 0.0
        self.cpu0 = 0.0
        # Per message kind: when the report was written (its t), and how long until it was handled.
        self.written: dict[str, array.array[float]] = defaultdict(lambda: array.array("d"))
        self.latency: dict[str, array.array[float]] = defaultdict(lambda: array.array("d"))
        self.handling: dict[str, array.array[float]] = defaultdict(lambda: array.array("d"))
        self.flushes: array.array[float] = array.array("d")
        self.loop_lag: array.array[float] = array.array("d")
        self.profiler: cProfile.Profile | None = None
        self.windows = 0
        self.watcher: asyncio.Future[None] | None = None
        # Every incident's Recoveries.handle (plan, decide, open the generation, spawn), window or not.
        self.decisions: array.array[float] = array.array("d")

    def install(self) -> None:
        from undying.jobfiles.events import EventLog
        from undying.manager import nodes
        from undying.manager.manager import Manager
        from undying.manager.node_reports import NODE_REPORTS
        from undying.protocol.codec import Handlers

        probe = self
        # An agent's own report: NodeReports.take hands each to its table (a Handlers), which
        # is what is timed (wrapping NodeReports.handle alone missed every report of a line).
        dispatch = Handlers.handle
        on_message = Manager.on_message
        on_messages = Manager.on_messages
        flush = EventLog.flush
        start = nodes.AgentServer.start
        from undying.manager.recovery import Recoveries

        handle = Recoveries.handle

        def timed_dispatch(table: Any, message: Message, *context: Any) -> Any:
            if not probe.on or not isinstance(message, NODE_REPORTS):
                return dispatch(table, message, *context)
            began = time.perf_counter()
            result = dispatch(table, message, *context)
            took = time.perf_counter() - began
            kind = type(message).__name__
            probe.handling[kind].append(took)
            if isinstance(message, (AgentState, RankExited)):
                probe.note(kind, message.t)
            return result

        def timed_on_message(manager: Any, message: Message) -> None:
            on_message(manager, message)
            if probe.on and isinstance(message, StepCommitted):
                probe.note("StepCommitted", message.t)

        def timed_on_messages(manager: Any, messages: list[Message]) -> None:
            if not probe.on:
                return on_messages(manager, messages)
            began = time.perf_counter()
            on_messages(manager, messages)  # its other messages pass timed_on_message; its commits do not
            probe.handling["on_messages"].append(time.perf_counter() - began)
            for message in messages:
                if isinstance(message, StepCommitted):
                    probe.note("StepCommitted", message.t)
                elif isinstance(message, NodeStep):  # a node's commits of a step, each with its rank's time
                    for t in message.t:
                        probe.note("StepCommitted", t)

        def timed_flush(log: Any) -> None:
            if not probe.on:
                return flush(log)
            began = time.perf_counter()
            flush(log)
            probe.flushes.append(time.perf_counter() - began)

        def timed_handle(recoveries: Any, incident: Any) -> None:
            began = time.perf_counter()
            handle(recoveries, incident)
            probe.decisions.append(time.perf_counter() - began)

        async def start_with_lag_probe(server: Any) -> int:
            port = await start(server)
            probe.watcher = asyncio.ensure_future(probe.watch_loop())
            # On the loop, as callbacks: a window never starts or ends halfway through a handler.
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGUSR1, probe.begin)
            loop.add_signal_handler(signal.SIGUSR2, probe.end)
            return port

        for owner, name, wrapper in ((Handlers, "handle", timed_dispatch),
                                     (Manager, "on_message", timed_on_message),
                                     (Manager, "on_messages", timed_on_messages), (EventLog, "flush", timed_flush),
                                     (nodes.AgentServer, "start", start_with_lag_probe),
                                     (Recoveries, "handle", timed_handle)):
            setattr(owner, name, wrapper)

    def note(self, kind: str, written: float) -> None:
        self.written[kind].append(written)
        self.latency[kind].append(time.time() - written)

    async def watch_loop(self) -> None:
        """The event loop's lag: how late a 50 ms sleep wakes up (every other coroutine waits as long)."""
        while True:
            began = time.perf_counter()
            await asyncio.sleep(0.05)
            if self.on:
                self.loop_lag.append(time.perf_counter() - began - 0.05)

    def begin(self) -> None:
        self.written.clear()
        self.latency.clear()
        self.handling.clear()
        self.flushes = array.array("d")
        self.loop_lag = array.array("d")
        self.started = time.time()
        self.cpu0 = time.process_time()
        if self.profile:
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        self.on = True

    def end(self) -> None:
        try:
            self._end()
        except Exception:  # the bench's own failure must never reach the manager's loop
            logging.getLogger("bench.probe").exception("the probe could not write its window")

    def _end(self) -> None:
        self.on = False
        if self.profiler is not None:
            self.profiler.disable()
        self.windows += 1
        wall = time.time() - self.started
        # The sender's window: only reports written within it count (the probe ran on to let them drain).
        bounds = json.loads(self.out.with_suffix(".window").read_text())
        low, high = bounds["from"], bounds["to"]
        latency = {kind: [lat for t, lat in zip(self.written[kind], values, strict=True) if low <= t <= high]
                   for kind, values in self.latency.items()}
        result = {
            "probe_s": round(wall, 3),
            "main_thread_cpu_s": round(time.process_time() - self.cpu0, 3),
            "latency_ms": {k: percentiles(v) for k, v in latency.items()},
            "handling_ms": {k: percentiles(v) for k, v in self.handling.items()},
            "handling_total_s": {k: round(sum(v), 3) for k, v in self.handling.items()},
            "flush_ms": percentiles(self.flushes),
            "flush_total_s": round(sum(self.flushes), 3),
            "loop_lag_ms": percentiles(self.loop_lag),
            "handle_incident_ms": [round(d * 1000, 3) for d in self.decisions],
        }
        if self.profiler is not None:
            self.profiler.dump_stats(str(self.out.with_suffix(f".{self.windows}.prof")))
            self.profiler = None
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, self.out.with_suffix(f".{self.windows}.json"))


def manager_child(argv: list[str]) -> int:
    """``undying manager`` in this process, under the Probe: the bench's manager."""
    p = argparse.ArgumentParser(prog="control_plane.py --manager-child")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--nofile", type=int, required=True)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    raise_fd_limit(args.nofile)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from undying.config import ManagerOptions
    from undying.launch.manager_service import serve_manager

    Probe(Path(args.stats), args.profile).install()
    return serve_manager(ManagerOptions(job_id=JOB_ID, job_dir=args.job_dir, host="127.0.0.1", port=args.port,
                                        http_port=0))


_managers: list[ManagerProcess] = []


def kill_managers() -> None:
    """The last resort on any exit: every manager child still running is SIGKILLed, by PID."""
    for manager in _managers:
        manager.kill()


class ManagerProcess:
    """The manager child: started, signalled and stopped by PID."""

    def __init__(self, root: Path, nofile: int, profile: bool, token: str) -> None:
        self.root = root
        self.job_dir = root / "job"
        self.stats = root / "probe"
        self.port = free_port_pair()
        self.log_path = root / "manager.log"
        env = dict(os.environ)
        env[TOKEN_ENV] = token
        argv = [sys.executable, str(Path(__file__).resolve()), MANAGER_CHILD_FLAG, "--job-dir", str(self.job_dir),
                "--port", str(self.port), "--stats", str(self.stats), "--nofile", str(nofile)]
        if profile:
            argv.append("--profile")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        _managers.append(self)
        self.windows = 0

    @property
    def events_db(self) -> Path:
        return self.job_dir / "events.db"

    def begin_probe(self) -> None:
        os.kill(self.process.pid, signal.SIGUSR1)

    def cpu_s(self) -> float:
        return process_cpu_s(self.process.pid)

    async def end_probe(self, written_from: float, written_to: float) -> dict[str, Any]:
        """The probe's figures for the reports written in [written_from, written_to]."""
        self.stats.with_suffix(".window").write_text(json.dumps({"from": written_from, "to": written_to}))
        os.kill(self.process.pid, signal.SIGUSR2)
        self.windows += 1
        path = self.stats.with_suffix(f".{self.windows}.json")
        deadline = time.monotonic() + 30
        while not path.exists():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"the manager wrote no window stats ({path}); see {self.log_path}")
            await asyncio.sleep(0.05)
        return dict(json.loads(path.read_text()))

    def profile_path(self) -> Path:
        return self.stats.with_suffix(f".{self.windows}.prof")

    def interrupt(self) -> None:
        """SIGINT: the manager stops every node's ranks and ends the job."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGINT)

    def stop(self, timeout_s: float = 30.0, *, interrupt: bool = True) -> int | None:
        """SIGINT (unless sent already), SIGKILL if the manager is still there after ``timeout_s``."""
        if self.process.poll() is None:
            if interrupt:
                self.interrupt()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


# --- the simulated agents --------------------------------------------------------------


class LineSink:
    """A writer that keeps what is written (ManagerClient writes lines to it)."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, line: bytes) -> None:
        self.lines.append(line)

    def is_closing(self) -> bool:
        return False


def check_encoding() -> None:
    """The simulated agents speak through ``undying run``'s own ManagerClient: its lines carry what was sent.

    In an event loop, as the agent runs: two passes of reports, each written
    as the pass ends; the first pass's lines resent after a reconnect.
    """
    t = time.time()
    passes: list[list[tuple[str, Message]]] = [[
        ("send", AgentState(3, {"24": 100001, "25": 100002}, {"24": "step", "25": "init"}, 0, t)),
        ("send", RankSpawned(24, 100001, False, 7)), ("send", RankExited(24, 100001, -9, t)),
        ("send", NodeStopped(2)),
        ("worker", StepCommitted(24, 1, 12, t, {"loss": 1.0 / 12})),
        ("worker", Hello(24, 100003, 1, True, t)),
    ], [
        ("worker", Progress(24, 1, "state_restored", t, step=11)),
        ("worker", StepCommitted(25, 1, 12, t, {"loss": 1.0 / 12})),
    ]]

    async def lines(client: ManagerClient) -> list[bytes]:
        sink = LineSink()
        client.connected(sink, 0)  # type: ignore[arg-type]
        for reports in passes:
            for _how, message in reports:
                client.send(message)  # (a worker's message too: ManagerClient.send takes both now)
            await asyncio.sleep(0)  # the pass ends: its reports are written
        client.disconnected()
        client.connected(sink, 2)  # type: ignore[arg-type]
        return sink.lines

    got = asyncio.run(lines(ManagerClient()))
    sent = [m for reports in passes for _, m in reports]
    taken = []
    for line in got:
        batch = decode_from_agent(line)
        assert isinstance(batch, NumberedReports)
        for body in batch.reports:
            report = decode_agent_report(body)
            taken += report.commits() if isinstance(report, NodeStep) else [report]
    if len(got) != 3 or taken != sent + sent[2:]:  # two passes, then what the manager lacks (3 on) resent
        raise AssertionError(f"the agent's lines do not carry what it sent: {got}")


@dataclasses.dataclass
class Window:
    """What the simulated agents measure during a window."""

    on: bool = False
    acked_lag: array.array[float] = dataclasses.field(default_factory=lambda: array.array("d"))
    sender_lag: array.array[float] = dataclasses.field(default_factory=lambda: array.array("d"))
    reports: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    late_steps: int = 0
    steps: int = 0

    def reset(self) -> None:
        self.acked_lag = array.array("d")
        self.sender_lag = array.array("d")
        self.reports = defaultdict(int)
        self.late_steps = 0
        self.steps = 0


class SimNode:
    """One simulated agent: the real join, beats, numbered reports and answers to the manager's commands."""

    def __init__(self, sim: Sim, node: int) -> None:
        self.sim = sim
        self.node = node
        self.client = ManagerClient()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.session = ""
        self.live: dict[int, int] = {}
        self.sent: deque[tuple[int, float]] = deque()  # (seq, when written), until Acked
        self.seq = 0
        self.fenced = ""
        self.ended: JobEnded | None = None
        self.moved_to = 0  # the newest generation this node's ranks announced they rebuilt for
        self._tasks: list[asyncio.Task[None]] = []

    def report(self, message: Message) -> None:
        self.client.send(message)
        self.seq += 1
        window = self.sim.window
        if window.on:
            self.sent.append((self.seq, time.time()))
            window.reports[type(message).__name__] += 1

    def worker(self, message: Message) -> None:
        """A worker's message, forwarded as the agent forwards it (numbered, as itself)."""
        self.client.send(message)
        self.seq += 1
        window = self.sim.window
        if window.on:
            self.sent.append((self.seq, time.time()))
            window.reports[type(message).__name__] += 1

    async def join(self) -> None:
        sim = self.sim
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", sim.port, limit=16 * 1024 * 1024)
        config = dataclasses.replace(sim.config, node_rank=self.node)
        self.writer.write(encode(AgentJoin(
            job_id=JOB_ID, node=self.node, nnodes=config.nnodes, nproc_per_node=config.nproc_per_node,
            token=sim.token, session="", pid=os.getpid(), host=f"sim-{self.node}", config=config.to_dict(),
            live={}, t=time.time())))
        line = await asyncio.wait_for(self.reader.readline(), 120.0)
        reply = decode_to_agent(line) if line else None
        if isinstance(reply, (AgentRefused, AgentFenced)):
            raise RuntimeError(f"node {self.node}: the manager said {type(reply).__name__}: {reply.reason}")
        if not isinstance(reply, AgentWelcome):
            raise RuntimeError(f"node {self.node}: expected AgentWelcome, got {reply!r}")
        self.session = reply.session
        self.client.connected(self.writer, reply.acked)
        self._tasks = [asyncio.ensure_future(self._serve()), asyncio.ensure_future(self._beat())]

    async def _beat(self) -> None:
        await asyncio.sleep(random.uniform(0, AGENT_BEAT_S))  # each agent at its own phase
        while True:
            self.report(AgentState(node=self.node, live={str(r): p for r, p in self.live.items()},
                                   phases={str(r): "step" for r in self.live}, spares_ready=0, t=time.time()))
            await asyncio.sleep(AGENT_BEAT_S)

    async def _serve(self) -> None:
        assert self.reader is not None and self.writer is not None
        while True:
            line = await self.reader.readline()
            if not line:
                return
            message = decode_to_agent(line)
            if isinstance(message, Acked):
                self.client.acked(message.seq)
                now = time.time()
                while self.sent and self.sent[0][0] <= message.seq:
                    _, t = self.sent.popleft()
                    if self.sim.window.on:
                        self.sim.window.acked_lag.append(now - t)
            elif isinstance(message, SpawnRank):
                self.sim.on_spawn(self, message)
            elif isinstance(message, KillRank):
                pid = self.live.pop(message.rank, 0)
                if pid:
                    self.report(RankExited(message.rank, pid, -message.signal, time.time()))
            elif isinstance(message, StopNode):
                self.live.clear()
                self.report(NodeStopped(message.seq))
            elif isinstance(message, JobEnded):
                self.ended = message
                return
            elif isinstance(message, AgentFenced):
                self.fenced = message.reason
                return
            # ManagerBeat, KeepSpares, TraceSet, TellRank, ArmRank, AbortRank: nothing to do here.

    def commit(self, step: int, generation: int) -> None:
        """This node's ranks finished ``step``: one StepCommitted each (a newly moved rank says so first).

        Made in one pass of the agent's loop, they go out in one line, as a
        real agent's do when its ranks' messages arrive together. The pass
        ends here (``flush``): a real agent is a process of its own, while
        here every node shares one loop, whose pass would hold this node's
        line until every other node's commits were made.
        """
        if generation > self.moved_to:
            self.moved_to = generation
            for rank in self.live:
                self.worker(Progress(rank, generation, "group_rebuilt", time.time()))
                self.worker(Progress(rank, generation, "state_restored", time.time(), step=step - 1))
        for rank in self.live:
            self.worker(StepCommitted(rank, generation, step, time.time(), {"loss": 1.0 / step}))
        self.client.flush()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.writer is not None:
            self.writer.close()


class Sim:
    """Every simulated agent of one size, their shared step clock, and the crash trials."""

    def __init__(self, port: int, token: str, nnodes: int, ranks_per_node: int, step_s: float, spread: float) -> None:
        self.port = port
        self.token = token
        self.step_s = step_s
        self.spread = spread
        self.config = JobConfig(job_id=JOB_ID, job_dir="/nonexistent/sim", nproc_per_node=ranks_per_node,
                                nnodes=nnodes, spares=0, timeouts=Timeouts())
        self.nodes = [SimNode(self, n) for n in range(nnodes)]
        self.generation = 0
        self.step = 0
        self.window = Window()
        self.spawned_at = 0.0
        self._pids = 100_000
        self._expect: dict[int, asyncio.Future[tuple[float, SpawnRank]]] = {}
        self._stepper: asyncio.Task[None] | None = None

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def spawned(self) -> int:
        return sum(len(n.live) for n in self.nodes)

    def on_spawn(self, node: SimNode, message: SpawnRank) -> None:
        arrived = time.time()
        self._pids += 1
        node.live[message.rank] = self._pids
        node.report(RankSpawned(message.rank, self._pids, False, message.incarnation))
        generation = message.record.generation
        node.worker(Hello(message.rank, self._pids, generation, message.joining, time.time()))
        if generation > self.generation:
            self.generation = generation  # the survivors see the new generation on the control store
        if not message.joining and self.spawned() == self.world_size:
            self.spawned_at = arrived
        waiting = self._expect.pop(message.rank, None)
        if waiting is not None and not waiting.done():
            waiting.set_result((arrived, message))

    async def join_all(self) -> None:
        gate = asyncio.Semaphore(CONNECT_AT_ONCE)

        async def one(node: SimNode) -> None:
            async with gate:
                await node.join()

        await asyncio.gather(*(one(n) for n in self.nodes))

    def start_steps(self) -> None:
        if self.step_s > 0:  # 0: beats only, no training steps
            self._stepper = asyncio.ensure_future(self._steps())

    async def _steps(self) -> None:
        """Synchronous steps: at each boundary, every rank commits (over ``spread`` of a step)."""
        order = list(self.nodes)
        random.shuffle(order)
        boundary = time.time() + self.step_s
        while True:
            await asyncio.sleep(max(0.0, boundary - time.time()))
            self.step += 1
            generation = self.generation
            for i, node in enumerate(order):
                due = boundary + self.spread * self.step_s * i / len(order)
                now = time.time()
                if due > now + 0.001:
                    await asyncio.sleep(due - now)
                node.commit(self.step, generation)
                if self.window.on:
                    self.window.sender_lag.append(time.time() - due)
            if self.window.on:
                self.window.steps += 1
            boundary += self.step_s
            if time.time() > boundary:
                if self.window.on:
                    self.window.late_steps += 1
                # Behind by a whole step: start the next one now instead of sending a backlog.
                boundary = time.time()

    async def crash(self, trial: int, events_db: Path, timeout_s: float) -> dict[str, Any]:
        """One rank of a far node exits; time the decision and the replacement's command; wait for the recovery."""
        node = self.nodes[(len(self.nodes) - 1 - trial * 7) % len(self.nodes)]
        rank = sorted(node.live)[trial % len(node.live)]
        pid = node.live.pop(rank)
        arrived: asyncio.Future[tuple[float, SpawnRank]] = asyncio.get_running_loop().create_future()
        self._expect[rank] = arrived
        generation = self.generation
        load = load_average()
        t0 = time.time()
        node.report(RankExited(rank, pid, -int(signal.SIGKILL), t0))
        out: dict[str, Any] = {"trial": trial, "node": node.node, "rank": rank, "load": load}
        try:
            spawn_t, spawn = await asyncio.wait_for(arrived, timeout_s)
        except asyncio.TimeoutError:
            out["error"] = f"no SpawnRank for rank {rank} within {timeout_s:.0f}s"
            return out
        out["exit_to_spawn_command_s"] = round(spawn_t - t0, 4)
        out["joining"] = spawn.joining
        out["generation"] = spawn.record.generation
        # Without steps nothing completes a recovery: the decision is what is timed.
        incident = await wait_for_incident(events_db, rank, t0, timeout_s, decided_only=self.step_s == 0)
        if incident is None:
            out["error"] = f"no recovered incident for rank {rank} within {timeout_s:.0f}s"
            return out
        phases = incident["phases"]
        out.update({
            "incident": incident["id"], "kind": incident["kind"], "action": incident["action"],
            "status": incident["status"],
            "detection_to_decision_s": round(phases["decided"] - phases["detected"], 4),
            "recovered_s": round(phases["first_step_done"] - phases["detected"], 4) if "first_step_done" in phases
            else None,
            "old_generation": generation,
        })
        return out

    def stop_steps(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()

    def close(self) -> None:
        self.stop_steps()
        for node in self.nodes:
            node.close()


async def wait_listening(manager: ManagerProcess, timeout_s: float) -> None:
    """Until the manager's listener comes up; RuntimeError if it exits or takes past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:  # (torch's import takes seconds on a busy machine)
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", manager.port), timeout=1).close()
            return
        if manager.process.poll() is not None:
            raise RuntimeError(f"the manager exited at start ({manager.log_path})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the manager did not listen within {timeout_s:.0f}s ({manager.log_path})")
        await asyncio.sleep(0.05)


async def wait_for_incident(events_db: Path, rank: int, after: float, timeout_s: float, *,
                            decided_only: bool = False) -> dict[str, Any] | None:
    """The incident of ``rank`` faulted at or after ``after``, once no longer open (or decided), from the log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for incident in read_incidents(events_db):
            done = "decided" in incident["phases"] if decided_only else incident["status"] != "open"
            if incident["rank"] == rank and incident["fault_t"] >= after - 1e-3 and done:
                return incident
        await asyncio.sleep(0.1)
    return None


def read_incidents(events_db: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{events_db}?mode=ro", uri=True, timeout=5)
    try:
        return [json.loads(d) for (d,) in db.execute("SELECT data FROM incidents ORDER BY id")]
    except sqlite3.OperationalError:
        return []  # the table is being created
    finally:
        db.close()


def count_events(events_db: Path, kind: str) -> int:
    db = sqlite3.connect(f"file:{events_db}?mode=ro", uri=True, timeout=5)
    try:
        return int(db.execute("SELECT COUNT(*) FROM events WHERE kind = ?", (kind,)).fetchone()[0])
    finally:
        db.close()


# --- one size --------------------------------------------------------------------------


async def run_size(nnodes: int, args: argparse.Namespace, root: Path, text: TextIO) -> dict[str, Any]:
    root.mkdir(parents=True)
    token = secrets.token_urlsafe(24)
    manager = ManagerProcess(root, args.nofile, args.profile, token)
    sim = Sim(manager.port, token, nnodes, args.ranks_per_node, args.step_s, args.spread)
    out: dict[str, Any] = {"nodes": nnodes, "ranks": nnodes * args.ranks_per_node, "load_before": load_average()}
    print(f"\n{nnodes} nodes x {args.ranks_per_node} ranks (load {out['load_before']})", file=text, flush=True)
    try:
        await wait_listening(manager, args.timeout_s)
        began = time.time()
        await sim.join_all()
        joined = time.time()
        deadline = time.monotonic() + args.timeout_s
        while sim.spawned() < sim.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"generation 0 spawned {sim.spawned()} of {sim.world_size} ranks in "
                                   f"{args.timeout_s:.0f}s")
            await asyncio.sleep(0.05)
        out["startup"] = {"join_all_s": round(joined - began, 3),
                          "generation0_spawns_s": round(sim.spawned_at - joined, 3)}
        print(f"  start-up: {nnodes} joins in {joined - began:.2f}s, generation 0's {sim.world_size} spawns "
              f"{sim.spawned_at - joined:.2f}s after", file=text, flush=True)
        sim.start_steps()
        await asyncio.sleep(args.warmup_s)
        # The measuring window: reports written in it count; the probe runs on while they drain.
        manager.begin_probe()
        await asyncio.sleep(0.2)
        sim.window.reset()
        sim_cpu0, manager_cpu0, t0 = time.process_time(), manager.cpu_s(), time.time()
        sim.window.on = True
        await asyncio.sleep(args.window_s)
        sim.window.on = False
        sim_cpu, manager_cpu, t1 = time.process_time() - sim_cpu0, manager.cpu_s() - manager_cpu0, time.time()
        await asyncio.sleep(args.drain_s)
        probe = await manager.end_probe(t0, t1)
        window = sim.window
        seconds = t1 - t0
        sent = {"StepCommitted": window.reports.get("StepCommitted", 0),
                "AgentState": window.reports.get("AgentState", 0)}
        handled = {k: probe["latency_ms"].get(k, {}).get("n", 0) for k in sent}
        out["window"] = {
            "seconds": round(seconds, 3), "steps": window.steps, "load": load_average(),
            "offered_per_s": {k: round(v / seconds, 1) for k, v in window.reports.items()},
            "sent": sent,
            "handled_within_drain": handled,
            "drain_s": args.drain_s,
            "latency_ms": probe["latency_ms"],
            "handling_ms": probe["handling_ms"],
            "handling_total_s": probe["handling_total_s"],
            "flush_ms": probe["flush_ms"], "flush_total_s": probe["flush_total_s"],
            "loop_lag_ms": probe["loop_lag_ms"],
            "manager_cpu_share": round(manager_cpu / seconds, 3),
            # CPU per message offered (every report the agents sent in the window, all kinds).
            "manager_cpu_us_per_message": round(manager_cpu / max(1, sum(window.reports.values())) * 1e6, 1),
            "manager_main_thread_cpu_share": round(probe["main_thread_cpu_s"] / probe["probe_s"], 3),
            "sim_cpu_share": round(sim_cpu / seconds, 3),
            "sender_lag_ms": percentiles(window.sender_lag),
            "sender_late_steps": window.late_steps,
            # The load offered, as a share of the nominal (every rank once a step, every node twice a second).
            "offered_share": round(min(
                window.reports.get("AgentState", 0) / (nnodes / AGENT_BEAT_S * seconds),
                window.reports.get("StepCommitted", 0) / (sim.world_size / args.step_s * seconds) if args.step_s > 0
                else 1.0), 3),
            "acked_lag_ms": percentiles(window.acked_lag),
        }
        if args.profile:
            out["profile"] = top_functions(manager.profile_path(), args.profile_top)
        print_window(out["window"], text)
        # Crash trials under the same load (a probe runs over them for the manager's own decision times).
        manager.begin_probe()
        await asyncio.sleep(0.2)
        crashes_from = time.time()
        trials = []
        for trial in range(args.crashes):
            result = await sim.crash(trial, manager.events_db, args.timeout_s)
            trials.append(result)
            print(f"  crash {trial + 1}: rank {result['rank']} on node {result['node']}: "
                  + (result["error"] if "error" in result else
                     f"detection-to-decision {result['detection_to_decision_s'] * 1000:.1f} ms, SpawnRank back "
                     f"{result['exit_to_spawn_command_s'] * 1000:.1f} ms after the exit, {result['action']}, "
                     + (f"{result['status']} {result['recovered_s']:.2f}s after" if result["recovered_s"] is not None
                        else result["status"]) + f" (load {result['load']})"),
                  file=text, flush=True)
            await asyncio.sleep(max(2 * args.step_s, 1.0) + random.uniform(0, args.step_s or AGENT_BEAT_S))
        crash_probe = await manager.end_probe(crashes_from, time.time())
        out["crashes"] = trials
        out["handle_incident_ms"] = crash_probe["handle_incident_ms"]
        decisions = [t["detection_to_decision_s"] for t in trials if "detection_to_decision_s" in t]
        commands = [t["exit_to_spawn_command_s"] for t in trials if "exit_to_spawn_command_s" in t]
        out["detection_to_decision_s"] = {"median": _median(decisions), "max": max(decisions, default=None)}
        out["exit_to_spawn_command_s"] = {"median": _median(commands), "max": max(commands, default=None)}
        out["nodes_lost"] = count_events(manager.events_db, "node_lost")
        out["fenced"] = sum(1 for n in sim.nodes if n.fenced)
        out["load_after"] = load_average()
    finally:
        out["manager_exit"] = await stop_job(manager, sim)
    out["sustained"] = sustained(out, args)
    out["decision_target_met"] = (out.get("detection_to_decision_s", {}).get("max") is not None
                                  and out["detection_to_decision_s"]["max"] < args.target_decision_s)
    return out


async def stop_job(manager: ManagerProcess, sim: Sim, timeout_s: float = 60.0) -> int | None:
    """Stop the manager while the agents still answer it (StopNode, then JobEnded), then close them.

    Closing the agents first would have the manager declare every node lost
    and recover every rank.
    """
    sim.stop_steps()
    interrupted = manager.process.poll() is None
    if interrupted:
        manager.interrupt()
        deadline = time.monotonic() + timeout_s
        while manager.process.poll() is None and time.monotonic() < deadline:
            if all(n.ended is not None or n.writer is None for n in sim.nodes):
                break
            await asyncio.sleep(0.1)
    sim.close()
    return await asyncio.to_thread(manager.stop, timeout_s, interrupt=not interrupted)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def sustained(out: dict[str, Any], args: argparse.Namespace) -> bool:
    window = out.get("window")
    if not window:
        return False
    p99s = [window["latency_ms"].get(k, {}).get("p99") for k, n in window["sent"].items() if n > 0]
    handled_all = window["handled_within_drain"] == window["sent"]
    return (all(p is not None and p < args.target_p99_ms for p in p99s) and handled_all
            and out.get("nodes_lost", 1) == 0 and window["offered_share"] >= OFFERED_SHARE_MIN)


def top_functions(path: Path, top: int) -> dict[str, list[dict[str, Any]]]:
    """The manager's hottest functions in the window: by own time and by time including callees."""
    stats = pstats.Stats(str(path), stream=io.StringIO())
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = filename.split("/site-packages/")[-1].split("/src/")[-1].split("/lib/python3")[-1]
        rows.append({"function": f"{where}:{line}({name})", "calls": calls, "own_s": round(own, 3),
                     "cumulative_s": round(cumulative, 3)})
    return {"by_own": sorted(rows, key=lambda r: -r["own_s"])[:top],
            "by_cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:top]}


# --- where a report's time goes, in-process -------------------------------------------------


async def micro_costs(nnodes: int, ranks_per_node: int, steps: int, root: Path) -> dict[str, Any]:
    """The manager's work per message, timed in one process without a profiler, with a real Manager and log.

    The Manager is the shipped one with detached ``NodeSlot`` slots (their
    commands queue; nothing is sent), generation 0 started as ``run`` starts
    it. Per StepCommitted: the wire line's three decodes, then
    ``Manager.on_message``, and apart, its two log writes (``EventLog.step``,
    ``EventLog.rank``) on a scratch log. Per step: the log's flush of every
    rank's rows. Per beat round: ``ManagerBeat`` and ``Acked`` encoded for every
    node. Per crash: ``Manager.on_exit`` of one rank (decide, plan, open the
    next generation with its TCPStore, spawn the replacement), and the
    incident's detection-to-decision.
    """
    from undying.jobfiles.events import EventLog
    from undying.manager.manager import Manager
    from undying.manager.nodes import NodeSlot
    from undying.protocol.node_wire import ManagerBeat

    root.mkdir(parents=True, exist_ok=True)
    config = JobConfig(job_id=JOB_ID, job_dir=str(root), nproc_per_node=ranks_per_node, nnodes=nnodes, spares=0,
                       port=0)
    events = EventLog(root / "events.db")
    manager = Manager(config, events)
    manager.start_control_store(secrets.token_bytes(32))
    slots = [NodeSlot(n) for n in range(nnodes)]
    for slot in slots:
        manager.add_agent(slot)
    world = config.world_size
    # manager.run starts generation 0 once `ready` is done (every node joined, in the service).
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    run = asyncio.ensure_future(manager.run(ready=ready))
    await asyncio.sleep(0)
    began = time.perf_counter()
    ready.set_result(None)
    while sum(len(s.view()["waiting_spawns"]) for s in slots) < world:
        await asyncio.sleep(0.01)
    spawn_s = time.perf_counter() - began
    for info in manager.ranks.values():
        manager.on_spawned(info.rank, 200_000 + info.rank, False, info.incarnation)
    scratch = EventLog(root / "scratch.db")
    decode_s, batch_s, one_s, step_s, steps_s, flush_s = [], [], [], [], [], []
    for step in range(1, steps + 1):
        messages = [StepCommitted(r, 0, step, time.time(), {"loss": 1.0 / step}) for r in range(world)]
        by_node = [messages[n * ranks_per_node:(n + 1) * ranks_per_node] for n in range(nnodes)]
        # The wire as the agents write it: a node's commits of the step, made in one pass, in one line.
        client, sink = ManagerClient(), LineSink()
        client.connected(sink, 0)  # type: ignore[arg-type]
        for node_messages in by_node:
            for m in node_messages:
                client.send(m)
            client.flush()  # the pass ends
        assert len(sink.lines) == nnodes
        t = time.perf_counter()
        batches = []
        for line in sink.lines:
            batch = decode_from_agent(line)
            assert isinstance(batch, NumberedReports)
            reports = [decode_agent_report(body) for body in batch.reports]  # a NodeStep a node a step
            batches.append(reports)  # handed to the manager as they came: a NodeStep a node a step
        decode_s.append((time.perf_counter() - t) / world)
        # The manager's handling: odd steps a node's batch a call (as AgentServer hands them over), even steps
        # a message a call (Manager.on_message, as the standalone agent calls it).
        t = time.perf_counter()
        if step % 2:
            for batch in batches:
                manager.on_messages(batch)
            batch_s.append((time.perf_counter() - t) / world)
        else:
            for m in messages:
                manager.on_message(m)
            one_s.append((time.perf_counter() - t) / world)
        t = time.perf_counter()
        events.flush()
        flush_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for m in messages:
            scratch.step(m.rank, m.step, m.generation, m.t, m.metrics)
        step_s.append((time.perf_counter() - t) / world)
        scratch.flush()
        t = time.perf_counter()
        for node_messages in by_node:
            scratch.steps([(m.rank, m.step, m.generation, m.t, m.metrics) for m in node_messages])
        steps_s.append((time.perf_counter() - t) / world)
        scratch.flush()
    t = time.perf_counter()
    beat = encode(ManagerBeat(time.time()))  # once a round, as AgentServer does
    for slot in slots:
        beat + encode(Acked(slot.node))
    beat_round_s = time.perf_counter() - t
    # A crash: the rank's exit as the agent reports it, handled as the manager handles it.
    crash_rank = world - 1
    detected = time.time()
    t = time.perf_counter()
    manager.on_exit(crash_rank, manager.ranks[crash_rank].pid, -int(signal.SIGKILL), detected)
    on_exit_s = time.perf_counter() - t
    incident = manager.incidents[-1]
    decided_s = incident.phases["decided"] - incident.phases["detected"]
    # The restore planner alone, as Recoveries.plan calls it (it builds the job's layout afresh each time).
    from undying.checkpoint.layout import Layout
    from undying.checkpoint.planner.coarse import coarse_members
    from undying.checkpoint.planner.holdings import plan

    t = time.perf_counter()
    plan(Layout(dp=world), coarse_members(world, {crash_rank - 1}, steps)).describe()
    plan_s = time.perf_counter() - t
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await run
    scratch.close()
    manager.close()
    us = 1e6
    return {
        "nodes": nnodes, "ranks": world, "steps": steps,
        "generation0_spawns_s": round(spawn_s, 3),
        "decode_us": round(statistics.median(decode_s) * us, 2),
        "on_messages_us": round(statistics.median(batch_s) * us, 2),
        "on_message_us": round(statistics.median(one_s) * us, 2) if one_s else None,
        "log_step_row_us": round(statistics.median(step_s) * us, 2),
        "log_step_rows_us": round(statistics.median(steps_s) * us, 2),
        "flush_per_step_ms": round(statistics.median(flush_s) * 1000, 2),
        "beat_round_ms": round(beat_round_s * 1000, 2),
        "crash_on_exit_ms": round(on_exit_s * 1000, 2),
        "restore_plan_ms": round(plan_s * 1000, 2),
        "crash_detection_to_decision_ms": round(decided_s * 1000, 2),
        "incident_action": incident.action,
    }


def render_micro(micro: dict[str, Any], text: TextIO) -> None:
    per = micro["decode_us"] + micro["on_messages_us"]
    print(f"\nwhere a commit's time goes, in-process at {micro['nodes']} nodes x "
          f"{micro['ranks'] // micro['nodes']} ranks (median of {micro['steps']} steps, no profiler):", file=text)
    print(f"  decoding a node's NumberedReports line {micro['decode_us']:.1f} us a commit", file=text)
    print(f"  Manager.on_messages of a node's commits {micro['on_messages_us']:.1f} us a commit (Manager.on_message "
          f"of one: {_fmt(micro['on_message_us'])} us); its steps rows {micro['log_step_rows_us']:.1f} us a commit "
          f"with one executemany a node ({micro['log_step_row_us']:.1f} us a row alone)", file=text)
    print(f"  = {per:.1f} us a commit before the event loop's own share: one step of {micro['ranks']} commits is "
          f"{per * micro['ranks'] / 1000:.0f} ms of the manager's one thread, plus a log flush of "
          f"{micro['flush_per_step_ms']:.1f} ms", file=text)
    print(f"  a beat round (ManagerBeat encoded once, Acked for every node) {micro['beat_round_ms']:.1f} ms every "
          f"0.6 s; generation 0's spawns {micro['generation0_spawns_s']:.2f} s", file=text)
    print(f"  a crash: Manager.on_exit {micro['crash_on_exit_ms']:.1f} ms (decide, plan, open the generation, spawn); "
          f"detection-to-decision {micro['crash_detection_to_decision_ms']:.1f} ms -> {micro['incident_action']}; "
          f"the restore planner alone (plan + describe, the DDP case) {micro['restore_plan_ms']:.1f} ms", file=text)


# --- the report ------------------------------------------------------------------------


def _fmt(value: Any, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def print_window(window: dict[str, Any], text: TextIO) -> None:
    lat, han = window["latency_ms"], window["handling_ms"]
    commit, beat = lat.get("StepCommitted", {}), lat.get("AgentState", {})
    print(f"  window {window['seconds']:.0f}s, {window['steps']} steps (load {window['load']}): offered "
          + ", ".join(f"{v:g}/s {k}" for k, v in sorted(window["offered_per_s"].items())), file=text)
    print(f"    latency (report written -> handled) StepCommitted p50 {_fmt(commit.get('p50'))} p99 "
          f"{_fmt(commit.get('p99'))} max {_fmt(commit.get('max'))} ms; AgentState p50 {_fmt(beat.get('p50'))} "
          f"p99 {_fmt(beat.get('p99'))} max {_fmt(beat.get('max'))} ms", file=text)
    report = han.get("on_messages", {})
    print(f"    manager: CPU {window['manager_cpu_share']:.2f} cores; Manager.on_messages (a node's batch) p50 "
          f"{_fmt(report.get('p50'), '.3f')} p99 {_fmt(report.get('p99'), '.3f')} ms; log flushes "
          f"{window['flush_total_s']:.2f}s (max {_fmt(window['flush_ms'].get('max'))} ms); loop lag p99 "
          f"{_fmt(window['loop_lag_ms'].get('p99'))} ms", file=text)
    print(f"    agents (this process): CPU {window['sim_cpu_share']:.2f} cores, send lag p99 "
          f"{_fmt(window['sender_lag_ms'].get('p99'))} ms, late steps {window['sender_late_steps']}, "
          f"{window['offered_share']:.0%} of the nominal load offered; report -> "
          f"Acked p50 {_fmt(window['acked_lag_ms'].get('p50'))} p99 {_fmt(window['acked_lag_ms'].get('p99'))} ms",
          file=text, flush=True)


def render(result: dict[str, Any], text: TextIO) -> None:
    print("\n== control plane: simulated agents against one manager ==", file=text)
    steps = (f"a step every {result['step_s']:g}s (spread {result['spread']:g} of a step)" if result["step_s"] > 0
             else "no steps (beats only)")
    print(f"{result['ranks_per_node']} ranks per node, {steps}, agent beat every {AGENT_BEAT_S:g}s; "
          f"window {result['window_s']:g}s; "
          f"ulimit -n {result['nofile']}", file=text)
    header = (f"{'nodes':>6} {'ranks':>6} {'msgs/s':>7} {'commit p50':>10} {'p99':>8} {'beat p99':>8} "
              f"{'mgr CPU':>7} {'us/msg':>6} {'kept up':>7} {'lost':>4} {'held':>5} {'decide med':>10} {'max':>7} "
              f"{'spawn back':>10} {'load':>5}")
    print(header, file=text)
    for size in result["sizes"]:
        w = size.get("window")
        if w is None:
            print(f"{size['nodes']:>6} {size['ranks']:>6}  failed: {size.get('error', '?')}", file=text)
            continue
        commit, beat = w["latency_ms"].get("StepCommitted", {}), w["latency_ms"].get("AgentState", {})
        rate = sum(w["offered_per_s"].values())
        decide, back = size["detection_to_decision_s"], size["exit_to_spawn_command_s"]
        kept_up = "yes" if w["handled_within_drain"] == w["sent"] else "NO"
        print(f"{size['nodes']:>6} {size['ranks']:>6} {rate:>7.0f} {_fmt(commit.get('p50')):>10} "
              f"{_fmt(commit.get('p99')):>8} {_fmt(beat.get('p99')):>8} {w['manager_cpu_share']:>7.2f} "
              f"{w['manager_cpu_us_per_message']:>6.0f} {kept_up:>7} "
              f"{size['nodes_lost']:>4} {'yes' if size['sustained'] else 'NO':>5} "
              f"{_fmt(_ms(decide['median'])):>10} {_fmt(_ms(decide['max'])):>7} "
              f"{_fmt(_ms(back['median'])):>10} {w['load'][0]:>5.1f}", file=text)
    print("(latencies in ms; mgr CPU in cores, us/msg its CPU per report offered; kept up: every report written in "
          "the window handled within the drain; decide = detection-to-decision from the incident's phases; spawn back "
          "= RankExited written -> SpawnRank received by the agent, medians and max over the crash trials)", file=text)
    held = [s["nodes"] for s in result["sizes"] if s.get("sustained")]
    print(f"largest size held (p99 < {result['target_p99_ms']:g} ms, every report handled, nothing lost, "
          f"at least {OFFERED_SHARE_MIN:.0%} of the nominal load offered): "
          f"{max(held) if held else 'none'} nodes; target 1024 x 8: "
          f"{'met' if 1024 in held and result['ranks_per_node'] >= 8 else 'not met'}", file=text)
    big = max(result["sizes"], key=lambda s: s["nodes"])
    if big.get("detection_to_decision_s", {}).get("max") is not None:
        print(f"detection-to-decision at {big['nodes']} nodes: max {big['detection_to_decision_s']['max'] * 1000:.0f}"
              f" ms (target < {result['target_decision_s'] * 1000:.0f} ms: "
              f"{'met' if big['decision_target_met'] else 'not met'})", file=text)
    for size in result["sizes"]:
        if "profile" in size:
            print(f"\nmanager profile at {size['nodes']} nodes (cProfile, window only; own time):", file=text)
            for row in size["profile"]["by_own"]:
                print(f"  {row['own_s']:>7.3f}s own {row['cumulative_s']:>7.3f}s cum {row['calls']:>8} calls  "
                      f"{row['function']}", file=text)
            print("  by cumulative time:", file=text)
            for row in size["profile"]["by_cumulative"]:
                print(f"  {row['cumulative_s']:>7.3f}s cum {row['own_s']:>7.3f}s own {row['calls']:>8} calls  "
                      f"{row['function']}", file=text)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


# --- main ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--nodes", default=",".join(map(str, DEFAULT_NODES)),
                   help="node counts to step through, comma-separated (default 8,64,256,1024)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--step-s", type=float, default=1.0,
                   help="seconds per training step (default 1); 0: no steps, the agents' beats only")
    p.add_argument("--spread", type=float, default=0.0,
                   help="share of a step over which the commits are sent: 0 a burst (synchronous DDP), 1 evenly")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--drain-s", type=float, default=3.0,
                   help="after the window, how long the reports written in it may take to be handled (default 3)")
    p.add_argument("--crashes", type=int, default=3, help="crash trials per size (default 3)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="limit of each wait (start-up, a recovery)")
    p.add_argument("--target-p99-ms", type=float, default=TARGET_P99_MS)
    p.add_argument("--target-decision-s", type=float, default=TARGET_DECISION_S)
    p.add_argument("--nofile", type=int, default=65536, help="cap of the raised soft ulimit -n (default 65536)")
    p.add_argument("--micro-steps", type=int, default=5,
                   help="steps of the in-process cost breakdown at the largest size (0: skip it; default 5)")
    p.add_argument("--no-sizes", action="store_true", help="only the in-process cost breakdown")
    p.add_argument("--profile", action="store_true", help="profile the manager's window with cProfile")
    p.add_argument("--profile-top", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="keep the manager's logs and job dirs here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        args.node_counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        p.error(f"--nodes must be comma-separated integers, got {args.nodes!r}")
    if not args.node_counts or any(n < 1 for n in args.node_counts):
        p.error(f"--nodes needs node counts of at least 1, got {args.nodes!r}")
    if args.ranks_per_node < 1 or args.step_s < 0 or not 0 <= args.spread <= 1 or args.window_s <= 0:
        p.error("--ranks-per-node >= 1, --step-s >= 0, --spread in [0, 1] and --window-s > 0 are required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    random.seed(args.seed)
    check_encoding()
    text = sys.stderr if args.json else sys.stdout
    nofile = raise_fd_limit(args.nofile)
    need = 2 * max(args.node_counts) + 256
    if nofile < need:
        print(f"ulimit -n is {nofile} (hard limit); {max(args.node_counts)} nodes need about {need}: "
              "raise the hard limit", file=sys.stderr)
        return 2
    root = args.out or Path(tempfile.mkdtemp(prefix="undying-bench-control-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sizes: list[dict[str, Any]] = []
    try:
        for nnodes in [] if args.no_sizes else args.node_counts:
            try:
                sizes.append(asyncio.run(run_size(nnodes, args, root / f"n{nnodes}", text)))
            except RuntimeError as e:
                print(f"  {nnodes} nodes failed: {e}", file=text)
                sizes.append({"nodes": nnodes, "ranks": nnodes * args.ranks_per_node, "error": str(e)})
        micro = None
        if args.micro_steps > 0:
            micro = asyncio.run(micro_costs(max(args.node_counts), args.ranks_per_node, args.micro_steps,
                                            root / "micro"))
    except KeyboardInterrupt:
        print("interrupted; the manager was stopped", file=sys.stderr)
        return 130
    finally:
        kill_managers()
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "date": time.strftime("%Y-%m-%d"), "host": socket.gethostname(), "cpus": os.cpu_count(),
        "ranks_per_node": args.ranks_per_node, "step_s": args.step_s, "spread": args.spread,
        "window_s": args.window_s, "nofile": nofile, "target_p99_ms": args.target_p99_ms,
        "target_decision_s": args.target_decision_s, "profile": args.profile, "sizes": sizes, "micro": micro,
        "wall_s": round(time.monotonic() - started, 1),
    }
    if sizes:
        render(result, text)
    if micro is not None:
        render_micro(micro, text)
    publish(result, args.out, args.json, text, "manager logs and job dirs")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == MANAGER_CHILD_FLAG:
        sys.exit(manager_child(sys.argv[2:]))
    sys.exit(main())
