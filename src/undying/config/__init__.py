"""The job's configuration: one dataclass, one environment prefix (``UNDYING_``).

One name per value, by rule: the option ``--a-b`` of ``undying run`` is the field ``a_b`` of
``JobConfig`` or of exactly one of its sections (``timeouts``, ``checkpoint``, ``trace``,
``connections``, ``launch``): ``--exit-grace`` is ``timeouts.exit_grace``, ``--trace-dir`` is
``trace.trace_dir``. Its default is written once, on the field: the option's default is the
field's (``cli/settings.py``), and its help shows it with argparse's ``%(default)``. The
options of ``undying manager`` are ``ManagerOptions``' fields by the same rule.
``tests/unit/test_one_name.py`` checks all of it on the syntax tree.

Every timeout is positive and bounded; defaults suit a real cluster, tests pass
short ones. Workers receive the timeouts they read through their environment
(``JobConfig.timeout_env``), so that a replacement process sees exactly what
the first one saw; no other is sent.

The modules, one concern each: ``job`` (``JobConfig``, ``LaunchConfig``), ``timeouts``,
``sections`` (the checkpoint's and the trace's), ``manager`` (``undying manager``'s options,
the sockets' limits), ``console`` (which log lines reach the terminal) and ``exits`` (a
worker's exit codes and the files it leaves in the job dir). This package is the surface the
roles, the CLI and users import from: ``__all__`` (at most 15 names) lists the settings, and the
other constants imported from here (the rest of the exit codes and the worker's files, the auto
step timeout's bounds, the console's log setup) are re-exported by name (``from ... import X as
X``).
"""

from __future__ import annotations

from undying.config.console import SHOWN_LOG as SHOWN_LOG
from undying.config.console import fit_terminal as fit_terminal
from undying.config.console import show_launcher_log as show_launcher_log
from undying.config.console import show_rank_log as show_rank_log
from undying.config.console import wrap as wrap
from undying.config.exits import ERROR_FILE as ERROR_FILE
from undying.config.exits import EXIT_FENCED as EXIT_FENCED
from undying.config.exits import EXIT_MIGRATED as EXIT_MIGRATED
from undying.config.exits import EXIT_PREEMPTED, EXIT_PREEMPTED_BEHIND, worker_dir
from undying.config.exits import EXIT_REGROUPED as EXIT_REGROUPED
from undying.config.exits import EXIT_SCRIPT_ERROR as EXIT_SCRIPT_ERROR
from undying.config.exits import HANGUP_LOG as HANGUP_LOG
from undying.config.exits import RETURNED_FILE as RETURNED_FILE
from undying.config.exits import SCRIPT_ERROR_FILE as SCRIPT_ERROR_FILE
from undying.config.job import TRACKER_NAMES as TRACKER_NAMES
from undying.config.job import WHOLE_GROUP_LINE as WHOLE_GROUP_LINE
from undying.config.job import JobConfig, LaunchConfig
from undying.config.manager import DEFAULT_MANAGER_PORT, ConnectionLimits, ManagerOptions
from undying.config.manager import PROGRESS_EVERY_S as PROGRESS_EVERY_S
from undying.config.manager import check_progress_every as check_progress_every
from undying.config.sections import TRACE_INITIAL as TRACE_INITIAL
from undying.config.sections import (
    CheckpointConfig,
    TraceConfig,
    checkpoint_from_env,
    trace_from_env,
)
from undying.config.timeouts import AUTO_STEP_TIMEOUT_FACTOR as AUTO_STEP_TIMEOUT_FACTOR
from undying.config.timeouts import AUTO_STEP_TIMEOUT_FLOOR_S as AUTO_STEP_TIMEOUT_FLOOR_S
from undying.config.timeouts import Timeouts, flag, timeouts_from_env
from undying.config.timeouts import planned_leave_grace as planned_leave_grace

__all__ = [
    "JobConfig",
    "CheckpointConfig",
    "Timeouts",
    "TraceConfig",
    "ConnectionLimits",
    "ManagerOptions",
    "LaunchConfig",
    "flag",
    "timeouts_from_env",
    "checkpoint_from_env",
    "trace_from_env",
    "DEFAULT_MANAGER_PORT",
    "EXIT_PREEMPTED",
    "EXIT_PREEMPTED_BEHIND",
    "worker_dir",
]
