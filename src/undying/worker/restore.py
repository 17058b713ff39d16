"""Moving a restore's state: what every member holds, gathered, and a whole state sent to who
lacks it.

Where each rank's state comes from is decided by the one restore planner
(``undying.checkpoint.planner.plan``) over the members gathered here, so all
ranks compute the same plan without asking anyone; this module only moves
bytes. A whole (replicated) state goes from a donor to each receiver over the
new process group (point-to-point), with a checksum the receiver verifies
before loading.
"""

from __future__ import annotations

import ctypes
import io
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from undying.checkpoint.planner import Member
from undying.checkpoint.safe_load import load_state_bytes
from undying.errors import RecoveryError

__all__ = [
    "MODE_UNKNOWN", "MODE_REPLICATED", "MODE_SHARDED",
    "RankStatus", "exchange_statuses", "send_state", "recv_state", "settle",
]


# What kind of state a member holds (a replacement knows only once it receives some).
MODE_UNKNOWN, MODE_REPLICATED, MODE_SHARDED = 0, 1, 2
# In-memory copies a sharded member reports: its own snapshots and the replicas it holds (newest two
# each).
_COPIES = 2


@dataclass(frozen=True)
class RankStatus:
    """What a member tells the others at a restore: its holdings (for the planner) and its kind
    of state."""

    member: Member
    mode: int = MODE_UNKNOWN


def _padded(steps: tuple[int, ...]) -> list[int]:
    newest = sorted(steps, reverse=True)[:_COPIES]
    return newest + [-1] * (_COPIES - len(newest))


def exchange_statuses(status: RankStatus) -> list[RankStatus]:
    """Every member's status, gathered over the default group (plain tensors, no pickling)."""
    m = status.member
    mine = torch.tensor([m.rank, m.step, int(m.clean), int(m.has_state), status.mode,
                         *_padded(m.snapshots), *_padded(m.replicas)], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    statuses = []
    for t in gathered:
        v = [int(x) for x in t]
        member = Member(
            rank=v[0], step=v[1], clean=bool(v[2]), has_state=bool(v[3]),
            snapshots=tuple(s for s in v[5:5 + _COPIES] if s >= 0),
            replicas=tuple(s for s in v[5 + _COPIES:5 + 2 * _COPIES] if s >= 0),
        )
        statuses.append(RankStatus(member, mode=v[4]))
    return statuses


def send_state(state: dict[str, Any], receivers: tuple[int, ...]) -> list[dist.Work | None]:
    """Start sending the whole state to each receiver; finish with ``settle``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    view = buffer.getbuffer()
    checksum = zlib.crc32(view)
    payload = torch.frombuffer(view, dtype=torch.uint8)  # no copy
    header = torch.tensor([payload.numel(), checksum], dtype=torch.int64)
    works: list[dist.Work | None] = []
    for rank in receivers:
        works += [dist.isend(header, dst=rank), dist.isend(payload, dst=rank)]
    return works


def settle(received: Sequence[dist.Work | None], sent: Sequence[dist.Work | None]) -> None:
    """Finish a transfer every rank of the group takes part in: this rank's receives, a barrier,
    then its sends.

    A receive fails as soon as its peer's connection does; a send may not. gloo
    (as torch bundles it) queues a send whose write met a connection the peer
    had already closed, and a closing connection wakes no queued send, so its
    wait would last the whole collective timeout (600 s by default): a survivor
    stuck there while the manager waits for it to leave. Waited on after a
    barrier that every rank entered with its receives done, each send was
    delivered and returns at once; a peer gone before that fails a receive or
    the barrier instead, at once. (The barrier's own sends keep a narrower
    window: a peer that leaves between posting its receive and taking the data.)
    A None (what ``isend`` returns to a rank outside the group) is skipped.
    """
    for work in received:
        if work is not None:
            work.wait()
    dist.barrier()
    for work in sent:
        if work is not None:
            work.wait()


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
            f"state from rank {donor} failed its checksum (crc32 {actual:#x}, expected "
            f"{expected:#x})"
        )
    return load_state_bytes(raw, source=f"rank {donor}")
