"""Joining a generation: read its record, build the default process group on its store.

The default group is the one user code reaches through ``torch.distributed``
calls without a ``group=`` argument, so it is rebuilt in place for every
generation: a script's own ``dist.all_reduce`` keeps working after recovery.
The store prefix matches what ``init_process_group("env://")`` uses, so a
replacement whose script calls ``init_process_group`` itself meets the
survivors in the same group.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from undying.errors import (
    ControlStoreLostError,
    FencedError,
    GenerationSupersededError,
    RecoveryError,
)
from undying.protocol.env import GENERATION_ENV
from undying.protocol.generations import (
    GenerationRecord,
    arrival_key,
    generation_key,
    rank_owner_key,
)
from undying.protocol.store_client import JobStore, hold
from undying.protocol.store_wire import generation_store

__all__ = [
    "collectives_entered",
    "read_generation", "join_generation", "leave_group", "break_connections",
    "claim_existing_sockets",
    "is_comm_failure", "check_owner",
]

log = logging.getLogger(__name__)

# Substrings of the errors gloo and c10d raise when a peer or a link fails.
_COMM_ERROR_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "Write error",
    "Broken pipe",
    "Socket Timeout",
    "Timed out",
    "timed out",
    "Connection refused",
    "gloo",
    "ProcessGroupGloo",
    "NCCL",
    "DistBackendError",
)


def is_comm_failure(error: BaseException) -> bool:
    """True for an error that a failed peer or link causes, not the user's code."""
    if isinstance(error, dist.DistError):
        return True
    if isinstance(error, RuntimeError):
        text = str(error)
        return any(marker in text for marker in _COMM_ERROR_MARKERS)
    return False


def read_generation(control: dist.Store, generation: int, deadline: float) -> GenerationRecord:
    key = generation_key(generation)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise RecoveryError(f"timed out waiting for the manager to open generation {generation}")
    try:
        control.wait([key], timedelta(seconds=remaining))
    except dist.DistError as e:
        if not _is_timeout(e):
            raise ControlStoreLostError(f"the manager's control store is unreachable: {e}") from e
        raise RecoveryError(
            f"the manager did not open generation {generation} within the rendezvous timeout "
            f"({remaining:.0f}s): {e}"
        ) from e
    return GenerationRecord.from_json(control.get(key))


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timeout" in text or "timed out" in text


def check_owner(control: dist.Store, rank: int, incarnation: int) -> None:
    """Refuse to join when the manager gave ``rank`` to a newer process (see ``rank_owner_key``)."""
    if incarnation <= 0:
        return
    key = rank_owner_key(rank)
    try:
        if not control.check([key]):
            return
        owner = int(control.get(key))
    except dist.DistError as e:
        raise ControlStoreLostError(f"the manager's control store is unreachable: {e}") from e
    if owner != incarnation:
        raise FencedError(
            f"rank {rank} now belongs to process #{owner} (this one is #{incarnation}): "
            "its host was "
            "declared lost and the rank replaced; this process leaves"
        )


# The sockets each group opened (fd -> "socket:[inode]"), to break them on leaving.
_group_sockets: dict[int, str] = {}


def _sockets() -> dict[int, str]:
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no procfs: leaving relies on the group being collected
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


def claim_existing_sockets() -> None:
    """The script built its own group before ``undying.init()``: its sockets are those open now.

    Called first thing in ``init()``, before undying opens any socket of its own.
    """
    _group_sockets.update(_sockets())


def break_connections(*, reading_only: bool = False) -> int:
    """Shut down the current group's connections.

    Both ways (leaving the group): peers blocked on this rank fail at once.
    ``reading_only`` (told to leave, while a collective may be under way): this
    rank's own collective fails at once, its reads ended, but no write in flight
    is failed under it. gloo queues a send whose write fails before gloo has
    seen its connection end, and never wakes it: a survivor whose own shutdown
    failed its write sat in its collective for the whole collective timeout.
    Its peers learn when it leaves the group (``leave_group``), both ways.

    Checks each descriptor still names the same socket, so a number reused
    since is never touched. Returns how many connections were broken.
    """
    current = _sockets()
    broken = 0
    for fd, link in list(_group_sockets.items()):
        if current.get(fd) != link:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # gloo's listener: shutting it down aborts the process
                s.shutdown(socket.SHUT_RD if reading_only else socket.SHUT_RDWR)
            broken += 1
        except OSError:
            pass
    if not reading_only:
        _group_sockets.clear()
    return broken


def collectives_entered() -> int:
    """How many collectives this rank entered in the current group (-1: no group).

    The process group's sequence number counts a collective when a rank calls
    it, before it completes, so of ranks stuck together the one the others
    wait for shows the smallest count. Safe to read from another thread.
    """
    try:
        if not dist.is_initialized():
            return -1
        group = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except Exception:  # a group being torn down, or a backend without sequence numbers
        return -1


def leave_group() -> None:
    """Destroy the default group and, with it, its connections.

    Closing the connections matters as much as leaving: a peer blocked in a
    collective on a live rank only fails when that rank's sockets close, so
    every survivor that leaves passes the failure on at once. The group closes
    only when nothing references it, hence the collection around the destroy
    (DDP reducers and failed futures hold it in reference cycles).
    """
    break_connections()
    if dist.is_initialized():
        gc.collect()
        try:
            dist.destroy_process_group()
        except Exception as e:  # a broken group may complain on the way out
            log.debug("destroying the old process group: %s", e)
        gc.collect()


def _build(record: GenerationRecord, rank: int, backend: str, connect_s: float, collective_s: float,
           key: bytes, job_rank: int) -> None:
    before = _sockets()
    # The default group's name ("0") prefixes its keys in the store. A failed
    # init_process_group used the name without resetting the counter behind it
    # (only destroy_process_group does), so a rank that failed to form one
    # generation would name the next group "1" and wait forever for keys its
    # peers wrote under "0".
    dist.distributed_c10d._world.group_count = 0
    # Held: the group, and groups made from it later (new_group), call into it after this returns.
    store = hold("generation", JobStore(record.store_host, record.store_port,
                                        generation_store(record.generation),
                                        key, timedelta(seconds=connect_s)))
    store.set(arrival_key(job_rank), "1")  # (who came, should the group fail to form)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=record.world_size,
        timeout=timedelta(seconds=collective_s),
    )
    _group_sockets.update({fd: link for fd, link in _sockets().items() if before.get(fd) != link})
    os.environ["MASTER_ADDR"] = record.store_host
    os.environ["MASTER_PORT"] = str(record.store_port)
    os.environ["WORLD_SIZE"] = str(record.world_size)
    # The store env:// opens (use_for_env_rendezvous).
    os.environ[GENERATION_ENV] = str(record.generation)


def join_generation(
    control: dist.Store,
    first: int,
    *,
    rank: int,
    backend: str,
    rendezvous_s: float,
    connect_s: float,
    collective_s: float,
    incarnation: int = 0,
    deadline: float | None = None,
    key: bytes,
    unformed: Callable[[int, Exception], None] | None = None,
) -> GenerationRecord:
    """Join generation ``first`` or, if it was superseded, the one that replaced it.

    ``unformed(generation, error)`` is told when a generation failed to form here (a peer that
    never came, a link that failed while connecting) and is still open, before this rank waits
    for the manager to replace it: the manager hears it as the generation's failure
    (``CommFailure``), where no exit or silence would tell it, and opens the next one instead of
    waiting out its recovery timeout. One superseded meanwhile (its store closed, which failed the
    wait) is followed at once, untold.
    """
    deadline = time.monotonic() + rendezvous_s if deadline is None else deadline
    generation = first
    while True:
        record = read_generation(control, generation, deadline)
        if record.status == "superseded":
            generation = record.superseded_by
            continue
        check_owner(control, rank, incarnation)
        member = record.member_rank(rank)
        if member is None:
            raise FencedError(f"rank {rank} is no member of generation {record.generation} "
                              f"({record.reason}): the job regroups without this process")
        leave_group()
        try:
            _build(record, member, backend, connect_s, collective_s, key, rank)
            return record
        except Exception as e:
            if not is_comm_failure(e):
                raise
            leave_group()
            log.info("rank %d: generation %d failed to form (%s); waiting for the next",
                     rank, generation, e)
            if unformed is not None and _superseded_by(control, generation) is None:
                unformed(generation, e)  # (superseded already: its store closed, the manager knows)
            generation = _wait_superseded(control, generation, deadline)


def _superseded_by(control: dist.Store, generation: int) -> int | None:
    """The generation that replaced ``generation``; None while it is open."""
    try:
        record = GenerationRecord.from_json(control.get(generation_key(generation)))
    except dist.DistError as e:
        raise ControlStoreLostError(f"the manager's control store is unreachable: {e}") from e
    return record.superseded_by if record.status == "superseded" else None


def _wait_superseded(control: dist.Store, generation: int, deadline: float) -> int:
    """A generation that failed to form is superseded by the manager soon (told by ``unformed``, or
    by a member's exit); follow it."""
    while time.monotonic() < deadline:
        after = _superseded_by(control, generation)
        if after is not None:
            return after
        time.sleep(0.02)
    raise GenerationSupersededError(
        f"generation {generation} failed to form and the manager opened no replacement in time"
    )
