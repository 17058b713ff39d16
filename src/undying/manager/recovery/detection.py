"""Detection: from what the agents and ranks report to an incident, with its kind, its times and its
words.

A process exit is a crash, a user error (the rank said so before dying), a
script that cannot run, a hang (the manager had it killed for silence) or a
lost node; which one decides the incident's kind, when the fault happened
(an injected fault names its time) and the error a person reads. A stall
with every rank beating is a hang of the rank the others wait for, or, when
none lags, the link. A failed collective is the link only if no process
exits within the comm-error grace. A rank that exited 0 before its last step
is held (``leaving``): a failed collective or a stall of the others past its
step makes it the fault, a rank that left early.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from dataclasses import dataclass

from undying.config import EXIT_SCRIPT_ERROR, SCRIPT_ERROR_FILE
from undying.jobfiles.records import Incident, IncidentKind, JobState, RankInfo, RankState
from undying.manager.core import JobCore
from undying.manager.recovery.leaving import Leavers
from undying.manager.recovery.policy import recovery_stall, stall_culprits
from undying.manager.recovery.rounds import Recoveries
from undying.manager.recovery.starts import error_file
from undying.protocol.node_wire import RankProgress
from undying.protocol.worker_wire import CommFailure, Fatal

__all__ = ["Detection", "ExitCause", "classify_exit", "describe_exit", "error_file"]


@dataclass(frozen=True)
class ExitCause:
    """What ended a rank's process, as far as the manager knew before it ended."""

    returncode: int
    t: float
    injected: tuple[float, str] | None = None  # (when, kind) of a fault injected into the rank
    # (last heard, detected, phase): killed for silence
    hung: tuple[float, float, str] | None = None
    lost: tuple[int, str, float] | None = None  # (node, why, when): its node was lost
    fatal: Fatal | None = None  # the error the rank reported before dying


# The phase a rank is killed for (a hang) when the first step of a recovery's generation waits
# for it past the step timeout.
STALLED_IN_RECOVERY = "recovery-stall"


@dataclass(frozen=True)
class Classified:
    kind: IncidentKind
    fault_t: float
    detected_t: float
    error: str
    traceback: str = ""


def classify_exit(cause: ExitCause, *, step: int, script_error: str) -> Classified:
    """The incident an unexpected exit is: a pure function of what was known about the process."""
    lost, hung, fatal, t = cause.lost, cause.hung, cause.fatal, cause.t
    kind = (IncidentKind.NODE_LOSS if lost else IncidentKind.HANG if hung else
            IncidentKind.ERROR if fatal is not None else IncidentKind.CRASH)
    detected = t
    if lost:
        error = f"node {lost[0]} lost: {lost[1]}"
    elif hung:
        last_heard, detected, phase = hung
        if phase == "step":
            error = (f"no progress in step {step} for {detected - last_heard:.1f}s (step timeout); "
                     "killed")
        elif phase == STALLED_IN_RECOVERY:
            error = (f"did not come to step {step} after a recovery while the other ranks waited "
                     f"in it past the step timeout ({detected - last_heard:.1f}s without "
                     "progress): it waited in a collective they never entered, such as one its "
                     "loader's __iter__ runs while it replays the loader alone; killed. Run no "
                     "collective in the loader given to job.state (accelerate's rng_types, "
                     "dispatch_batches)")
        else:
            error = f"no heartbeat for {detected - last_heard:.1f}s ({phase} timeout); killed"
    else:
        error = fatal.error if fatal else describe_exit(cause.returncode)
    if cause.returncode == EXIT_SCRIPT_ERROR and not (lost or hung):
        kind, error = IncidentKind.SCRIPT_ERROR, script_error
    fault_t = cause.injected[0] if cause.injected else hung[0] if hung else lost[2] if lost else t
    return Classified(kind, fault_t, detected, error, fatal.traceback if fatal else "")


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def script_error(job_dir: str, rank: int) -> str:
    """The job's failure when a rank's script could not run: the error its first rank left, in one
    line."""
    try:
        with open(os.path.join(job_dir, SCRIPT_ERROR_FILE), encoding="utf-8",
                  errors="replace") as f:
            told = f.read(2000).strip()
    except OSError:
        told = ""
    where = told or (f"rank {rank} exited with a SyntaxError, an ImportError or a StateError "
                     "(its output says where)")
    return f"the training script could not run: {where}; fix it and run the same command again"


class Detection:
    def __init__(self, core: JobCore, recoveries: Recoveries) -> None:
        self.core = core
        self.recoveries = recoveries
        self.injected: dict[int, tuple[float, str]] = {}  # rank -> (when, kind)
        self.hung: dict[int, tuple[float, float, str]] = {}  # pid -> (last heard, detected, phase)
        self.fatal: dict[int, Fatal] = {}  # pid -> the error its rank reported
        self.node_lost: dict[int, tuple[int, str, float]] = {}  # pid -> (node, why, when)
        # ranks that exited 0 before their last step (manager.recovery.leaving)
        self.leavers = Leavers(core, recoveries, self.injected)
        self.grace_tasks: set[asyncio.Task[None]] = set()

    def cause_of(self, info: RankInfo, pid: int, returncode: int, t: float) -> ExitCause:
        """Everything known about why ``pid`` ended (each fact is used once: a later process starts
        clean)."""
        return ExitCause(returncode, t, injected=self.injected.pop(info.rank, None),
                         hung=self.hung.pop(pid, None),
                         lost=self.node_lost.pop(pid, None), fatal=self.fatal.pop(pid, None))

    def on_fault_exit(self, info: RankInfo, pid: int, returncode: int, t: float) -> None:
        """A rank's process ended before its last step: an incident, handled."""
        cause = self.cause_of(info, pid, returncode, t)
        found = classify_exit(cause, step=info.step + 1,
                              script_error=script_error(self.core.config.job_dir, info.rank)
                              if returncode == EXIT_SCRIPT_ERROR else "")
        error, traceback = found.error, found.traceback
        raised = cause.fatal.error if cause.fatal else ""
        if not traceback and not cause.hung and not cause.lost:
            told, stack = error_file(self.core.config.job_dir, info.rank, info.incarnation)
            # torchrun's error file, as torchrun reads it: the error, by rank, with its traceback
            if told:
                traceback = f"rank {info.rank}:\n{stack}" if stack else ""
                error, raised = f"{error}: {told}", told
        incident = self.recoveries.new_incident(kind=found.kind, rank=info.rank, step=info.step + 1,
                                                fault_t=found.fault_t, detected_t=found.detected_t,
                                                error=error, traceback=traceback)
        incident.detail.update({"returncode": returncode, "pid": pid, "node": info.node})
        if raised and not (cause.hung or cause.lost or cause.injected):
            # what the policy weighs of a start that fails the same way again (certain_start)
            incident.detail.update({"raised": raised,
                                    "startup": info.incarnation not in self.core.book.stepped})
        if cause.injected:
            incident.detail["injected"] = True
        self.recoveries.handle(incident)

    def finished(self, returncode: int, finished_steps: bool) -> bool:
        """Whether a rank's exit ends its part of the job rather than being a fault.

        A clean exit, or an exit after its last step, is. So is any exit once
        the job's final barrier completed on some rank (then this one passed
        it too), but only for a script that uses the step API: without it there
        is no barrier, and a rank killed after another one finished is a fault.
        """
        if returncode == 0 or finished_steps:
            return True
        return self.recoveries.step_api and self.core.book.any_done()

    def on_hang(self, rank: int, pid: int, phase: str, last_seen: float, t: float) -> None:
        """A rank fell silent: kill it; its exit is then recovered as a hang (replace)."""
        core = self.core
        info = core.ranks[rank]
        if pid != info.pid or core.winding_down:
            return
        if info.state is RankState.DONE:
            return  # finished its steps; a slow interpreter shutdown is not a hang
        if pid in self.hung:
            return  # already being killed
        self.hung[pid] = (last_seen, t, phase)
        core.events.event("hang_detected", generation=core.generations.current, rank=rank, pid=pid,
                          phase=phase, silent_s=round(t - last_seen, 3), step=info.step + 1)
        core.kill(rank)

    def on_stall(self, progress: list[RankProgress], limit: float, t: float) -> None:
        """Ranks beat but make no progress for ``limit`` seconds: kill the ones the others wait for.

        When no rank lags (every one is inside the same collective), no process
        is to blame: it is the link, and the collective is retried in place.
        While a recovery runs, ranks look stuck until they hear of it; then
        only a rank still in a step of the old generation ``limit`` seconds
        after the recovery began is stuck. Once the new generation's first step
        has waited ``limit`` seconds (``recovery_stall``), the recovery failed:
        the rank it waits for (one still starting its steps, in a collective of
        its own) is killed and replaced, and a recovery that stalls so at the
        same step again ends the job by ``--max-step-recoveries`` with the reason;
        every rank in one collective is the link's fault, retried.
        """
        core = self.core
        if core.winding_down:
            return
        if self.leavers.pending and any(
                self.leavers.explains(p.rank, p.step, f"stuck for {t - p.progress_t:.1f}s")
                for p in progress if p.phase == "step"):
            return  # they wait for a rank that left: that rank is the fault
        generation = core.generations.current
        recovery = self.recoveries.current
        phase = "step"
        if recovery is not None:
            spared = self.recoveries.spared(t)  # last holders of the state, waited for
            culprits = sorted(p.rank for p in progress if p.phase == "step"
                              and p.generation < generation and p.pid not in spared
                              and t - max(p.progress_t, recovery.started) > limit)
            if not culprits and spared:
                return  # the round waits for a kept rank to leave (Recoveries.spared)
            if not culprits:
                # the new generation's first step, waiting past the limit for a rank that does
                # not come to it (or all of them in one collective): the recovery failed
                late = recovery_stall(progress, generation, recovery.started, limit, t)
                if late is None:
                    return  # explained by the recovery under way
                culprits, phase = late, STALLED_IN_RECOVERY
        elif self.hung:
            return  # a stuck rank is being killed; the ones waiting for it are not stuck
        else:
            found = stall_culprits(progress, limit, t)
            if found is None:
                return  # the ranks behind still move: slow, not stuck; the next report judges again
            culprits = found
        by_rank = {p.rank: p for p in progress}
        stuck_ranks = [p for p in progress if p.phase == "step" and p.generation == generation]
        if not culprits and not stuck_ranks:
            return  # explained by the recovery under way
        core.events.event("stall_detected", generation=generation, culprits=culprits,
                          limit_s=round(limit, 3), in_recovery=recovery is not None,
                          progress=[dataclasses.asdict(p) for p in progress])
        for rank in culprits:
            stuck = by_rank[rank]
            self.on_hang(rank, stuck.pid, phase, stuck.progress_t, t)
        if culprits:
            return
        first = min(stuck_ranks, key=lambda p: (p.progress_t, p.rank))
        incident = self.recoveries.new_incident(
            kind=IncidentKind.COMM_ERROR, rank=first.rank, step=first.step,
            fault_t=first.progress_t, detected_t=t,
            error=f"every rank is stuck in the same collective (#{first.collectives} of generation "
                  f"{first.generation}) for {t - first.progress_t:.1f}s; no rank lags, so the link "
                  "is to blame",
        )
        incident.detail["stuck_collective"] = True
        self.recoveries.handle(incident)

    def on_comm_failure(self, message: CommFailure) -> None:
        """A rank's collective failed: wait the grace for an exit that explains it, else retry the
        link."""
        if message.generation < self.core.generations.current:
            return  # the manager already moved on; the worker follows
        task = asyncio.get_running_loop().create_task(self._comm_failure_grace(message))
        self.grace_tasks.add(task)
        task.add_done_callback(self.grace_tasks.discard)

    async def _comm_failure_grace(self, message: CommFailure) -> None:
        """A collective failed. If no process exits meanwhile, it was the link: retry."""
        core = self.core
        grace = core.config.timeouts.comm_error_grace
        await asyncio.sleep(grace)
        # A rank that reported an error in the user's code is on its way out (its interpreter tears
        # down, which takes seconds on a busy machine): its exit, not the link, is what failed.
        patience = time.monotonic() + 10 * grace
        while (self.fatal and time.monotonic() < patience
               and core.generations.current == message.generation):
            await asyncio.sleep(0.05)
        if core.generations.current != message.generation or core.state not in (
                JobState.RUNNING, JobState.RECOVERING, JobState.STARTING):
            return
        if any(i.step == message.step for i, _ in self.recoveries.condemned.values()):
            return  # already escalated: a rank of this failure is being replaced
        if self.leavers.explains(message.rank, message.step, "its collective failed"):
            return  # a rank that exited 0 before this step left the others waiting
        # An injected link fault names its rank and time; a group that never formed, a member that
        # never came; otherwise the first to report.
        injected = [(t, r) for r, (t, kind) in self.injected.items() if kind == "comm-error"]
        rank, fault_t, error = message.rank, message.t, message.error
        if injected:
            fault_t, rank = min(injected)
            del self.injected[rank]
        elif message.unformed and (absent := self._absent(message)):
            rank = absent[0]
            error = (f"generation {message.generation} failed to form: rank"
                     f"{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} never came "
                     f"(rank {message.rank}: {message.error})")
        incident: Incident = self.recoveries.new_incident(kind=IncidentKind.COMM_ERROR, rank=rank,
                                                          step=message.step, fault_t=fault_t,
                                                          detected_t=time.time(), error=error)
        incident.detail["injected"] = bool(injected)
        self.recoveries.handle(incident)

    def _absent(self, message: CommFailure) -> list[int]:
        """The ranks with a live process that never came to build the generation ``message`` could
        not form (``arrival_key``): the one to blame, and to replace if it keeps failing."""
        ranks = [info.rank for info in self.core.ranks.values()
                 if info.state not in (RankState.EXITED, RankState.DONE)]
        arrived = self.core.generations.arrived(message.generation, ranks)
        return [] if arrived is None else sorted(set(ranks) - arrived)

    def cancel(self) -> None:
        for task in list(self.grace_tasks):
            task.cancel()
