"""Fault injection: an operator's (or a test's) command to fault a rank now or at a step.

Every fault the project claims to survive can be caused on purpose, on a real
process: SIGKILL (crash), SIGSTOP (hang, found by its missing heartbeats), a
training thread that spins or blocks while the process beats (hang with
``how``), broken connections under a live process (comm-error), and a rank
made ``factor`` times slower in one phase (slow, found by slow-rank
detection, not recovered), and a script that exits 0 before its last step
while the others go on (leave: a ``left-early`` incident, ``manager.recovery.leaving``).
Each command is checked before anything happens and refused with a line
naming the bad input.

A drill tells the truth (``due_step``): a fault armed for a step must be able
to fire at that step. Refused (``ConflictError``, HTTP 409), each in one line
that says what to do: a step the rank already committed, for a fault of a
phase every step has (it would fire at the rank's next step instead, late; an
operator who wants it now leaves the step out); a step past the job's last
(rank 0's plan says which, once its loop started); a rank that ran its last
step; and any fault armed in a script without the step API, which has no
steps (only crash and hang, now, reach it: they are signals). The phases of
an event (recovery, join, rejoin, regroup) take their step as "not before": a step
passed means the next such event.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from undying.errors import ConflictError, UsageError
from undying.jobfiles.progress import Plan
from undying.jobfiles.records import RankState
from undying.manager.core import JobCore
from undying.manager.integrity import arm_numeric
from undying.manager.recovery import Detection
from undying.protocol.kinds import HangHow, InjectKind, InjectPhase, SlowPhase
from undying.protocol.worker_wire import ArmFault

__all__ = ["Injector"]

log = logging.getLogger(__name__)

# The faults done from outside the rank's process, by a signal.
_INJECT_SIGNALS = {"crash": signal.SIGKILL, "hang": signal.SIGSTOP}
# Where the training thread itself runs, so that a leave's sys.exit(0) ends the script
# (manager.recovery.leaving).
_LEAVE_PHASES = ("step", "forward", "optimizer")
# The phases that come once at every step: a step passed never comes back for them. (recovery,
# join, rejoin and regroup come with an event, at a step not before the one armed.)
_EVERY_STEP = frozenset({"step", "forward", "backward", "optimizer", *SlowPhase})


def _done(rank: int, step: int) -> ConflictError:
    return ConflictError(f"rank {rank} has run its last step ({step}); nothing is left to "
                         "inject into")


class Injector:
    def __init__(self, core: JobCore, detection: Detection) -> None:
        self.core = core
        self.detection = detection
        # (rank, kind, step) of the drills armed before rank 0's plan said where the job ends
        self._unchecked: list[tuple[int, str, int]] = []
        core.clock.plan_told.append(self._plan_known)

    def _plan_known(self, plan: Plan) -> None:
        """Rank 0's plan came: a drill armed before it, for a step past the job's end, never
        fires, and is said to (a warning, ``fault_unreachable``)."""
        unchecked, self._unchecked = self._unchecked, []
        for rank, kind, step in unchecked:
            if step > plan.total_steps:
                log.warning("job %s: the %s armed for rank %d at step %d will never fire: the "
                            "job's last step is %d", self.core.config.job_id, kind, rank, step,
                            plan.total_steps)
                self.core.events.event("fault_unreachable", rank=rank, kind=kind, at_step=step,
                                       last_step=plan.total_steps)

    def _check_target(self, rank: int) -> None:
        core = self.core
        if rank not in core.ranks:
            raise UsageError(f"rank {rank} does not exist; this job has ranks "
                             f"0..{core.book.world_size - 1}")
        if core.winding_down:
            raise ConflictError(f"job {core.config.job_id} is {core.state.value}; "
                                "nothing to inject into")
        if core.ranks[rank].state is RankState.DONE:
            raise _done(rank, core.ranks[rank].step)

    def due_step(self, kind: str, rank: int, at_step: int | None, phase: str) -> int:
        """The step a fault armed for ``at_step`` (None: the rank's next) fires at, or
        ``ConflictError`` with the reason it never would (module doc)."""
        core = self.core
        info = core.ranks[rank]
        if not self.detection.recoveries.step_api:
            at = (f"at step {at_step}" if at_step is not None else
                  f"at phase {phase}" if phase != "step" else "at its next step")
            raise ConflictError(f"job {core.config.job_id}'s script does not use the step API "
                                f"(job.steps), so it has no steps: {kind} {at} would never fire; "
                                "inject crash or hang now (no --at-step, no --phase)")
        plan = core.clock.plan
        last = plan.total_steps if plan is not None else None
        if info.state is RankState.DONE or (last is not None and info.step >= last):
            raise _done(rank, info.step)
        step = at_step if at_step is not None else info.step + 1
        if last is not None and step > last:
            raise ConflictError(f"step {step} is past the job's end: its last step is {last}; "
                                f"pick a step from {info.step + 1} to {last}")
        if step <= info.step and phase in _EVERY_STEP:
            until = f" (up to {last})" if last is not None else ""
            raise ConflictError(f"step {step} has passed: rank {rank} committed step "
                                f"{info.step}; pick a later step{until}, or leave --at-step out "
                                "to inject now")
        if last is None:
            self._unchecked.append((rank, kind, step))
        return step

    def inject(self, kind: str, rank: int, at_step: int | None, phase: str | None,
               how: str | None = None, *, factor: float | None = None) -> dict[str, Any]:
        """Fault a rank now, or arm it to fault itself when it reaches ``at_step``."""
        if kind not in InjectKind:
            raise UsageError(f"unknown fault kind {kind!r}; choose one of {', '.join(InjectKind)}")
        if kind == "slow":
            return self._inject_slow(rank, at_step, phase or "compute", factor)
        if kind in ("nan", "bitflip"):  # manager.integrity.numerics
            return arm_numeric(self.core, kind, rank, at_step, how, phase, factor,
                               due=self.due_step)
        if factor is not None:
            raise UsageError("factor applies to slow only (undying inject slow --factor F)")
        if how is not None and (kind != "hang" or how not in HangHow):
            raise UsageError(f"how={how!r} applies to hang only, as one of {', '.join(HangHow)}")
        if rank not in self.core.ranks:
            raise UsageError(f"rank {rank} does not exist; this job has ranks "
                             f"0..{self.core.book.world_size - 1}")
        if phase is not None and phase not in InjectPhase:
            raise UsageError(f"unknown phase {phase!r}; choose one of {', '.join(InjectPhase)}")
        if kind == "leave" and (phase or "step") not in _LEAVE_PHASES:
            raise UsageError("leave exits the script from its own thread: "
                             f"at phase {' or '.join(_LEAVE_PHASES)}, not {phase!r}")
        self._check_target(rank)
        core = self.core
        info = core.ranks[rank]
        agent = core.agents[info.node]
        if how in ("spin", "block"):
            kind = f"hang:{how}"  # done by the rank's own training thread, at a step
        if at_step is None and phase is None and kind in _INJECT_SIGNALS:
            t = time.time()
            if not agent.kill(rank, _INJECT_SIGNALS[kind]):
                raise ConflictError(f"rank {rank} has no running process right now; "
                                    "try again in a moment")
            self.detection.injected[rank] = (t, kind)
            core.events.event("fault_injected", rank=rank, kind=kind, pid=info.pid, phase="now")
            return {"injected": kind, "rank": rank, "pid": info.pid, "when": "now"}
        fault = ArmFault(kind=kind, at_step=self.due_step(kind, rank, at_step, phase or "step"),
                         phase=phase or "step")
        agent.arm(rank, fault)
        core.events.event("fault_armed", rank=rank, kind=kind, at_step=fault.at_step,
                          phase=fault.phase)
        return {"injected": kind, "rank": rank, "pid": info.pid, "at_step": fault.at_step,
                "phase": fault.phase}

    def _inject_slow(self, rank: int, at_step: int | None, phase: str,
                     factor: float | None) -> dict[str, Any]:
        if factor is None or not 1.0 < factor <= 100.0:
            raise UsageError("slow needs a factor above 1 and at most 100 "
                             f"(1.2: steps 20% slower), got {factor}")
        if phase not in SlowPhase:
            raise UsageError(f"slow's phase must be one of {', '.join(SlowPhase)}, got {phase!r}")
        self._check_target(rank)
        info = self.core.ranks[rank]
        fault = ArmFault(kind="slow", at_step=self.due_step("slow", rank, at_step, phase),
                         phase=phase, factor=factor)
        self.core.agents[info.node].arm(rank, fault)
        self.core.events.event("fault_armed", rank=rank, kind="slow", at_step=fault.at_step,
                               phase=phase, factor=factor)
        return {"injected": "slow", "rank": rank, "pid": info.pid, "at_step": fault.at_step,
                "phase": phase, "factor": factor}
