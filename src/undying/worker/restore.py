"""Where each rank's state comes from after a fault, and moving it there.

Planning is a pure function of what every member reports about itself, so all
ranks compute the same plan without asking anyone. The state moves from one
surviving holder to each rank that lacks it over the new process group
(point-to-point), with a checksum the receiver verifies before loading.
"""

from __future__ import annotations

import ctypes
import io
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from undying.checkpoint.safe_load import load_state_bytes
from undying.errors import NoStateSourceError, RecoveryError

__all__ = [
    "MODE_UNKNOWN", "MODE_REPLICATED", "MODE_SHARDED",
    "RankStatus", "RestorePlan", "exchange_statuses", "plan_restore", "send_state", "recv_state",
]


# What kind of state a member holds (a replacement knows only once it receives some).
MODE_UNKNOWN, MODE_REPLICATED, MODE_SHARDED = 0, 1, 2
# In-memory copies a sharded member reports: its own snapshots and the replicas it holds (newest two each).
_COPIES = 2


@dataclass(frozen=True)
class RankStatus:
    rank: int
    # Last step whose body this rank completed (0: none yet, the initial state).
    committed: int
    # False when the live state may be half-updated (the optimizer stepped
    # in a step that then failed) or when the process holds no state at all.
    clean: bool
    # False for a replacement process that has not received state yet.
    has_state: bool
    # MODE_REPLICATED (every rank holds the whole state), MODE_SHARDED, or MODE_UNKNOWN.
    mode: int = MODE_UNKNOWN
    # Sharded only: steps of this rank's own serialized snapshots, and of the
    # replicas of its ring predecessor's shard that it holds (worker.replica).
    own: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()


@dataclass(frozen=True)
class RestorePlan:
    target: int
    donor: int
    receivers: tuple[int, ...]


def _padded(steps: tuple[int, ...]) -> list[int]:
    newest = sorted(steps, reverse=True)[:_COPIES]
    return newest + [-1] * (_COPIES - len(newest))


def exchange_statuses(status: RankStatus) -> list[RankStatus]:
    """Every member's status, gathered over the default group (plain tensors, no pickling)."""
    mine = torch.tensor([status.rank, status.committed, int(status.clean), int(status.has_state), status.mode,
                         *_padded(status.own), *_padded(status.replicas)], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    statuses = []
    for t in gathered:
        v = [int(x) for x in t]
        statuses.append(RankStatus(
            rank=v[0], committed=v[1], clean=bool(v[2]), has_state=bool(v[3]), mode=v[4],
            own=tuple(s for s in v[5:5 + _COPIES] if s >= 0),
            replicas=tuple(s for s in v[5 + _COPIES:5 + 2 * _COPIES] if s >= 0),
        ))
    return statuses


def plan_restore(statuses: list[RankStatus]) -> RestorePlan:
    """The newest step some member holds cleanly; everyone else receives it.

    Taking the newest clean step means no completed work is thrown away: a rank
    that finished step s+1 before a peer died keeps it and shares it.
    """
    holders = [s for s in statuses if s.has_state and s.clean]
    if not holders:
        raise NoStateSourceError(
            "no surviving rank holds a complete state "
            f"(members: {', '.join(f'rank {s.rank}: committed {s.committed}, clean={s.clean}, has_state={s.has_state}' for s in statuses)})"
        )
    target = max(s.committed for s in holders)
    donor = min(s.rank for s in holders if s.committed == target)
    receivers = tuple(
        sorted(
            s.rank
            for s in statuses
            if not (s.has_state and s.clean and s.committed == target)
        )
    )
    return RestorePlan(target=target, donor=donor, receivers=receivers)


def send_state(state: dict[str, Any], receivers: tuple[int, ...]) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    view = buffer.getbuffer()
    checksum = zlib.crc32(view)
    payload = torch.frombuffer(view, dtype=torch.uint8)  # no copy
    header = torch.tensor([payload.numel(), checksum], dtype=torch.int64)
    for rank in receivers:
        dist.send(header, dst=rank)
        dist.send(payload, dst=rank)
    return int(payload.numel())


def recv_state(donor: int) -> dict[str, Any]:
    header = torch.zeros(2, dtype=torch.int64)
    dist.recv(header, src=donor)
    size, expected = int(header[0]), int(header[1])
    payload = torch.empty(size, dtype=torch.uint8)
    dist.recv(payload, src=donor)
    raw = ctypes.string_at(payload.data_ptr(), size)  # one memcpy
    actual = zlib.crc32(raw)
    if actual != expected:
        raise RecoveryError(
            f"state from rank {donor} failed its checksum (crc32 {actual:#x}, expected {expected:#x})"
        )
    return load_state_bytes(raw, source=f"rank {donor}")
