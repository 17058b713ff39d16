"""Tracing: cheap markers of steps, collectives, saves, forward passes and data waits.

The worker side of DESIGN.md §5. The record format is in ``docs/tracing.md``.

- ``TraceSwitch``: which markers are on (``step`` group, ``comm``), and who set it;
  ``SwitchFileWatcher`` follows a JSON file such as a ConfigMap mount.
- ``TraceWriter``: per-rank NDJSON files named by time, rotated and capped,
  written from a background thread so training never waits on the disk.
- ``Tracer``: the markers themselves (``emit``, ``span``) and listeners.

The trace files' names and folders (``writer``), the per-window step summaries
(``summary``), the online slow-rank detector (``detect``) and the offline
analysis and report (``analyze``, ``report``) are imported from their modules.
"""

from undying.trace.switch import (
    SWITCH_EXAMPLE,
    SwitchFileWatcher,
    TraceSwitch,
    TraceSwitchError,
    read_switch_file,
)
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
    "SWITCH_EXAMPLE",
    "SwitchFileWatcher",
    "TraceSwitch",
    "TraceSwitchError",
    "TraceWriter",
    "Tracer",
    "read_switch_file",
]
