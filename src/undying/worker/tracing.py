"""The worker's side of tracing: markers at the step loop's seams, online summaries, injected
slowdowns.

The step loop, the DDP wrapper and the checkpoint path call in here at fixed
points. With the switch off each call is one attribute test, so a job that
never traces pays nothing it could measure (bench/trace.py). With it on, the
records go to a ``TraceWriter`` (files, off the training thread) and to a
``StepSummarizer`` whose compact windows travel to the manager for online
slow-rank detection. An injected slowdown (``undying inject slow``) lives here
too, because it has to land in exactly the phase the markers measure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from undying.protocol.codec import Message
from undying.protocol.env import NODE_NAME_ENV
from undying.protocol.trace_switch import TraceSwitch
from undying.protocol.worker_wire import ArmFault, FaultInjected, TraceSet, TraceSummary
from undying.trace.summary import StepSummarizer
from undying.trace.tracer import Tracer
from undying.trace.writer import TraceWriter

if TYPE_CHECKING:
    from undying.worker.env import WorkerEnv

__all__ = ["WorkerTracing", "CommHookState", "traced_allreduce_hook"]

log = logging.getLogger("undying.worker")

T = TypeVar("T")

# A slowdown armed before the rank has this many steps of history uses the fallback below.
_HISTORY_FOR_SLOWDOWN = 3
_FALLBACK_STEP_S = 0.05


class WorkerTracing:
    """Markers, summaries and slowdowns of one worker process."""

    def __init__(self, env: WorkerEnv | None, rank: int, send: Callable[[Message], None]) -> None:
        self._env = env
        self._send = send
        job_id = env.job_id if env is not None else "unmanaged"
        node = os.environ.get(NODE_NAME_ENV) or socket.gethostname()
        self.tracer = Tracer(None, job_id=job_id, rank=rank, node=node)
        self._writer: TraceWriter | None = None
        self._writer_lock = threading.Lock()
        self._summarizer = StepSummarizer()
        self.tracer.add_listener(self._summarizer.observe)
        self._rank = rank
        self._generation = 0
        self._step_t0 = 0.0  # perf_counter at the start of the step in flight
        self._step_wall = 0.0
        self._recent: deque[float] = deque(maxlen=20)  # the rank's own recent step durations
        # An injected slowdown: (phase, extra seconds per step, from step).
        self._slow: tuple[str, float, int] | None = None
        self._slow_pending: ArmFault | None = None
        # Read at every seam of every step: when False (no markers, no slowdown) a seam costs this
        # one test.
        self.active = False
        # The comm hook's plan: (from step, hooked before it, hooked from it on).
        self._hook_plan: tuple[int, bool, bool] = (0, False, False)

    # --- the switch -----------------------------------------------------------

    def apply(self, message: TraceSet) -> None:
        """From the agent's channel thread: the markers go on or off at the next seam."""
        if message.step and self._writer is None and self._env is not None:
            self._open_writer()
        self.tracer.apply(TraceSwitch(step=message.step, comm=message.comm, by=message.by,
                                      t=message.t))
        before = self.comm_hook_at(message.comm_from_step - 1)
        self._hook_plan = (message.comm_from_step, before, message.comm and message.step)
        self.active = self.tracer.step_on or self._slow is not None
        log.info("rank %d: tracing %s (comm %s), by %s", self._rank,
                 "on" if message.step else "off", "on" if message.comm else "off", message.by)

    def comm_hook_at(self, step: int) -> bool:
        """Whether the DDP running ``step`` carries the comm-marker hook (the same answer on every
        rank)."""
        from_step, before, after = self._hook_plan
        return after if step >= from_step else before

    def _open_writer(self) -> None:
        assert self._env is not None
        with self._writer_lock:
            if self._writer is not None:
                return
            cfg = self._env.trace
            try:
                self._writer = TraceWriter(
                    Path(cfg.resolved_dir(".")), self._env.job_id, self._rank,
                    max_file_bytes=int(cfg.trace_max_file_mb * 1e6),
                    max_dir_bytes=int(cfg.trace_max_dir_mb * 1e6),
                )
            except OSError as e:
                log.warning("rank %d: cannot write traces under %s (%s); summaries only",
                            self._rank, cfg.trace_dir, e)
                return
            self.tracer.writer = self._writer

    def close(self) -> None:
        """At the end of the steps: the last (partial) window's summary, then the files."""
        if self.tracer.step_on:
            summary = self._summarizer.flush()
            if summary is not None:
                self._send(TraceSummary(self._rank, self._generation, summary))
        if self._writer is not None:
            self._writer.close()

    # --- the step loop's seams ---------------------------------------------------

    def step_started(self, index: int, generation: int) -> None:
        self._generation = generation
        self.tracer.step = index
        self.tracer.generation = generation
        self._step_t0 = time.perf_counter()
        self._step_wall = time.time()
        if self._slow_pending is not None and index >= self._slow_pending.at_step:
            self._start_slowdown(index)

    def batch(self, fetch: Callable[[int], T], index: int) -> T:
        """The wait for batch ``index`` (the ``data`` marker); a data slowdown sleeps here."""
        if not self.active:
            return fetch(index)
        start, wall = time.perf_counter(), time.time()
        batch = fetch(index)
        self._maybe_sleep("data")
        if self.tracer.step_on:
            self.tracer.emit("data", wall, time.perf_counter() - start)
        return batch

    def forward_done(self) -> None:
        """After the forward pass: a compute slowdown sleeps here."""
        if self._slow is not None:
            self._maybe_sleep("compute")

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if not self.tracer.step_on:
            yield
            self.forward_done()
            return
        start, wall = time.perf_counter(), time.time()
        yield
        self.forward_done()
        self.tracer.emit("fp", wall, time.perf_counter() - start)

    @contextlib.contextmanager
    def checkpoint_stall(self) -> Iterator[None]:
        """The training loop's part of a save (every rank, whether or not it writes)."""
        if not self.active:
            yield
            return
        start, wall = time.perf_counter(), time.time()
        yield
        self._maybe_sleep("ckpt")
        if self.tracer.step_on:
            self.tracer.emit("ckpt", wall, time.perf_counter() - start, part="block")

    def checkpoint_written(self, step: int, write_s: float, nbytes: int) -> None:
        """From the writer thread: the background part of a save."""
        if self.tracer.step_on:
            self.tracer.emit("ckpt", time.time() - write_s, write_s, part="write", bytes=nbytes,
                             save_step=step)

    def slowest_recent_step(self) -> float:
        """The longest of this rank's recent steps, in seconds (0.0 before the first)."""
        return max(self._recent, default=0.0)

    def committed(self, index: int) -> None:
        duration = time.perf_counter() - self._step_t0
        self._recent.append(duration)
        if not self.tracer.step_on:
            return
        self.tracer.emit("step", self._step_wall, duration)
        summary = self._summarizer.take()
        if summary is not None:
            self._send(TraceSummary(self._rank, self._generation, summary))

    # --- injected slowdowns ---------------------------------------------------------

    def arm_slowdown(self, fault: ArmFault) -> None:
        """``undying inject slow``: from ``fault.at_step`` on, steps take ``factor`` times as
        long."""
        self._slow_pending = fault

    def _start_slowdown(self, index: int) -> None:
        fault = self._slow_pending
        assert fault is not None
        self._slow_pending = None
        base = (statistics.median(self._recent) if len(self._recent) >= _HISTORY_FOR_SLOWDOWN
                else _FALLBACK_STEP_S)
        extra = max(0.0, fault.factor - 1.0) * base
        self._slow = (fault.phase, extra, index) if extra > 0 else None
        self.active = self.tracer.step_on or self._slow is not None
        log.warning("rank %d: slowed from step %d: +%.1f ms in %s (x%.2f of a %.1f ms step)",
                    self._rank, index, extra * 1e3, fault.phase, fault.factor, base * 1e3)
        self._send(FaultInjected(self._rank, "slow", index, fault.phase, time.time()))

    def _maybe_sleep(self, phase: str) -> None:
        slow = self._slow
        if slow is not None and slow[0] == phase:
            time.sleep(slow[1])


@dataclass(frozen=True)
class CommHookState:
    """What DDP hands the hook back: the tracing to report to and the DDP's own group."""

    tracing: WorkerTracing
    group: dist.ProcessGroup
    world_size: int


def traced_allreduce_hook(state: CommHookState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's gradient all-reduce, as DDP does it itself, plus a ``comm`` marker when those are on.

    The bucket is scaled by 1/world size element by element before the sum, as
    DDP's built-in path does, so registering the hook changes no bit of the
    result. It is registered only while comm markers are wanted: with them off
    a DDP runs its built-in all-reduce and tracing costs nothing there.
    """
    buffer = bucket.buffer()
    buffer.mul_(1.0 / state.world_size)
    tracer = state.tracing.tracer
    if not tracer.comm_on:
        return dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(_first)
    start, wall = time.perf_counter(), time.time()
    nbytes = buffer.numel() * buffer.element_size()
    index, step, generation = bucket.index(), tracer.step, tracer.generation

    def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        # On gloo's thread, perhaps after the step moved on: the step it belongs to is the one it
        # started in.
        tracer.emit("comm", wall, time.perf_counter() - start, op="allreduce", bytes=nbytes,
                    bucket=index, step=step, gen=generation)
        return fut.value()[0]

    return dist.all_reduce(buffer, group=state.group, async_op=True).get_future().then(done)


# DDP checks a hook's annotations as objects; this module's are strings (postponed evaluation).
traced_allreduce_hook.__annotations__ = {
    "state": CommHookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


def _first(fut: torch.futures.Future[Any]) -> torch.Tensor:
    return fut.value()[0]
