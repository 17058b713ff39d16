"""A planned move while it waits: its record (``PendingMove``) and the step boundary it waits for.

Split from ``migration.py`` (which arms, cancels and completes the moves) so
that the move's own facts, and the arithmetic of when it happens, read
alone: the boundary is far enough ahead for every rank to hear the arming and
for the replacement, started at once, to be ready; and it comes before the
job's last steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from undying.errors import UsageError
from undying.jobfiles.records import RankState
from undying.manager.core import JobCore

__all__ = ["PendingMove", "boundary_step", "LEAD_STEPS"]

# How many steps past the newest committed one the boundary is set, at least: every rank hears the
# arming before it begins the boundary's next step (a late one leaves at the step after: still a
# boundary).
LEAD_STEPS = 2
# And time enough for the replacement, started at once, to be ready (a warm spare runs the script to
# its join; a new process imports torch first): measured on a loaded 2-core machine, with room.
READY_S = {True: 2.0, False: 10.0}
MAX_LEAD_STEPS = 10_000


@dataclass
class PendingMove:
    rank: int
    pid: int
    boundary: int  # the last step the rank commits before it leaves
    host: str
    to: str
    by: str
    t: float  # when it was armed: the incident's "planned" time
    node: int | None = None  # a whole node's move (to a standby on ``to``): every rank of it leaves
    generation: int = -1  # a rank's move: the generation its replacement, started ahead, waits for
    warm: bool = False  # that replacement is a warm spare (else a new process)
    ready_t: float = 0.0  # when it said hello (0: not yet)
    # A rank's move: the rank as its old process held it (incarnation, state, generation, restarts),
    # given back if the move is cancelled.
    holder: tuple[int, RankState, int, int] | None = None


def boundary_step(core: JobCore, newest: int, *, warm: bool) -> int:
    """The last step before a move: the replacement's start time ahead (LEAD_STEPS at least),
    and before the job's last steps (its plan says how many it has): else refused."""
    step_s = core.clock.median_rank_step_s()
    lead = LEAD_STEPS
    if step_s > 0:
        ready_steps = math.ceil(READY_S[warm] / step_s)
        lead = max(LEAD_STEPS, min(MAX_LEAD_STEPS, ready_steps))
    plan = core.clock.plan
    if plan is not None:
        # (the replacement's start may then be in the stall)
        lead = min(lead, plan.total_steps - 2 - newest)
        if lead < LEAD_STEPS:
            raise UsageError(f"the job ends at step {plan.total_steps}, too soon for a step "
                             f"boundary {LEAD_STEPS} steps ahead of step {newest}; nothing to move")
    return newest + lead
