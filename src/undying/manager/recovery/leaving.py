"""A rank that leaves early: an exit 0 before the rank finished its steps, while the others go on.

A script that uses the step API ends a rank's part of the job at the job's
last step: every rank passes the final barrier and says ``Done``. A rank whose
process exits 0 before that (``sys.exit(0)`` inside a step, or its loop ended
early and its script returned) did not finish: if another rank goes on past
the step the leaver had committed, the leaver left early. That is an incident
(``left-early``), recovered like a crash (a new process, the state from a
peer, the step in flight run again); a rank that leaves early again after it
was replaced for it fails the job with the reason (``policy.decide``): its
script ends its loop before the others, and no replacement changes that.

What shows that the others go on, once a rank left without its ``Done``:

- another rank commits a step past the one after the leaver's last commit;
- a collective fails on another rank (it waited for the leaver in a step);
- the others stall in a step (a collective the leaver never joins);
- a recovery is under way (the others rejoin without it).

Until one of these, the exit is held, not judged: when every rank ends its
loop at the same step (a script that stops early on every rank) no rank went
on, and the job ends as torchrun would end it, every rank having exited 0.
A ``Done`` that arrives after its process's exit (the two travel apart) makes
the rank finished. Scripts without the step API keep torchrun's rule: an exit
0 is a rank that finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from undying.jobfiles.records import IncidentKind, RankInfo
from undying.manager.core import JobCore
from undying.manager.recovery.rounds import Recoveries

__all__ = ["Leavers", "Left"]


@dataclass(frozen=True)
class Left:
    """A rank whose process exited 0 before its last step, its verdict pending."""

    rank: int
    pid: int
    step: int  # the last step it committed
    t: float  # when its process exited
    node: int


class Leavers:
    """The ranks that left without their ``Done``, until the others show whether they went on."""

    def __init__(self, core: JobCore, recoveries: Recoveries,
                 injected: dict[int, tuple[float, str]]) -> None:
        self.core = core
        self.recoveries = recoveries
        self._injected = injected  # rank -> (when, kind) of a fault injected into it (detection's)
        self.pending: dict[int, Left] = {}  # rank -> its early exit, not judged yet

    def on_clean_exit(self, info: RankInfo, pid: int, t: float) -> bool:
        """A rank that did not say ``Done`` exited 0. True when that is not (yet) its part of the
        job done.

        Only for a script that uses the step API, and while no rank passed the
        final barrier (then every rank passed it). The caller finishes the
        ranks ``all_left`` names after it.
        """
        if not self.recoveries.step_api or self.core.book.any_done():
            return False
        left = Left(info.rank, pid, info.step, t, info.node)
        self.pending[info.rank] = left
        self.core.events.event("left_early", generation=self.core.generations.current,
                               rank=info.rank, pid=pid, step=info.step, verdict="pending")
        if self.recoveries.current is not None:  # the others rejoin without it: they go on
            self.incident(left, "while the others were recovering")
        return True

    def on_commit(self, rank: int, step: int) -> None:
        """Another rank committed ``step``: any rank that left two steps before it left early.

        (Two: a leaver's own last commit may be read after its exit, the two
        travel apart; a step after that needs the leaver's collectives anyway.)
        """
        for left in [p for p in self.pending.values() if p.rank != rank and step > p.step + 1]:
            self.incident(left, f"while rank {rank} committed step {step}")

    def explains(self, rank: int, step: int, what: str) -> bool:
        """A failed collective or a stall of ``rank`` in ``step``: when a rank left before it, that
        is the fault."""
        early = [p for p in self.pending.values() if p.rank != rank and step > p.step]
        for left in early:
            self.incident(left, f"while rank {rank} went on to step {step} ({what})")
        return bool(early)

    def on_done(self, rank: int) -> bool:
        """A rank's ``Done``: True when it came after its process's exit (it passed the final
        barrier after all)."""
        if self.pending.pop(rank, None) is None:
            return False
        self.core.events.event("left_early", rank=rank,
                               verdict="finished: its Done came after its exit")
        return True

    def all_left(self) -> list[RankInfo]:
        """The held ranks, once every rank is finished or held: none went on, they ended their loops
        together.

        (The job then ends as torchrun's would: every rank exited 0.)
        """
        ranks = self.core.ranks
        for left in list(self.pending.values()):
            # (the rank was given a new process since: its old exit is moot)
            if ranks[left.rank].pid != left.pid:
                del self.pending[left.rank]
        if not self.pending or any(r.rank not in self.pending
                                   and r.rank not in self.core.book.finished
                                   for r in ranks.values()):
            return []
        done = [ranks[rank] for rank in sorted(self.pending)]
        for info in done:
            left = self.pending.pop(info.rank)
            self.core.events.event("left_early", rank=info.rank,
                                   verdict=f"every rank ended its loop: it at step {left.step}, "
                                           "none went on past it")
        return done

    def incident(self, left: Left, evidence: str) -> None:
        """The rank left early: an incident, recovered like a crash (or failed by the policy)."""
        del self.pending[left.rank]
        core = self.core
        info = core.ranks[left.rank]
        if info.pid != left.pid:
            return  # (already replaced)
        error = (f"rank {left.rank} exited 0 at step {left.step + 1} before finishing its steps, "
                 f"{evidence}: it left the job early")
        core.events.event("left_early", generation=core.generations.current, rank=left.rank,
                          pid=left.pid, step=left.step, verdict="incident", evidence=evidence)
        injected = self._injected.get(left.rank)
        injected = (self._injected.pop(left.rank)
                    if injected is not None and injected[1] == "leave" else None)
        incident = self.recoveries.new_incident(kind=IncidentKind.LEFT_EARLY, rank=left.rank,
                                                step=left.step + 1,
                                                fault_t=injected[0] if injected else left.t,
                                                detected_t=time.time(), error=error)
        incident.detail.update({"returncode": 0, "pid": left.pid, "node": left.node})
        # (`undying inject leave`: not the script's own early end, so never counted as a repeat)
        if injected:
            incident.detail["injected"] = True
        self.recoveries.handle(incident)
