"""What the job's parts share: who this rank is, where it stands, how it talks to its agent.

``Job`` holds one ``JobContext`` and hands it to the parts that run beside
its step loop -- recovery (``worker.rejoin``), the savers
(``worker.checkpoints``, ``worker.gasp``, ``worker.shards``) and the DDP
wrapper -- so none of them reads another module's private fields: what a part
may read or change is a public field here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from undying.protocol.codec import Message
from undying.protocol.worker_wire import Fatal, Progress
from undying.worker.data import DataCursor, map_position
from undying.worker.faults import FaultSwitch
from undying.worker.tracing import WorkerTracing

if TYPE_CHECKING:
    from undying.checkpoint.manifest import Manifest
    from undying.worker.env import WorkerEnv
    from undying.worker.state import State

__all__ = ["JobContext", "SaveClock"]

log = logging.getLogger("undying.worker")


@dataclass
class SaveClock:
    """When a periodic checkpoint is due: every ``save_every`` steps, or ``save_interval``
    seconds after the last."""

    save_every: int = 0
    save_interval: float = 0.0
    last: float = field(default_factory=time.monotonic)

    def due(self, index: int) -> bool:
        return (self.save_every > 0 and index % self.save_every == 0) or (
            self.save_interval > 0 and time.monotonic() - self.last >= self.save_interval
        )

    def mark(self) -> None:
        self.last = time.monotonic()


@dataclass
class JobContext:
    """One process's standing in the job; ``env`` is None outside ``undying run`` (no fault
    tolerance)."""

    env: WorkerEnv | None
    rank: int
    world_size: int
    local_rank: int
    generation: int
    send: Callable[[Message], None]
    faults: FaultSwitch
    tracing: WorkerTracing
    close_channel: Callable[[], None] = lambda: None
    clock: SaveClock = field(default_factory=SaveClock)
    current_step: int = 0
    # The step the loop is in (set at its start, before a planned leave is looked for): which
    # survivors of a lost peer leave at once (worker_wire.Abort.from_step).
    step_in_flight: int = 0
    # What the heartbeats report: init until this process completes a step, and the collectives
    # entered since the group's state was restored (the transfer's sends count on their two ends
    # only).
    phase: str = "init"
    collectives_base: int = 0
    # Why the last step or recovery round failed (a collective's error), for the logs and
    # CommFailure.
    abort_reason: str = ""
    # Where the data stands: (step, batches read per rank after it); see DataCursor.origin.
    data_origin: tuple[int, int] | None = None
    cursor: DataCursor | None = None
    # A load that needs the State (a sharded checkpoint, a shard received before the model existed).
    deferred: tuple[int, Callable[[State], None]] | None = None
    # A whole (replicated) state read or received before the State existed: (step, state dict).
    stash: tuple[int, dict[str, Any]] | None = None
    # A leave at the next step's start: (generation, reason, planned), taken by the step loop;
    # planned: worker_wire.Abort.at_step_start, else a lost peer's (Abort.from_step). None when
    # none is asked.
    planned_leave: tuple[int, str, bool] | None = None

    @property
    def managed(self) -> bool:
        return self.env is not None

    @property
    def waiting_step(self) -> int:
        """The step of a state that waits for the script's State (a replacement's, a resumed
        launch's); 0 when this process starts fresh."""
        waiting = self.stash or self.deferred
        return waiting[0] if waiting is not None else 0

    def aborted(self, exc: BaseException) -> None:
        """A collective failed: remembered as the reason for the recovery that follows."""
        self.abort_reason = f"{type(exc).__name__}: {exc}"

    def report_fatal(self, index: int, exc: BaseException) -> None:
        """Tell the manager this process fails for a reason no replacement would fix (the user's
        error)."""
        if self.managed:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.send(Fatal(self.rank, index, f"{type(exc).__name__}: {exc}", text, time.time()))

    def set_data_origin(self, origin: tuple[int, int]) -> None:
        self.data_origin = origin
        if self.cursor is not None:
            self.cursor.set_origin(origin)

    def data_meta(self, step: int) -> dict[str, Any]:
        """What a checkpoint records of the data position, so a resume on another world size maps
        it."""
        cursor = self.cursor
        if cursor is None:
            return {}
        return {"data": {"position": cursor.position(step),
                         "steps_per_epoch": cursor.steps_per_epoch,
                         "world_size": self.world_size}}

    def checkpoint_loaded(self, manifest: Manifest, detail: dict[str, Any]) -> None:
        """A checkpoint is loaded: place the data where it left it (mapped when the world size
        changed)."""
        data = manifest.meta.get("data") or {}
        position = int(data.get("position", manifest.step))
        saved_spe = data.get("steps_per_epoch")
        spe = self.cursor.steps_per_epoch if self.cursor is not None else None
        if saved_spe and spe and int(saved_spe) != spe:
            mapped = map_position(position, int(saved_spe), spe)
            detail["data_position"] = {"saved": position, "saved_steps_per_epoch": int(saved_spe),
                                       "now": mapped, "steps_per_epoch": spe}
            if self.rank == 0:
                log.warning("resumed on %d ranks from a checkpoint of %d: "
                            "the data position of %d batches of %d "
                            "per epoch is %d of %d here", self.world_size, manifest.world_size,
                            position, int(saved_spe), mapped, spe)
            position = mapped
        self.set_data_origin((manifest.step, position))
        self.send(Progress(self.rank, self.generation, "state_restored", time.time(),
                           step=manifest.step, detail=detail))

    def exit_now(self, code: int) -> None:
        """Out at once: the state is safe, and an orderly interpreter teardown (process groups,
        loader workers) can take seconds of a grace period that Kubernetes ends with SIGKILL."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            self.close_channel()
        os._exit(code)
