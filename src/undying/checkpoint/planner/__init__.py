"""The one restore planner: for every path that replaces a rank's state, where it comes from and
why.

Five paths replace a rank's state, and each asks this package, then only
carries the plan out (docs/architecture.md, "One restore planner"):

- recovery after a fault (the manager to decide, every worker to carry it out):
  ``plan`` over what every member holds, rank by rank (``holdings``);
- the start of a process, a numerics roll-back, a verification roll-back and a
  regroup: ``plan_start``, ``plan_numerics_rollback``, ``plan_verify_rollback``
  and ``plan_regroup`` (``paths``), one source for every rank.

Pure: no torch, no I/O. A caller reads what exists (the members' holdings, a
checkpoint's manifest, what its rings hold), asks, and loads what the plan names.
tests/unit/test_one_restore_decision.py finds every function that replaces a
rank's state and checks that it asks here, or carries out a plan it was given.
"""

from undying.checkpoint.planner.holdings import (
    UNREAD,
    Member,
    MissingShardsError,
    PersistedState,
    RestorePlan,
    Source,
    plan,
    ring_replica_of,
)
from undying.checkpoint.planner.paths import (
    StatePlan,
    plan_numerics_rollback,
    plan_regroup,
    plan_start,
    plan_verify_rollback,
)

__all__ = [
    "Member",
    "PersistedState",
    "UNREAD",
    "Source",
    "RestorePlan",
    "StatePlan",
    "MissingShardsError",
    "ring_replica_of",
    "plan",
    "plan_start",
    "plan_numerics_rollback",
    "plan_verify_rollback",
    "plan_regroup",
]
