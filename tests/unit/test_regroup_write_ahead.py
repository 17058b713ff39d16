"""A regroup's record is in the log before anything it decided reaches a rank (manager/regroup/executor.py).

A manager may be SIGKILLed the moment after it told the members to leave,
let one go or started the new world. Its successor knows only what the log
has committed, and the agents tell it again only what came after that (a
member's exit as it left): with the record committed a flush later, it took
a member's leave for a crash and replaced it (the job then failed, no rank
left to save the state), or would start the new world twice. The agent here
reads the log as a restarted manager would, from another connection, at
the moment each command reaches it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.unit.live_manager import FakeAgent, running
from undying.checkpoint.discovery import Checkpoint
from undying.config import EXIT_REGROUPED
from undying.jobfiles.events import read_job_table
from undying.jobfiles.records import IncidentKind


class WitnessAgent(FakeAgent):
    """A FakeAgent that notes, at each command, what a restarted manager would read."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log
        self.seen: list[tuple[str, int, Any, int]] = []  # (command, rank, logged regroup, generation)

    def _witness(self, command: str, rank: int) -> None:
        if self.log.exists():
            job = read_job_table(self.log)
            self.seen.append((command, rank, job.get("regroup"), int(job.get("generation", -1))))

    def abort(self, rank: int, generation: int, reason: str, *, at_step_start: bool = False,
              from_step: int = 0) -> bool:
        self._witness("abort", rank)
        return super().abort(rank, generation, reason, at_step_start=at_step_start)

    def kill(self, rank: int, sig: Any) -> bool:
        self._witness("kill", rank)
        return super().kill(rank, sig)

    def spawn(self, rank: int, record: Any, *, joining: bool, resume_from: str = "",
              incarnation: int = 0) -> tuple[int, bool]:
        self._witness("spawn", rank)
        return super().spawn(rank, record, joining=joining, resume_from=resume_from,
                             incarnation=incarnation)


@contextlib.contextmanager
def _job(tmp_path: Path, ranks: int) -> Iterator[tuple[Any, WitnessAgent]]:
    """A running job whose node's agent is a witness (what it saw at the start cleared)."""
    witness = WitnessAgent(tmp_path / "e.db")
    manager, _ = running(tmp_path, ranks=ranks, agent=witness)
    witness.seen.clear()  # (the start's spawns)
    with contextlib.closing(manager):
        yield manager, witness


def test_every_member_is_told_to_leave_only_once_the_regroup_is_committed(tmp_path: Path) -> None:
    with _job(tmp_path, ranks=2) as (manager, agent):
        manager.regrouping.begin("node 1 lost")
        regroup = manager.regrouping.regroup
        assert regroup is not None and [c for c, *_ in agent.seen] == ["abort", "abort"], agent.seen
        for _, rank, logged, _generation in agent.seen:
            assert logged is not None and str(rank) in logged["members"], (rank, logged)
            assert logged["generation"] == regroup.generation, logged


def test_a_member_is_let_go_only_once_its_release_is_committed(tmp_path: Path) -> None:
    with _job(tmp_path, ranks=3) as (manager, agent):
        manager.regrouping.begin("node 1 lost")
        manager.regrouping.on_saved("regroup", str(tmp_path / "step-000000004"))
        rank2 = manager.ranks[2]
        manager.on_exit(2, rank2.pid, -9, time.time())  # a second fault, once the state is saved
        agent.seen.clear()
        manager.regrouping.watch()
        assert sorted(r for c, r, *_ in agent.seen if c == "kill") == [0, 1], agent.seen
        for _, rank, logged, _generation in agent.seen:
            assert logged is not None and rank in logged["released"], (rank, logged)
            assert logged["saved"] and logged["left"] == {"2": -9}, logged


def test_the_new_world_starts_only_once_the_regroup_s_end_is_committed_with_its_generation(
        tmp_path: Path) -> None:
    with _job(tmp_path, ranks=2) as (manager, agent):
        now = time.time()
        manager.recoveries.new_incident(kind=IncidentKind.NODE_LOSS, rank=1, step=5, fault_t=now,
                                        detected_t=now, error="node 1 lost")
        manager.regrouping.begin("node 1 lost")
        regroup = manager.regrouping.regroup
        assert regroup is not None
        folder = tmp_path / "checkpoints" / "step-000000004"
        regroup.checkpoint = Checkpoint(name=folder.name, step=4, path=str(folder), url=str(folder),
                                        manifest=None)
        agent.seen.clear()
        for rank in (0, 1):
            manager.on_exit(rank, manager.ranks[rank].pid, EXIT_REGROUPED, time.time())
        spawns = [(rank, logged, generation) for c, rank, logged, generation in agent.seen
                  if c == "spawn"]
        assert [rank for rank, *_ in spawns] == [0, 1], agent.seen
        new_generation = manager.core.generations.current
        assert new_generation > regroup.generation
        for rank, logged, generation in spawns:
            assert logged is None and generation == new_generation, (rank, logged, generation)
