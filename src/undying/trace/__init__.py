"""Tracing: cheap markers of steps, collectives, saves, forward passes and data waits.

The worker side of tracing; the record format is in ``docs/tracing.md``.

- ``SwitchFileWatcher``, ``read_switch_file``: the switch set by a JSON file such
  as a ConfigMap mount (the switch's value, ``TraceSwitch``, is the protocol's).
- ``TraceWriter``: per-rank NDJSON files named by time, rotated and capped,
  written from a background thread so training never waits on the disk.
- ``Tracer``: the markers themselves (``emit``, ``span``) and listeners.

The trace files' names and folders (``files``), the per-window step summaries
(``summary``), the online slow-rank detector (``detect``) and the offline
analysis and report (``analyze``, ``report``) are imported from their modules.
"""

from undying.trace.switch import SwitchFileWatcher, read_switch_file
from undying.trace.tracer import (
    CKPT,
    COMM,
    DATA,
    FP,
    KINDS,
    STEP,
    STEP_GROUP,
    Listener,
    Tracer,
)
from undying.trace.writer import TraceWriter

__all__ = [
    "CKPT",
    "COMM",
    "DATA",
    "FP",
    "KINDS",
    "Listener",
    "STEP",
    "STEP_GROUP",
    "SwitchFileWatcher",
    "TraceWriter",
    "Tracer",
    "read_switch_file",
]
