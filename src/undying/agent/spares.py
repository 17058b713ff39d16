"""A node's hot spares: started, watched like ranks, handed out only when alive, replaced when they
die.

A spare is a process that imported Python, torch and the script's packages
and waits for a rank (``undying.worker.boot --spare``). It beats while it
waits (SpareReady again every ``spare_beat_interval``), and answers an Assign
with SpareTaken before it runs the script. So:

- a spare silent past ``--heartbeat-timeout`` (or never warm within
  ``--init-timeout``) is killed, as a hung rank is, and replaced;
- a spare not heard from in the last few beats (stopped since) is not handed a
  rank at all;
- a spare handed a rank that does not answer within ``--spare-take-timeout``
  is killed by the agent, which gives the rank to another spare or a new
  process (``spawner.py``);
- a spare that exits, for whatever reason, is replaced; when spares keep dying
  before they get warm (a broken environment), replacements back off (0.5 s,
  doubling, at most 30 s) instead of forking in a loop.

Every start, exit, hang and stuck take is reported (``report``) with the
spare's PID, so the job's log holds the node's spares as it holds its ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from undying.config import JobConfig
from undying.protocol.judge_clock import JudgeClock
from undying.protocol.worker_wire import SpareReady, SpareTaken, spare_beat_interval

__all__ = ["SparePool", "Spare", "Take", "Process", "signal_group"]

log = logging.getLogger("undying.agent")


class Process(Protocol):
    """What the agent and the pool need of a worker process (``PopenProcess``, ``ChildProcess``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


@dataclass
class Spare:
    process: Process
    writer: asyncio.StreamWriter | None = None  # its line to the agent, once it said it is warm
    ready_t: float = 0.0
    started: float = field(default_factory=time.time)
    last_seen: float = 0.0  # its latest beat
    hang_reported: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class Take:
    """A spare given a rank, until it answers SpareTaken: what to give the rank instead if it never
    does."""

    rank: int
    env: dict[str, str]
    incarnation: int
    given_t: float


class SparePool:
    """The spares of one node. The agent starts processes and owns ranks; this owns which spare is
    fit."""

    def __init__(self, node: int, config: JobConfig, *, start: Callable[[], Process],
                 report: Callable[..., None], stopping: Callable[[], bool], want: int) -> None:
        self.node = node
        self.config = config
        self._start = start
        self._report = report  # report(what, pid, **detail)
        self._stopping = stopping
        self.spares: dict[int, Spare] = {}
        # pid of a spare given a rank -> the rank, until it answers
        self.taking: dict[int, Take] = {}
        self._failures = 0  # spares in a row that died before they were warm
        self.beat_s = spare_beat_interval(config.timeout_env())
        # How many to keep: ``--spares``; a standby keeps enough for a whole node's ranks until it
        # has a node.
        self.want = want

    def become(self, node: int, want: int) -> None:
        """The pool of node ``node`` now (a standby given a lost node), keeping ``want`` spares."""
        self.node = node
        self.want = want

    def keep(self) -> None:
        """Start spares until ``want`` are warm or warming."""
        if self._stopping():
            return
        while len(self.spares) < self.want:
            process = self._start()
            self.spares[process.pid] = Spare(process)
            log.info("node %d: warming a spare, pid %d", self.node, process.pid)
            self._report("spare_started", process.pid)

    def fresh(self, spare: Spare, now: float) -> bool:
        """Warm, alive and heard from lately: a spare stopped since its last beat is not handed a
        rank."""
        return (spare.writer is not None and spare.process.returncode is None
                and not spare.hang_reported
                and now - spare.last_seen <= max(1.5, 3 * self.beat_s))

    def take(self) -> Spare | None:
        """The longest-warm fresh spare, removed from the pool; None when there is none."""
        now = time.time()
        ready = [s for s in self.spares.values() if self.fresh(s, now)]
        if not ready:
            return None
        spare = min(ready, key=lambda s: s.ready_t)
        del self.spares[spare.pid]
        return spare

    def ready(self) -> int:
        now = time.time()
        return sum(1 for s in self.spares.values() if self.fresh(s, now))

    def check(self, now: float, clock: JudgeClock | None = None) -> None:
        """Silent past --heartbeat-timeout (warm) or --init-timeout (warming): killed; its exit
        replaces it.

        With the agent's watch ``clock``, silence counts only over time the agent ran (a fresh
        window after a stall of its own), as a rank's does (``liveness.judge_silence``).
        """
        timeouts = self.config.timeouts
        for spare in list(self.spares.values()):
            if spare.hang_reported or spare.process.returncode is not None:
                continue
            if spare.writer is not None:
                phase, since, limit = "heartbeat", spare.last_seen, timeouts.heartbeat_timeout
            else:
                phase, since, limit = "init", spare.started, timeouts.init_timeout
            silent = now - (clock.counts_from(since, wall=True) if clock is not None else since)
            if silent > limit:
                spare.hang_reported = True
                log.warning("node %d: spare pid %d silent for %.1fs (%s timeout %.1fs); "
                            "killed and replaced", self.node, spare.pid, silent, phase, limit)
                self._report("spare_hung", spare.pid, phase=phase, silent_s=round(silent, 3))
                signal_group(spare.pid, signal.SIGKILL)

    def exited(self, pid: int, returncode: int) -> bool:
        """A child exited: True when it was a waiting spare (then it is replaced), False for
        anything else."""
        spare = self.spares.pop(pid, None)
        if spare is None:
            return False
        if self._stopping():  # (let go with the job's end: a normal exit, no warning)
            log.info("node %d: spare pid %d exited (%d)", self.node, pid, returncode)
            return True
        log.warning("node %d: spare pid %d exited (%d)", self.node, pid, returncode)
        self._report("spare_exited", pid, returncode=returncode, warm=spare.writer is not None)
        self._failures = 0 if spare.writer is not None else self._failures + 1
        delay = min(30.0, 0.5 * 2 ** (self._failures - 1)) if self._failures else 0.0
        if delay:
            log.warning("node %d: %d spare(s) in a row died before getting warm; the next in %.1fs",
                        self.node, self._failures, delay)
            asyncio.get_running_loop().call_later(delay, self.keep)
        else:
            self.keep()
        return True

    def on_taken(self, message: SpareTaken) -> bool:
        """A spare's answer to its Assign: the rank is its now."""
        take = self.taking.pop(message.pid, None)
        if take is not None:
            log.info("node %d: spare pid %d took rank %d in %.3fs", self.node, message.pid,
                     take.rank, time.time() - take.given_t)
        return True

    def on_ready(self, message: SpareReady, writer: asyncio.StreamWriter) -> bool:
        """A spare's beat on its line; False: not a spare of this pool (the agent closes the
        line)."""
        if message.pid in self.taking:
            return True  # a beat sent as it was given a rank: its answer follows
        spare = self.spares.get(message.pid)
        if spare is None:
            return False
        spare.last_seen = time.time()
        if spare.writer is None:
            spare.writer = writer
            spare.ready_t = message.t
            self._failures = 0
            log.info("node %d: spare pid %d is warm", self.node, message.pid)
        return True

    def kill_all(self) -> None:
        for spare in list(self.spares.values()):
            signal_group(spare.pid, signal.SIGKILL)

    async def wait_all(self) -> None:
        for spare in list(self.spares.values()):
            await spare.process.wait()

    def detail(self) -> dict[str, Any]:
        """The pool as the agent's view shows it: each spare's PID and whether it is fit to take a
        rank."""
        now = time.time()
        return {"spares": [{"pid": s.pid, "fresh": self.fresh(s, now)}
                           for s in self.spares.values()]}


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal a child's process group (each child leads its own session), or the child alone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
