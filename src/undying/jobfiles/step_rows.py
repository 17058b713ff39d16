"""The log's commits kept compactly: one row per step (and flush), its ranks' values packed in it.

A rank commits every step, so the log's commits are the one thing in it that
grows with ranks x steps. ``EventLog`` keeps the commits it is handed until
its next flush (a short timer); the commits of a step among them become one
row of ``node_steps`` (a row a step, two for one whose commits straddle a
flush, whichever way the commits came: a node's ``NodeStep`` or one rank's at
a time, so never more rows than node-steps in practice): the step, the
generation, the earliest commit's time, the ranks (``"0-7"``: runs of
consecutive ranks), the names given to ``step.log`` (``'["loss"]'``) and,
per rank, its commit time and its values as float64 (``data``; 8 bytes each,
exact: a NaN loss reads back as NaN, a time as it was sent). Per rank stays
only what differs per rank and what the oracle compares: each rank's values
and commit time.

A log written before (``steps``: one row per rank and step, schema 1) stays
readable: ``in_time_order`` merges both tables' commits into one stream, in
time order as the old reader gave them.

Pure: no SQL here (``events`` runs the queries and hands the rows over).
"""

from __future__ import annotations

import heapq
import json
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import count

from undying.jobfiles.log_rows import Commit

__all__ = ["NodeStepRow", "pack", "unpack", "rank_runs", "ranks_of", "in_time_order"]

# (step, generation, t, ranks, names, data): a row of node_steps as SQL gives it back
NodeStepRow = tuple[int, int, float, str, str, bytes]
# (rank, step, generation, t, metrics): a commit as the manager logs it
CommitIn = tuple[int, int, int, float, Mapping[str, float | str]]

_SWAP = sys.byteorder != "little"  # data is little-endian on every machine


def rank_runs(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``"0-3,6"``: runs of consecutive ranks, in the order given."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def ranks_of(runs: str) -> list[int]:
    """The inverse of ``rank_runs``."""
    ranks: list[int] = []
    for part in runs.split(",") if runs else ():
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def pack(commits: Iterable[CommitIn]) -> list[NodeStepRow]:
    """Commits (typically one node's of one step) as rows: one per step, generation and set of
    names, in the order first seen."""
    groups: dict[tuple[int, int, tuple[str, ...]], list[tuple[int, float, list[float]]]] = {}
    for rank, step, generation, t, metrics in commits:
        names = tuple(metrics)
        groups.setdefault((step, generation, names), []).append(
            (rank, float(t), [float(v) for v in metrics.values()]))
    rows: list[NodeStepRow] = []
    for (step, generation, names), members in groups.items():
        members.sort(key=lambda member: member[0])  # by rank (stable): runs like "0-7"
        values = array("d")
        for _, t, numbers in members:
            values.append(t)
            values.extend(numbers)
        if _SWAP:
            values.byteswap()
        rows.append((step, generation, min(t for _, t, _ in members),
                     rank_runs([rank for rank, _, _ in members]),
                     json.dumps(list(names), separators=(",", ":")), values.tobytes()))
    return rows


def unpack(row: NodeStepRow) -> list[Commit]:
    """A row's commits, in its ranks' order; a row that does not add up raises ValueError."""
    step, generation, _, runs, names_text, data = row
    ranks, names = ranks_of(runs), json.loads(names_text)
    values = array("d")
    values.frombytes(bytes(data))
    if _SWAP:
        values.byteswap()
    width = 1 + len(names)
    if len(values) != width * len(ranks):
        raise ValueError(f"a node_steps row of step {step} holds {len(values)} numbers for "
                         f"{len(ranks)} rank(s) of {len(names)} value(s) each")
    return [Commit(rank, int(step), int(generation), values[i * width],
                   {name: values[i * width + 1 + k] for k, name in enumerate(names)})
            for i, rank in enumerate(ranks)]


def _rows_in_time_order(rows: Iterable[NodeStepRow]) -> Iterator[Commit]:
    """The commits of rows ordered by their earliest commit, in time order: a row's later commits
    wait in a heap until no row still to come can hold an earlier one."""
    heap: list[tuple[float, int, Commit]] = []
    order = count()
    for row in rows:
        while heap and heap[0][0] <= row[2]:
            yield heapq.heappop(heap)[2]
        for commit in unpack(row):
            heapq.heappush(heap, (commit.t, next(order), commit))
    while heap:
        yield heapq.heappop(heap)[2]


def in_time_order(old: Iterable[Commit], rows: Iterable[NodeStepRow]) -> Iterator[Commit]:
    """The commits of a log, in time order: the old per-rank rows (already in time order) and
    the node-step rows (ordered by their ``t``), merged (on a tie, the old table's first)."""
    return heapq.merge(old, _rows_in_time_order(rows), key=lambda c: c.t)
