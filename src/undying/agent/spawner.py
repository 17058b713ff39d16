"""Starting the node's processes and seeing each one end: the agent's part that owns them as
children.

A process is forked by the node's zygote when one serves (``zygote.py``), else
started as a fresh interpreter; each is watched by an asyncio task from its
start, so its exit is seen the moment it happens and reported as its rank's
(``RankExited``), or handed to the spare pool when it was a spare. A rank is
given a warm spare when one is ready; a spare that does not take its rank
within ``--spare-take-timeout`` is killed and the rank given to another
(``_watch_take``). When the node holds no process the zygote is let go, unless
a regroup holds it (the agent's life, ``life.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from undying.agent.environment import WorkerEnvironment
from undying.agent.exits import heard_to_the_end, returned_exit
from undying.agent.life import Event, LifeMachine
from undying.agent.popen import PopenProcess
from undying.agent.ranks import LocalRanks
from undying.agent.spares import Process, SparePool, Take, signal_group
from undying.agent.worker_channel import LocalWorker
from undying.agent.zygote import ZygoteKeeper
from undying.config import EXIT_REGROUPED, JobConfig
from undying.protocol.codec import Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.node_wire import RankExited, RankSpawned
from undying.protocol.worker_wire import Assign, encode

__all__ = ["Spawner", "SpawnSource", "report_crash"]

log = logging.getLogger("undying.agent")


class SpawnSource(Protocol):
    """What the spawner reads of its agent at each start: the job's settings and the node's number
    may change."""

    @property
    def config(self) -> JobConfig: ...

    @property
    def node(self) -> int: ...


class Spawner:
    def __init__(self, source: SpawnSource, *, script: str, script_args: list[str],
                 life: LifeMachine, ranks: LocalRanks, spares: SparePool, zygotes: ZygoteKeeper,
                 environment: WorkerEnvironment, tasks: set[asyncio.Task[None]],
                 report: Callable[[Message], None],
                 spare_event: Callable[..., None]) -> None:
        """``tasks``: the agent's, cancelled when it closes; ``spare_event``: tells the manager's
        log of a spare."""
        self._source = source
        self._script = script
        self._script_args = script_args
        self._life = life
        self._ranks = ranks
        self._spares = spares
        self._zygotes = zygotes
        self._environment = environment
        self._tasks = tasks
        self._report = report
        self._spare_event = spare_event

    def start_process(self, env: dict[str, str], *, spare: bool) -> Process:
        """A worker: forked by the zygote when there is one, else a fresh interpreter
        (agent/zygote.py)."""
        launch = self._source.config.launch
        kind = ["-m"] if launch.module else ["--no-python"] if launch.no_python else []
        args = [*(["--spare"] if spare else []), *kind, self._script, *self._script_args]
        process: Process | None = None
        self._life.move(Event.START_PROCESS)
        if self._life.serving:
            process = self._zygotes.spawn(args, env, os.getcwd())
        if process is None:
            popen = subprocess.Popen(
                [sys.executable, "-u", "-m", "undying.worker.boot", *args],
                env=env,
                # Ctrl-C reaches the launcher only; it stops workers in order
                start_new_session=True,
            )
            process = PopenProcess(popen)
        self._run(self._watch(process), report=False)
        return process

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool,
              resume_from: str = "", incarnation: int = 0) -> tuple[int, bool]:
        """Give ``rank`` a process (called on the loop): a warm spare if one is ready (see
        ``Agent.spawn``)."""
        rank_env = self._environment.rank(rank, record, joining, resume_from, incarnation)
        process, warm = self._give_rank(rank, rank_env, incarnation, spare_ok=joining)
        worker = LocalWorker(rank=rank, process=process, started=time.time(),
                             incarnation=incarnation,
                             pending=self._ranks.held_for(rank, joining=joining))
        self._ranks.hold(worker)
        log.info("node %d: rank %d is pid %d (generation %d%s)", self._source.node, rank,
                 process.pid, record.generation,
                 ", a warm spare" if warm else ", replacement" if joining else "")
        return process.pid, warm

    def _give_rank(self, rank: int, rank_env: dict[str, str], incarnation: int, *,
                   spare_ok: bool) -> tuple[Process, bool]:
        """A process for ``rank``: a fresh warm spare (watched until it answers), else a new
        process."""
        spare = self._spares.take() if spare_ok else None
        if spare is None:
            return self.start_process({**self._environment.base(), **rank_env}, spare=False), False
        assert spare.writer is not None
        spare.writer.write(encode(Assign(env=rank_env)))
        self._spares.taking[spare.pid] = Take(rank, rank_env, incarnation, time.time())
        self._run(self._watch_take(spare.pid))
        self._spares.keep()
        return spare.process, True

    async def _watch_take(self, pid: int) -> None:
        """A spare that has not answered its Assign within --spare-take-timeout is killed; the rank
        goes on.

        Stopped (SIGSTOP), wedged or swapped out, it would otherwise hold the
        recovery for the whole init timeout. The rank is given to another warm
        spare (watched the same way) or a new process, with the same
        environment and owner number; the manager hears the new PID.
        """
        await asyncio.sleep(self._source.config.timeouts.spare_take_timeout)
        take = self._spares.taking.pop(pid, None)
        if take is None or self._life.stopping:
            return
        worker = self._ranks.workers.get(take.rank)
        if worker is None or worker.pid != pid or worker.process.returncode is not None:
            return  # the rank moved on, or the spare died: its exit is handled as the rank's
        # its exit is no rank's crash: the rank has another process
        self._ranks.by_pid.pop(pid, None)
        signal_group(pid, signal.SIGKILL)
        process, warm = self._give_rank(take.rank, take.env, take.incarnation, spare_ok=True)
        waited = round(time.time() - take.given_t, 3)
        log.warning("node %d: spare pid %d did not take rank %d within %.1fs "
                    "(--spare-take-timeout); killed, rank %d is now pid %d (%s)",
                    self._source.node, pid, take.rank, waited, take.rank,
                    process.pid, "another warm spare" if warm else "a new process")
        self._spare_event("spare_stuck", pid, for_rank=take.rank, waited_s=waited,
                          replaced_by=process.pid,
                          replacement="warm spare" if warm else "new process")
        self._ranks.replace(pid, LocalWorker(rank=take.rank, process=process, started=time.time(),
                                             pending=worker.pending, incarnation=take.incarnation))
        self._report(RankSpawned(take.rank, process.pid, warm, take.incarnation))

    async def _watch(self, process: Process) -> None:
        returncode = await process.wait()
        t = time.time()
        by_pid = self._ranks.by_pid
        await heard_to_the_end(lambda: getattr(by_pid.get(process.pid), "writer", None) is not None)
        if not self._spares.exited(process.pid, returncode):
            worker = self._ranks.ended(process.pid)
            if worker is not None:
                config = self._source.config
                # A script that returned is done, whatever its exit took (agent/exits.py).
                returncode = returned_exit(config, worker.rank, worker.incarnation, worker.pid,
                                           returncode, self._spare_event)
                self._report(RankExited(worker.rank, worker.pid, returncode, t))
                if returncode == EXIT_REGROUPED and config.elastic:
                    self._life.move(Event.REGROUP_EXIT)
        self._zygote_idle()

    def _zygote_idle(self) -> None:
        """A node with no worker and no spare holds no process but its agent: the zygote goes too.

        (A job waiting for nodes, a node stopped.) The next worker wanted starts it again and waits
        for it (``Agent.zygote_ready``). Kept while a regroup holds it (an elastic job's member left
        with EXIT_REGROUPED: the job comes back at once).
        """
        if self._life.holds_zygote or self._ranks.any_live() or any(
                s.process.returncode is None for s in self._spares.spares.values()):
            return
        self._zygotes.idle()

    def _run(self, coro: Coroutine[Any, Any, None], *, report: bool = True) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if report:
            task.add_done_callback(report_crash)


def report_crash(task: asyncio.Task[None]) -> None:
    """A watch task that dies takes the job's hang detection with it: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("agent task %s died", task.get_name(), exc_info=task.exception())
