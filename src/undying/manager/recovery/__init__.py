"""From a fault to an incident, and from an incident to the job training again.

``detection`` (an exit, a silence, a stall or a failed collective becomes an incident); ``leaving``
(a rank that exits 0 early); ``policy`` (the recovery ladder, a pure function: incident and history
to an action); ``rounds`` (``Recoveries``: the executor of that action and the round's timeline);
``round_record`` (``Recovery``: one round's incidents, generation and phases); ``starts`` (what a
rank's process raised, from torchrun's error file, and a whole-group restart's previous attempt);
``reported`` (the faults a worker reports itself); ``watch`` (the manager's deadlines, each pass).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.recovery.detection import Detection, describe_exit
    from undying.manager.recovery.leave_order import LeaveOrder
    from undying.manager.recovery.left_behind import LeftBehind, keep_stuck
    from undying.manager.recovery.policy import Action, Decision, PolicyContext, decide
    from undying.manager.recovery.reported import ReportedFaults
    from undying.manager.recovery.round_record import Recovery
    from undying.manager.recovery.rounds import Recoveries
    from undying.manager.recovery.watch import Watch

__all__ = [
    "Action",
    "Decision",
    "PolicyContext",
    "decide",
    "Detection",
    "LeaveOrder",
    "LeftBehind",
    "describe_exit",
    "keep_stuck",
    "Recoveries",
    "Recovery",
    "ReportedFaults",
    "Watch",
]

_WHERE = {
    "Action": "policy",
    "Decision": "policy",
    "PolicyContext": "policy",
    "decide": "policy",
    "Detection": "detection",
    "LeaveOrder": "leave_order",
    "LeftBehind": "left_behind",
    "describe_exit": "detection",
    "keep_stuck": "left_behind",
    "Recoveries": "rounds",
    "Recovery": "round_record",
    "ReportedFaults": "reported",
    "Watch": "watch",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
