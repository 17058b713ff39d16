"""How the job's steps go: how long they take, from the ranks' commits.

``clock`` (``StepClock``: a rank's and the job's step times, from the commits, and what progress and
goodput are computed from); ``reports`` (``StepReports``: the workers' commits, progress, saves and
last steps, each to the parts it concerns). The computations over the steps are pure and read a
finished job's log as well: ``jobfiles.progress`` (step of total, epoch, rate, ETA, the last
``step.log`` values) and ``jobfiles.goodput`` (productive time over wall time, with the losses
named), so the command line uses them without the manager.

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.steps.clock import StepClock
    from undying.manager.steps.reports import CommitRow, StepReports

__all__ = ["StepClock", "StepReports", "CommitRow"]

_WHERE = {"StepClock": "clock", "StepReports": "reports", "CommitRow": "reports"}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
