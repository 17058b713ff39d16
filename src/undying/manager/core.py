"""What every part of the manager shares: the job's config, log, ranks, agents, generations and
state.

The manager is a router over small parts (recovery, regroup, preemption,
checkpoints, tracing, commands, views); each takes this core and nothing of
the others it does not need, so a part can be read alone. The core also
carries the job's own life: its state machine and how it ends, which any part
may call for (a failed recovery fails the job, a dying gasp ends it).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from undying.config import JobConfig
from undying.jobfiles.events import EventLog
from undying.jobfiles.records import (
    Incident,
    IncidentStatus,
    JobState,
    JobStateMachine,
    RankInfo,
    RankState,
    quote_first_failure,
)
from undying.manager import heap
from undying.manager.checkpoints import CheckpointHealth
from undying.manager.membership import Generations, RankBook
from undying.manager.placement import HostBook
from undying.manager.steps import StepClock
from undying.protocol.generations import GenerationRecord
from undying.protocol.seams import AgentHandle

__all__ = ["JobCore"]

log = logging.getLogger("undying.manager")


class JobCore:
    def __init__(self, config: JobConfig, events: EventLog) -> None:
        self.config = config
        self.events = events
        self.machine = JobStateMachine()
        self.book = RankBook(events, config.nproc_per_node, range(config.nnodes))
        self.generations = Generations(config.job_id, config.host)
        self.clock = StepClock(config.world_size)
        self.agents: dict[int, AgentHandle] = {}
        self.incidents: list[Incident] = []
        self.health = CheckpointHealth(events, self.incidents)  # failed saves as incidents
        # drained and quarantined hosts: no new ranks there (manager/placement/hosts.py)
        self.hosts = HostBook()
        self.exit_reason = ""
        self.started_at = time.time()
        self.finished = asyncio.Event()
        self._layout_hooks: list[Callable[[int], None]] = []

    # --- the ranks and their processes -----------------------------------------

    @property
    def state(self) -> JobState:
        return self.machine.state

    @property
    def ranks(self) -> dict[int, RankInfo]:
        return self.book.ranks

    @property
    def winding_down(self) -> bool:
        """The job is stopping or over: no fault is recovered any more."""
        return self.state.terminal or self.state is JobState.STOPPING

    def agent_of(self, rank: int) -> AgentHandle:
        return self.agents[self.ranks[rank].node]

    def nodes_available(self) -> list[int]:
        """The nodes whose agent is here now, in order (a standalone agent always is)."""
        return sorted(n for n, a in self.agents.items() if a.attached)

    def live_ranks(self) -> set[int]:
        return {r for a in self.agents.values() for r in a.live_ranks()}

    def set_layout(self, nodes: list[int], *, step: int = 0, persist: bool = True) -> None:
        """The job trains on ``nodes`` from now on: its ranks are numbered anew, what was per rank
        restarts."""
        self.book.set_layout(nodes, step=step, persist=persist)
        self.clock.reset(self.book.world_size)
        for hook in self._layout_hooks:
            hook(self.book.world_size)

    def on_layout(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(world_size)`` whenever the layout changes."""
        self._layout_hooks.append(hook)

    def open_generation(self, reason: str, *, members: dict[int, int] | None = None,
                        purpose: str = "") -> GenerationRecord:
        """The next generation, of every rank of the layout or, for a regroup, of ``members``
        (renumbered)."""
        size = len(members) if members is not None else self.book.world_size
        record = self.generations.open_next(size, reason, members=members, purpose=purpose)
        self.events.event("generation_opened", generation=record.generation, reason=reason,
                          store_port=record.store_port)
        self.events.set_job("generation", record.generation, flush=True)
        return record

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool,
              resume_from: str = "", restart: bool = False) -> bool:
        """Give ``rank`` a process; True when it was a warm spare.

        A replacement (``joining``) and a process of a restart of every rank (``restart``) count as
        one of the rank's restarts (torchrun's TORCHELASTIC_RESTART_COUNT counts the latter)."""
        info = self.ranks[rank]
        # The rank now belongs to the process about to start: any older one is fenced out of every
        # later generation (it reads the owner before joining), even one on a host cut off
        # meanwhile.
        incarnation = self.book.take(rank)
        self.generations.set_owner(rank, incarnation)
        pid, warm = self.agents[info.node].spawn(rank, record, joining=joining,
                                                 resume_from=resume_from, incarnation=incarnation)
        info.pid = pid  # 0 for a node across the network until it says which (on_spawned)
        info.state = RankState.STARTING
        info.generation = record.generation
        info.last_seen = time.time()
        if joining or restart:
            info.restarts += 1
        self.events.event("spawned", generation=record.generation, rank=rank, pid=pid,
                          joining=joining, spare=warm)
        self.book.persist(info)
        return warm

    def kill(self, rank: int) -> None:
        self.agent_of(rank).kill(rank, signal.SIGKILL)

    # --- the job's life --------------------------------------------------------

    def move(self, new: JobState) -> None:
        if new is self.state and new is not JobState.RECOVERING:
            return
        self.machine.move(new)
        self.events.event("job_state", state=new.value)
        self.persist_state()
        if new is JobState.RUNNING:
            heap.job_running()  # (what was built to run the steps is not walked by the collector)

    def persist_state(self) -> None:
        self.events.set_job("state", self.state.value, flush=True)

    def fail(self, reason: str) -> None:
        if self.winding_down:
            return
        # (its first line quotes the job's first failure: the exception, not only an exit code)
        self.exit_reason = reason = quote_first_failure(reason, self.incidents)
        log.error("job %s failed: %s", self.config.job_id, reason)
        # at once: a fault reported meanwhile is no new incident to decide
        self.move(JobState.STOPPING)
        asyncio.get_running_loop().create_task(self._stop_then(JobState.FAILED))

    def stop(self, reason: str) -> None:
        if self.winding_down:
            return
        self.exit_reason = reason
        self.move(JobState.STOPPING)
        asyncio.get_running_loop().create_task(self._stop_then(JobState.STOPPED))

    async def stop_all(self, grace_s: float) -> None:
        await asyncio.gather(*(a.stop_all(grace_s) for a in self.agents.values()))

    async def _stop_then(self, final: JobState) -> None:
        self.move(JobState.STOPPING)
        await self.stop_all(self.config.timeouts.stop_grace)
        self.end(final)

    def end(self, final: JobState) -> None:
        self.health.close()
        # No incident of a failed or stopped job stays open: what was still being handled failed
        # with it. (A preemption's incident stays open on purpose: the relaunch completes it.)
        for incident in self.incidents if final in (JobState.FAILED, JobState.STOPPED) else ():
            if incident.status is IncidentStatus.OPEN:
                incident.settle(IncidentStatus.FAILED)
                incident.detail.setdefault("closed",
                                           f"the job ended ({final.value}) before it was resolved")
                self.events.incident(incident)
        self.move(final)
        self.events.set_job("ended_at", time.time())
        self.events.set_job("exit_reason", self.exit_reason)
        self.events.set_job("rerun_steps", sorted(self.book.rerun_steps), flush=True)
        self.finished.set()
