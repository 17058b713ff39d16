"""How the job's steps go: how long they take, how far the job is, and its goodput.

``clock`` (``StepClock``: a rank's and the job's step times, from the commits); ``progress`` (pure:
step of total, epoch, rate, ETA, the last ``step.log`` values); ``goodput`` (pure: productive time
over wall time, with the losses named); ``reports`` (``StepReports``: the workers' commits, progress,
saves and last steps, each to the parts it concerns). The command line reads a finished job's log
with the same functions.

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.manager.steps.clock import PLAN_EVENT, StepClock
    from undying.manager.steps.goodput import Goodput, Stall, StepLedger, account
    from undying.manager.steps.progress import JobSteps, Plan, Progress, compute, mean_values
    from undying.manager.steps.reports import CommitRow, StepReports

__all__ = [
    "PLAN_EVENT",
    "StepClock",
    "JobSteps",
    "Plan",
    "Progress",
    "compute",
    "mean_values",
    "Goodput",
    "Stall",
    "StepLedger",
    "account",
    "StepReports",
    "CommitRow",
]

_WHERE = {
    "PLAN_EVENT": "clock",
    "StepClock": "clock",
    "JobSteps": "progress",
    "Plan": "progress",
    "Progress": "progress",
    "compute": "progress",
    "mean_values": "progress",
    "Goodput": "goodput",
    "Stall": "goodput",
    "StepLedger": "goodput",
    "account": "goodput",
    "StepReports": "reports",
    "CommitRow": "reports",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
