"""One recovery round's record: its incidents, the generation it forms and that generation's phases.

Split from ``rounds.py`` (``Recoveries``, which opens, executes and ends the
rounds) so that what a round is reads apart from what is done with it; a
restarted manager rebuilds one from its log (``manager/restoring.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from undying.jobfiles.records import Incident, IncidentStatus
from undying.manager.recovery.leave_order import LeaveOrder

__all__ = ["Recovery"]


@dataclass
class Recovery:
    """One recovery round: the incidents it handles and the generation it forms."""

    id: int
    generation: int
    incidents: list[Incident] = field(default_factory=list)
    replaced: set[int] = field(default_factory=set)
    ready: dict[int, float] = field(default_factory=dict)
    group_rebuilt: dict[int, float] = field(default_factory=dict)
    state_restored: dict[int, float] = field(default_factory=dict)
    first_step: dict[int, float] = field(default_factory=dict)
    restored_step: int = -1
    started: float = field(default_factory=time.time)
    leave: LeaveOrder | None = None  # the survivors of the generation before, which must leave it

    def name_left_behind(self, rank: int) -> list[Incident]:
        """Name ``rank``, killed for never leaving its generation, in the round's open incidents;
        returns them (to be logged again)."""
        named = [i for i in self.incidents if i.status is IncidentStatus.OPEN]
        for incident in named:
            if rank not in (left := incident.detail.setdefault("left_behind", [])):
                left.append(rank)
        return named

    def renew(self, generation: int) -> None:
        """The round forms ``generation`` now: the phases seen of an earlier one are void."""
        self.generation = generation
        for phase in (self.group_rebuilt, self.state_restored, self.first_step):
            phase.clear()
