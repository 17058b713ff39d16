"""Tracing: cheap markers of steps, collectives, saves, forward passes and data waits.

The worker side of DESIGN.md §5. The record format is in ``docs/tracing.md``.

- ``TraceSwitch``: which markers are on (``step`` group, ``comm``), and who set it;
  ``SwitchFileWatcher`` follows a JSON file such as a ConfigMap mount.
- ``TraceWriter``: per-rank NDJSON files named by time, rotated and capped,
  written from a background thread so training never waits on the disk.
- ``Tracer``: the markers themselves (``emit``, ``span``) and listeners.
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
    RECORD_VERSION,
    STEP,
    STEP_GROUP,
    Listener,
    Tracer,
)
from undying.trace.writer import (
    TRACE_FILE_PATTERN,
    TRACE_FILE_SUFFIX,
    TRACE_FILE_TIME_FORMAT,
    TRACES_DIRNAME,
    TraceWriter,
    default_job_label,
    default_trace_dir,
    is_trace_file,
    trace_file_name,
    trace_file_time,
)

__all__ = [
    "CKPT",
    "COMM",
    "DATA",
    "FP",
    "KINDS",
    "Listener",
    "RECORD_VERSION",
    "STEP",
    "STEP_GROUP",
    "SWITCH_EXAMPLE",
    "SwitchFileWatcher",
    "TRACES_DIRNAME",
    "TRACE_FILE_PATTERN",
    "TRACE_FILE_SUFFIX",
    "TRACE_FILE_TIME_FORMAT",
    "TraceSwitch",
    "TraceSwitchError",
    "TraceWriter",
    "Tracer",
    "default_job_label",
    "default_trace_dir",
    "is_trace_file",
    "read_switch_file",
    "trace_file_name",
    "trace_file_time",
]
