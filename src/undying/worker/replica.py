"""Ring replication of sharded state (Gemini-style): the switch, the copies, and moving them.

With ``UNDYING_REPLICATE=ring`` (``undying run --replicate ring``) every rank
of a sharded job sends a serialized copy of its own shard to its ring
successor, ``(rank + local_world_size) % world_size`` -- a rank on another
node -- and keeps the copy its predecessor sends it. It happens inside the
step transaction, after the body and before the commit, every K steps
(``UNDYING_REPLICATE_EVERY``, default 1), and ends with a barrier: a step
that any rank committed was therefore replicated by every rank (each one's
successor received its copy before entering the barrier that let the first
rank through). A replicating step that fails anywhere is aborted and re-run
like any failed step.

So after the loss of one rank (or of several that are not ring neighbours)
its shard is in its successor's memory: the replacement gets it from there,
the survivors keep their own, and nothing is read from disk. Each rank also
keeps the bytes it sent, its own snapshot, which is what it rolls back to
when its live state is ahead of the step every shard can be restored at, or
was torn by a failed step. The restore planner (``checkpoint.planner.plan``)
picks that step from what every member reports; with no such step in memory
the job falls back to the latest checkpoint.

On a single node (``local_world_size == world_size``) the successor is the
next rank: the replica then protects against the loss of a process, not of
the machine.
"""

from __future__ import annotations

import ctypes
import logging
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from undying.config import CheckpointConfig
from undying.errors import RecoveryError, UsageError
from undying.protocol.env import REPLICATE_ENV, REPLICATE_EVERY_ENV
from undying.worker.restore import settle

__all__ = [
    "ReplicationConfig",
    "ring_offset",
    "Copies",
    "exchange",
    "send_bytes",
    "recv_bytes",
]

log = logging.getLogger("undying.worker")

MODES = ("off", "ring")

# Point-to-point tags: the ring exchange and a restore's transfers never match each other's
# messages.
TAG_RING = 7101
TAG_RESTORE = 7201


@dataclass(frozen=True)
class ReplicationConfig:
    # The job's defaults, written on CheckpointConfig's fields only (the launcher's side of the
    # variables).
    mode: str = CheckpointConfig.replicate  # "off" or "ring"
    # replicate at steps that are multiples of this (and at a restore)
    every: int = CheckpointConfig.replicate_every

    @property
    def ring(self) -> bool:
        return self.mode == "ring"

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> ReplicationConfig:
        env = os.environ if env is None else env
        mode = env.get(REPLICATE_ENV, "").strip().lower() or cls.mode
        if mode not in MODES:
            raise UsageError(f"{REPLICATE_ENV}={mode!r}: use one of {', '.join(MODES)}")
        raw = env.get(REPLICATE_EVERY_ENV, "").strip() or str(cls.every)
        try:
            every = int(raw)
        except ValueError as e:
            raise UsageError(f"{REPLICATE_EVERY_ENV}={raw!r}: give a whole number of steps "
                             ">= 1") from e
        if every < 1:
            raise UsageError(f"{REPLICATE_EVERY_ENV}={every}: give a whole number of steps >= 1")
        return cls(mode, every)


def ring_offset(world_size: int, local_world_size: int) -> int:
    """How far along the ranks a shard's replica lives: the next node's rank, or the next rank on
    one node."""
    if world_size <= 1:
        return 0
    if 0 < local_world_size < world_size:
        return local_world_size
    return 1


@dataclass
class Copies:
    """This rank's in-memory copies, by step: its own serialized shard and its predecessor's
    replica."""

    own: dict[int, bytes] = field(default_factory=dict)
    replicas: dict[int, bytes] = field(default_factory=dict)

    def committed(self, step: int) -> None:
        """Step ``step`` committed: older copies are no longer a step anyone can be restored at.

        Where there is no copy of ``step`` (a replica refused for its checksum)
        the older one stays: the only copy of that shard there is.
        """
        for copies in (self.own, self.replicas):
            if step in copies:
                for old in [s for s in copies if s < step]:
                    del copies[old]

    def keep_only(self, step: int) -> None:
        for copies in (self.own, self.replicas):
            for other in [s for s in copies if s != step]:
                del copies[other]

    def clear(self) -> None:
        self.own.clear()
        self.replicas.clear()

    def nbytes(self) -> int:
        return sum(len(b) for b in self.own.values()) + sum(len(b) for b in self.replicas.values())


def _header(data: bytes) -> torch.Tensor:
    return torch.tensor([len(data), zlib.crc32(data)], dtype=torch.int64)


def _as_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _checked(payload: torch.Tensor, header: torch.Tensor, source: int) -> bytes:
    size, expected = int(header[0]), int(header[1])
    raw = ctypes.string_at(payload.data_ptr(), size) if size else b""
    actual = zlib.crc32(raw)
    if actual != expected:
        raise RecoveryError(
            f"the shard copy from rank {source} failed its checksum (crc32 {actual:#x}, "
            f"expected {expected:#x})"
        )
    return raw


def exchange(data: bytes, successor: int, predecessor: int, *, tag: int = TAG_RING) -> bytes:
    """Send ``data`` to ``successor`` and receive the predecessor's bytes, checksummed, at once.

    Collective: it ends with a barrier (``restore.settle``), so once it returns on any rank every
    rank's successor holds its copy.
    """
    header_in = torch.zeros(2, dtype=torch.int64)
    sent = [dist.isend(_header(data), dst=successor, tag=tag)]
    header_work = dist.irecv(header_in, src=predecessor, tag=tag)
    assert header_work is not None
    header_work.wait()
    incoming = torch.empty(int(header_in[0]), dtype=torch.uint8)
    if data:
        sent.append(dist.isend(_as_tensor(data), dst=successor, tag=tag + 1))
    received = [dist.irecv(incoming, src=predecessor, tag=tag + 1)] if incoming.numel() else []
    settle(received, sent)
    return _checked(incoming, header_in, predecessor)


def send_bytes(data: bytes, receiver: int, *, tag: int = TAG_RESTORE) -> list[dist.Work]:
    """Start sending ``data`` (header, then payload); wait on the returned works."""
    works = [dist.isend(_header(data), dst=receiver, tag=tag)]
    if data:
        works.append(dist.isend(_as_tensor(data), dst=receiver, tag=tag + 1))
    return [w for w in works if w is not None]


def recv_bytes(sender: int, *, tag: int = TAG_RESTORE) -> bytes:
    header = torch.zeros(2, dtype=torch.int64)
    dist.recv(header, src=sender, tag=tag)
    payload = torch.empty(int(header[0]), dtype=torch.uint8)
    if payload.numel():
        dist.recv(payload, src=sender, tag=tag + 1)
    return _checked(payload, header, sender)
