"""Generations: the numbered process groups of a job, each with a store of its own.

Every membership change opens the next generation: a fresh store on the
manager's port (``gen/<n>``) and its record on the control store, where the
workers look for it. The generation it replaces is fenced (marked superseded,
its store closed), so a rank still waiting on it fails at once instead of at a
timeout. The owner key of every rank names the newest process given it: an
older process, even one on a host cut off meanwhile, reads it before joining
and stays out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from undying.errors import UsageError
from undying.manager.stores import StoreClosedError, StoreHandle, StoreServer
from undying.protocol.generations import (
    CURRENT_KEY,
    GenerationRecord,
    arrival_key,
    generation_key,
    rank_owner_key,
)
from undying.protocol.store_wire import CONTROL_STORE, generation_store

__all__ = ["Generations"]

log = logging.getLogger("undying.manager")


class Generations:
    def __init__(self, job_id: str, host: str) -> None:
        self.job_id = job_id
        self.host = host
        self.current = -1
        self._stores: StoreServer | None = None
        self._control: StoreHandle | None = None
        self._open: dict[int, StoreHandle] = {}

    def serve(self, port: int, key: bytes) -> int:
        """Serve the job's stores on host:``port`` to processes that prove ``key``;
        the port it got."""
        try:
            self._stores = StoreServer(self.host, port, key)
            self._control = self._stores.open(CONTROL_STORE)
        except OSError as e:
            if "in use" in str(e).lower() or "EADDRINUSE" in str(e):
                raise UsageError(
                    f"port {port} is in use; pass --port with a free port, or drop --port (or "
                    "pass --port 0) to pick a free one"
                ) from e
            raise UsageError(f"cannot listen on {self.host}:{port}: {e}") from e
        return self._control.port

    @property
    def control_port(self) -> int:
        assert self._control is not None, "the job's stores are not served yet (serve)"
        return self._control.port

    def open_next(self, world_size: int, reason: str, *, members: dict[int, int] | None = None,
                  purpose: str = "") -> GenerationRecord:
        """The next generation, announced; the one before it is fenced."""
        previous = self.current
        self.current += 1
        record = self._announce(self.current, world_size, reason, members=members or {},
                                purpose=purpose)
        if previous >= 0:
            self._supersede(previous, self.current)
        log.info("job %s: generation %d opened (%s)", self.job_id, self.current, reason)
        return record

    def reannounce(self, world_size: int, *, members: dict[int, int] | None = None,
                   purpose: str = "") -> None:
        """A restarted manager's new stores: the current generation again,
        for the ranks that run it."""
        if self.current >= 0:
            self._announce(self.current, world_size, "the manager restarted", members=members or {},
                           purpose=purpose)

    def set_owner(self, rank: int, incarnation: int) -> None:
        assert self._control is not None
        self._control.set(rank_owner_key(rank), str(incarnation))

    def store_port(self) -> int:
        return self._open[self.current].port

    def arrived(self, generation: int, ranks: Iterable[int]) -> set[int] | None:
        """Which of ``ranks`` (numbers in the job) came to build ``generation``'s group (each sets
        ``arrival_key`` in its store); None once its store is closed (superseded)."""
        store = self._open.get(generation)
        if store is None:
            return None
        try:
            keys = set(store.list_keys())
        except StoreClosedError:
            return None
        return {rank for rank in ranks if arrival_key(rank) in keys}

    def _announce(self, generation: int, world_size: int, reason: str, *, members: dict[int, int],
                  purpose: str) -> GenerationRecord:
        assert self._control is not None and self._stores is not None, (
            "the job's stores are not served yet")
        store = self._stores.open(generation_store(generation))
        self._open[generation] = store
        record = GenerationRecord(generation=generation, world_size=world_size,
                                  store_host=self.host, store_port=store.port, reason=reason,
                                  members={str(r): m for r, m in members.items()}, purpose=purpose)
        self._control.set(generation_key(generation), record.to_json().decode())
        self._control.set(CURRENT_KEY, str(generation))
        return record

    def _supersede(self, old: int, new: int) -> None:
        """Fence the old generation: mark it and close its store, so waits on it fail at once."""
        assert self._control is not None
        record = GenerationRecord.from_json(self._control.get(generation_key(old)))
        superseded = GenerationRecord(**{**record.__dict__, "status": "superseded",
                                         "superseded_by": new})
        self._control.set(generation_key(old), superseded.to_json().decode())
        store = self._open.pop(old, None)
        if store is not None:
            store.close()

    def close(self) -> None:
        self._open.clear()
        self._control = None
        if self._stores is not None:
            self._stores.close()
