"""The markers: timed records of steps, collectives, checkpoint saves, forward passes, data waits.

A ``Tracer`` belongs to one rank. Call sites guard on a plain attribute, so
that tracing off costs one attribute read and nothing else::

    if tracer.step_on:
        tracer.emit("data", start, dur)

    with tracer.span("fp"):          # off: returns a shared no-op object
        out = model(inputs)

Records go to the ``TraceWriter`` (files) and to listeners (online
summaries). The record format is documented in ``docs/tracing.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from undying.protocol.trace_switch import TraceSwitch
from undying.trace.writer import TraceWriter

__all__ = [
    "RECORD_VERSION",
    "STEP",
    "COMM",
    "CKPT",
    "FP",
    "DATA",
    "KINDS",
    "STEP_GROUP",
    "Listener",
    "Tracer",
]

log = logging.getLogger("undying.trace")

RECORD_VERSION = 1

STEP = "step"  # the whole step, from the batch fetch to the commit
COMM = "comm"  # one collective, from launch to completion
CKPT = "ckpt"  # a checkpoint save: the training-loop stall ("block") or the write ("write")
FP = "fp"  # the forward pass
DATA = "data"  # the wait for the next batch

KINDS = (STEP, COMM, CKPT, FP, DATA)
# The kinds the "step" flag of the switch turns on and off together.
STEP_GROUP = (STEP, CKPT, FP, DATA)
_KIND_SET = frozenset(KINDS)

Listener = Callable[[dict[str, Any]], None]


class _NoSpan:
    """What ``span`` returns when its kind is off: one shared object, nothing measured."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def set(self, **fields: Any) -> None:
        """Ignored: nothing is recorded."""


_NO_SPAN = _NoSpan()


class _Span:
    """A live span: wall time and perf_counter at entry, one record at exit."""

    __slots__ = ("_tracer", "_kind", "_fields", "_t", "_t0")

    def __init__(self, tracer: Tracer, kind: str, fields: dict[str, Any]) -> None:
        self._tracer = tracer
        self._kind = kind
        self._fields = fields
        self._t = 0.0
        self._t0 = 0.0

    def __enter__(self) -> _Span:
        self._t = time.time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        dur = time.perf_counter() - self._t0
        if exc_type is not None:
            # A step that raised still took its time; say why it ended.
            self._fields["error"] = exc_type.__name__
        self._tracer.emit(self._kind, self._t, dur, **self._fields)

    def set(self, **fields: Any) -> None:
        """Add fields known only inside the span (e.g. ``bytes``); they go into its record."""
        self._fields.update(fields)


class Tracer:
    """One rank's markers: the on/off flags, the record builder, and where records go.

    ``step_on`` and ``comm_on`` are plain attributes so that a call site pays
    one attribute read when tracing is off. ``generation`` and ``step`` are set
    by the worker as the job goes and stamped on every record.
    """

    def __init__(self, writer: TraceWriter | None, *, job_id: str, rank: int, node: str) -> None:
        self.writer = writer
        self.job_id = job_id
        self.rank = rank
        self.node = node
        self.step_on = False
        self.comm_on = False
        self.generation = 0
        self.step = 0
        # Copy-on-write: emit iterates whatever tuple it reads, with no lock.
        self._listeners: tuple[Listener, ...] = ()
        self._failed_listeners: set[int] = set()

    def apply(self, switch: TraceSwitch) -> None:
        """Turn markers on or off as the switch says (comm only with step, as the switch
        ensures)."""
        self.step_on = switch.step
        self.comm_on = switch.comm and switch.step

    def enabled(self, kind: str) -> bool:
        """Whether markers of ``kind`` are on now."""
        return self.comm_on if kind == COMM else self.step_on

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(record)`` for every record, on the emitting thread; it must be cheap."""
        self._listeners = (*self._listeners, fn)

    def remove_listener(self, fn: Listener) -> None:
        """Stop calling ``fn``; unknown listeners are ignored.

        Compared with ``==`` so that ``remove_listener(obj.method)`` removes
        ``add_listener(obj.method)`` (each attribute read makes a new bound method).
        """
        kept = tuple(f for f in self._listeners if f != fn)
        for f in self._listeners:
            if f == fn:
                self._failed_listeners.discard(id(f))
        self._listeners = kept

    def emit(self, kind: str, start: float, dur: float, **fields: Any) -> None:
        """Record one marker: ``start`` wall time (time.time()), ``dur`` seconds (perf_counter).

        Does not check the switch (the caller did, to skip measuring at all).
        ``fields`` are kind-specific (``op``, ``bytes``, ``part``, ``name``...);
        ``gen`` and ``step`` may be passed to override the tracer's current
        ones, e.g. by a collective that completes on another thread after the
        step moved on. Safe from any thread; never raises into the caller.
        """
        record: dict[str, Any] = {
            "v": RECORD_VERSION,
            "kind": kind,
            "job": self.job_id,
            "rank": self.rank,
            "node": self.node,
            "gen": self.generation,
            "step": self.step,
            "t": round(start, 6),
            "dur": round(dur, 7),
        }
        if fields:
            record.update(fields)
        if self.writer is not None:
            self.writer.write(record)
        for fn in self._listeners:
            try:
                fn(record)
            except Exception:
                if id(fn) not in self._failed_listeners:
                    self._failed_listeners.add(id(fn))
                    log.exception("trace listener %r failed; its later failures are not logged", fn)

    def span(self, kind: str, **fields: Any) -> _Span | _NoSpan:
        """A context manager that records ``kind`` around its body, or a shared no-op when off.

        ``with tracer.span("fp"):`` measures the forward pass; user code adds
        ``name="..."`` to tell its spans apart. The object has ``set(**fields)``
        for values known only inside the body. A body that raises is still
        recorded, with ``error`` set to the exception's type name.
        """
        if kind not in _KIND_SET:
            raise ValueError(f"unknown trace marker kind {kind!r}: use one of {', '.join(KINDS)}")
        if not (self.comm_on if kind == COMM else self.step_on):
            return _NO_SPAN
        return _Span(self, kind, fields)
