"""The agent's watch: its clock's tick, and on each one every rank judged hung, stalled or fine.

A rank silent past its timeout is hung (stopped, or its interpreter stuck); a
rank beating without progress past its step timeout is stalled (an endless
loop, a deadlock, a collective that never completes). Beats stay here: the
manager hears of hangs and stalls, not of every beat, so its load grows with
nodes rather than ranks. Each tick also runs the node's other chores: the
orphan sweep (``children.py``), the zygote's check (``zygote.py``) and the
spares' (``spares.py``). Silence counts only while this agent ran (``liveness.py``).

One named part of the agent, given at construction what it reads (the ranks,
the node's step times, its life) and where it reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from undying.agent.children import Orphans
from undying.agent.life import LifeMachine
from undying.agent.liveness import (
    has_exited,
    judge_silence,
    process_state,
    stall_to_report,
    step_timeout,
    watch_clock,
)
from undying.agent.ranks import LocalRanks
from undying.agent.spares import SparePool
from undying.agent.worker_channel import LocalWorker
from undying.agent.zygote import ZygoteKeeper
from undying.config import JobConfig
from undying.protocol.codec import Message
from undying.protocol.node_wire import RankHung, RanksStalled

__all__ = ["HangWatch", "WatchSource"]

log = logging.getLogger("undying.agent")


class WatchSource(Protocol):
    """What the watch reads of its agent each tick: the job's settings and the node's number may
    change."""

    @property
    def config(self) -> JobConfig: ...

    @property
    def node(self) -> int: ...

    def own_pids(self) -> set[int]: ...


class HangWatch:
    def __init__(self, source: WatchSource, ranks: LocalRanks, life: LifeMachine, *,
                 zygotes: ZygoteKeeper, spares: SparePool, orphans: Orphans,
                 step_times: deque[float],
                 report: Callable[[Message], None]) -> None:
        self._source = source
        self._ranks = ranks
        self._life = life
        self._zygotes = zygotes
        self._spares = spares
        self._orphans = orphans
        # the durations of this node's recent steps (fed by the workers' channel)
        self._step_times = step_times
        self._report = report

    def step_timeout(self) -> float:
        return step_timeout(self._source.config.timeouts.step_timeout,
                            max(self._step_times, default=None))

    async def run(self) -> None:
        """Watch every rank's beats and progress; tell the manager of hangs and stalls."""
        source = self._source
        timeouts = source.config.timeouts
        # silence counts only while this agent ran (agent/liveness.py)
        clock = watch_clock(source.node, timeouts)
        while True:
            await asyncio.sleep(clock.period_s)
            clock.tick()
            self._orphans.sweep(source.own_pids())
            if self._life.stopping:
                continue
            self._zygotes.check()
            now = time.time()
            self._spares.check(now, clock)
            stalled: list[LocalWorker] = []
            for worker in list(self._ranks.workers.values()):
                if worker.hang_reported or worker.process.returncode is not None:
                    continue
                silence = judge_silence(now, worker.started, worker.last_seen, timeouts,
                                        source.config.step_api, clock)
                if silence is not None and not has_exited(worker.pid):
                    worker.hang_reported = True
                    log.warning("node %d: rank %d (pid %d, state %s) silent for %.1fs "
                                "(%s timeout %.1fs)", source.node, worker.rank, worker.pid,
                                process_state(worker.pid), silence.silent_s, silence.phase,
                                silence.limit_s)
                    self._report(RankHung(worker.rank, worker.pid, silence.phase,
                                          worker.last_seen or worker.started, now))
                elif ((beat := worker.beat) is not None and stall_to_report(
                        beat, (worker.stall_reported_t, worker.stall_reported_at), now,
                        self.step_timeout(), timeouts)):
                    stalled.append(worker)
            if stalled:
                self._report_stall(stalled, now)

    def _report_stall(self, stalled: list[LocalWorker], now: float) -> None:
        """Report every local rank's progress: the manager picks the one the others wait for."""
        for worker in stalled:
            assert worker.beat is not None
            worker.stall_reported_t, worker.stall_reported_at = worker.beat.progress_t, now
            log.warning("node %d: rank %d (pid %d) made no progress for %.1fs in %s of step %d "
                        "(%d collectives entered)", self._source.node, worker.rank, worker.pid,
                        now - worker.beat.progress_t, worker.beat.phase, worker.beat.step,
                        worker.beat.collectives)
        live = [w for w in self._ranks.workers.values()
                if w.process.returncode is None and not w.hang_reported]
        self._report(RanksStalled([w.progress() for w in live], self.step_timeout(), now))
