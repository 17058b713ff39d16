"""A real Manager driven as its agents would drive it, with agents that start nothing (unit tests)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

from undying.config import JobConfig
from undying.jobfiles.events import EventLog
from undying.manager.manager import Manager
from undying.protocol.generations import GenerationRecord
from undying.protocol.worker_wire import Hello, StepCommitted

__all__ = ["FakeAgent", "running", "starting", "on_nodes"]


class FakeAgent:
    """A node's agent as the manager drives it: spawns are numbered processes, nothing runs."""

    node = 0

    def __init__(self) -> None:
        self.spawned: list[tuple[int, bool]] = []
        self.killed: list[int] = []
        self.armed: list[tuple[int, str]] = []
        self.aborted: list[tuple[int, int]] = []  # (rank, generation)
        self.aborted_at_step_start: list[tuple[int, int]] = []  # the planned leaves among them
        # A lost peer's survivors, told to leave any step from from_step on: (rank, generation, from_step).
        self.leaving_from: list[tuple[int, int, int]] = []

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool, resume_from: str = "",
              incarnation: int = 0) -> tuple[int, bool]:
        self.spawned.append((rank, joining))
        return 1000 + len(self.spawned), False

    def kill(self, rank: int, sig: Any) -> bool:
        self.killed.append(rank)
        return True

    def abort(self, rank: int, generation: int, reason: str, *, at_step_start: bool = False,
              from_step: int = 0) -> bool:
        if from_step:
            self.leaving_from.append((rank, generation, from_step))
            return True
        self.aborted.append((rank, generation))
        if at_step_start:
            self.aborted_at_step_start.append((rank, generation))
        return True

    def keep_spares(self) -> None:
        pass

    def set_trace(self, switch: Any) -> None:
        pass

    def arm(self, rank: int, fault: Any) -> None:
        self.armed.append((rank, fault.kind))

    def spares_ready(self) -> int:
        return 1

    def view(self) -> dict[str, Any]:
        return {"node": self.node, "host": "localhost"}

    def phases(self) -> dict[int, str]:
        return {}

    @property
    def attached(self) -> bool:
        return True

    def live_ranks(self) -> list[int]:
        """Every rank spawned here and not killed since (a kill is taken as done)."""
        return sorted({rank for rank, _ in self.spawned} - set(self.killed))

    def drop_waiting(self) -> None:
        pass


def running(tmp_path: Path, ranks: int = 2, *, agent: Any = None) -> tuple[Manager, Any]:
    """A job of ``ranks`` step-API ranks, each at step 4 of generation 0 (``agent``: the node's
    agent, a FakeAgent unless given)."""
    manager, agent = starting(tmp_path, ranks, job_id="l", agent=agent)
    _to_step_4(manager, ranks)
    return manager, agent


def starting(tmp_path: Path, ranks: int = 2, *, step_api: bool = True, max_restarts: int = 3,
             job_id: str = "s", log: str = "e.db", agent: Any = None) -> tuple[Manager, Any]:
    """A job of ``ranks`` ranks that committed no step yet: every process started (and, with the
    step API, said hello). ``agent``: the node's agent (a FakeAgent unless given)."""
    manager = Manager(JobConfig(job_id=job_id, job_dir=str(tmp_path), nproc_per_node=ranks, port=0,
                                step_api=step_api, max_restarts=max_restarts),
                      EventLog(tmp_path / log))
    agent = FakeAgent() if agent is None else agent
    _start(manager, [agent], ranks, step_api=step_api)
    return manager, agent


def on_nodes(tmp_path: Path, nodes: int = 2) -> tuple[Manager, list[FakeAgent]]:
    """A job of one step-API rank on each of ``nodes`` nodes (an agent each), at step 4."""
    manager = Manager(JobConfig(job_id="n", job_dir=str(tmp_path), nproc_per_node=1, nnodes=nodes,
                                port=0, step_api=True), EventLog(tmp_path / "e.db"))
    agents = [FakeAgent() for _ in range(nodes)]
    for node, agent in enumerate(agents):
        agent.node = node
    _start(manager, agents, nodes, step_api=True)
    _to_step_4(manager, nodes)
    return manager, agents


def _start(manager: Manager, agents: list[Any], ranks: int, *, step_api: bool) -> None:
    """Generation 0: every rank spawned on its node's agent (and, with the step API, said hello)."""
    manager.start_control_store(os.urandom(32))
    for agent in agents:
        manager.add_agent(cast(Any, agent))
    record = manager.core.open_generation("start")
    for rank in range(ranks):
        manager.core.spawn(rank, record, joining=False)
        if step_api:
            manager.on_message(Hello(rank, manager.ranks[rank].pid, 0, False, 1.0))


def _to_step_4(manager: Manager, ranks: int) -> None:
    for rank in range(ranks):
        for step in range(1, 5):
            manager.on_message(StepCommitted(rank, 0, step, 1.0 + step, {"loss": 1.0}))


def logged(manager: Manager, tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    """The events of ``kind`` in the log of a manager made here (``tmp_path``/e.db), its held writes
    flushed first."""
    from tests.integration.jobs import events

    manager.core.events.flush()
    return events(tmp_path / "e.db", kind)
