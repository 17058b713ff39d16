"""The membership book: which ranks the job has, on which nodes, and what each committed.

One place owns the ranks so that every other part of the manager reads the
same answer to "who is in the job": the recovery code, the regroup, the
preemption and the views. The book also decides which rank rows the event log
rewrites: a rank that only trains on changes its step, which the steps table
holds already, so a flush after a step of thousands of ranks writes no rank row.

Its memory grows with ranks and faults, never with steps: of the steps each
rank committed it keeps the newest (a step at or below it is a re-run), so a
job of any length holds one number per rank (``committed``), plus the steps
re-run and the processes that stepped, which grow with recoveries only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from undying.jobfiles.records import RankInfo, RankState

__all__ = ["RankBook", "RowLog"]


class RowLog(Protocol):
    """What the book writes to: the event log's rank rows and job facts."""

    def rank(self, rank: int, data: dict[str, Any]) -> None: ...

    def set_job(self, key: str, value: Any, *, flush: bool = False) -> None: ...

    def forget_ranks(self, first: int) -> None: ...

    def before_flush(self, hook: Any) -> None: ...


class RankBook:
    """The ranks of the current layout, the steps each committed, and the rows due in the log."""

    def __init__(self, log: RowLog, nproc_per_node: int, nodes: Iterable[int]) -> None:
        self._log = log
        self.per_node = nproc_per_node
        # The nodes the job trains on, in rank order (rank r is on nodes[r // nproc_per_node]):
        # every node of --nnodes, or, for an elastic job, those it has (see set_layout).
        self.nodes: list[int] = []
        self.ranks: dict[int, RankInfo] = {}
        # rank -> the newest step it committed: a step at or below it ran before
        self.committed: dict[int, int] = {}
        self.rerun_steps: set[int] = set()
        self.finished: set[int] = set()
        self.incarnations = 0  # the newest process given a rank (see take)
        self.stepped: set[int] = set()  # the processes (incarnations) that committed a step
        self._dirty: set[int] = set()
        log.before_flush(self._write_dirty)
        self.set_layout(list(nodes), persist=False)

    @property
    def world_size(self) -> int:
        """The ranks the job trains on now
        (an elastic job's layout may hold fewer nodes than --nnodes)."""
        return len(self.ranks)

    def newest_step(self) -> int:
        return max((r.step for r in self.ranks.values()), default=0)

    def slowest_step(self) -> int:
        return min((r.step for r in self.ranks.values()), default=0)

    def any_done(self) -> bool:
        return any(r.state is RankState.DONE for r in self.ranks.values())

    def all_done(self) -> bool:
        return all(r.state is RankState.DONE for r in self.ranks.values())

    def set_layout(self, nodes: list[int], *, step: int = 0, persist: bool = True) -> None:
        """The job trains on ``nodes`` from now on: its ranks are numbered anew, node by node."""
        self.nodes = list(nodes)
        self.ranks = {
            slot * self.per_node + local: RankInfo(rank=slot * self.per_node + local, node=node,
                                                   step=step)
            for slot, node in enumerate(nodes) for local in range(self.per_node)
        }
        if persist:
            self._log.forget_ranks(self.world_size)
            for info in self.ranks.values():
                self.persist(info)
            self._log.set_job("world_size", self.world_size)
            self._log.set_job("nodes", self.nodes, flush=True)

    def take(self, rank: int) -> int:
        """A new incarnation for ``rank``: the process about to start owns it,
        every older one is fenced."""
        self.incarnations += 1
        self.ranks[rank].incarnation = self.incarnations
        return self.incarnations

    def commit(self, rank: int, step: int, generation: int, t: float) -> bool:
        """``rank`` committed ``step``; True when the step ran before
        (a re-run after a recovery)."""
        info = self.ranks[rank]
        newest = self.committed.get(rank)
        rerun = newest is not None and step <= newest
        if rerun:
            self.rerun_steps.add(step)
        else:
            self.committed[rank] = step
        self.stepped.add(info.incarnation)
        moved = info.state is not RankState.RUNNING or info.generation != generation
        info.step, info.generation = step, generation
        info.state, info.last_seen = RankState.RUNNING, t
        if moved:
            self._dirty.add(rank)  # its row is written as the log commits
        return rerun

    def persist(self, info: RankInfo) -> None:
        self._log.rank(info.rank, info.to_dict())
        self._dirty.discard(info.rank)

    def _write_dirty(self) -> None:
        for rank in self._dirty:
            self._log.rank(rank, self.ranks[rank].to_dict())
        self._dirty.clear()

    def restore(self, rows: Iterable[RankInfo], newest_steps: dict[int, int]) -> None:
        """Read the ranks back from the log of a manager that died
        (its rank rows and the newest step each rank committed)."""
        for row in rows:
            info = self.ranks.get(row.rank)
            if info is None:
                continue
            info.pid, info.step, info.generation = row.pid, row.step, row.generation
            info.state, info.restarts = row.state, row.restarts
            info.last_seen, info.incarnation = row.last_seen, row.incarnation
            self.incarnations = max(self.incarnations, info.incarnation)
        for rank, step in newest_steps.items():
            self.committed[rank] = max(step, self.committed.get(rank, step))
        # a row is not rewritten per step (see commit): the steps say
        for info in self.ranks.values():
            newest = self.committed.get(info.rank)
            if newest:
                info.step = max(info.step, newest)
                # (whose commits they were is not logged: its process is taken to have stepped, so
                # its failure is never judged a start-up one)
                self.stepped.add(info.incarnation)
