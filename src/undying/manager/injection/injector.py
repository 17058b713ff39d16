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
"""

from __future__ import annotations

import signal
import time
from typing import Any

from undying.errors import UsageError
from undying.manager.core import JobCore
from undying.manager.integrity import arm_numeric
from undying.manager.recovery import Detection
from undying.protocol.kinds import HangHow, InjectKind, InjectPhase, SlowPhase
from undying.protocol.worker_wire import ArmFault

__all__ = ["Injector"]

# The faults done from outside the rank's process, by a signal.
_INJECT_SIGNALS = {"crash": signal.SIGKILL, "hang": signal.SIGSTOP}
# Where the training thread itself runs, so that a leave's sys.exit(0) ends the script
# (manager.recovery.leaving).
_LEAVE_PHASES = ("step", "forward", "optimizer")


class Injector:
    def __init__(self, core: JobCore, detection: Detection) -> None:
        self.core = core
        self.detection = detection

    def _check_target(self, rank: int) -> None:
        core = self.core
        if rank not in core.ranks:
            raise UsageError(f"rank {rank} does not exist; this job has ranks "
                             f"0..{core.book.world_size - 1}")
        if core.winding_down:
            raise UsageError(f"job {core.config.job_id} is {core.state.value}; "
                             "nothing to inject into")

    def inject(self, kind: str, rank: int, at_step: int | None, phase: str | None,
               how: str | None = None, *, factor: float | None = None) -> dict[str, Any]:
        """Fault a rank now, or arm it to fault itself when it reaches ``at_step``."""
        if kind not in InjectKind:
            raise UsageError(f"unknown fault kind {kind!r}; choose one of {', '.join(InjectKind)}")
        if kind == "slow":
            return self._inject_slow(rank, at_step, phase or "compute", factor)
        if kind in ("nan", "bitflip"):  # manager.integrity.numerics
            return arm_numeric(self.core, kind, rank, at_step, how, phase, factor)
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
                raise UsageError(f"rank {rank} has no running process right now; "
                                 "try again in a moment")
            self.detection.injected[rank] = (t, kind)
            core.events.event("fault_injected", rank=rank, kind=kind, pid=info.pid, phase="now")
            return {"injected": kind, "rank": rank, "pid": info.pid, "when": "now"}
        fault = ArmFault(kind=kind, at_step=at_step if at_step is not None else info.step + 1,
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
        fault = ArmFault(kind="slow", at_step=at_step if at_step is not None else info.step + 1,
                         phase=phase, factor=factor)
        self.core.agents[info.node].arm(rank, fault)
        self.core.events.event("fault_armed", rank=rank, kind="slow", at_step=fault.at_step,
                               phase=phase, factor=factor)
        return {"injected": "slow", "rank": rank, "pid": info.pid, "at_step": fault.at_step,
                "phase": phase, "factor": factor}
