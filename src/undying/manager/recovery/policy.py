"""The recovery policy: a pure function from an incident and its history to an action.

Faults are bad luck and are recovered; the same fault at the same step again
and again is a bug, and the job stops with a report instead of looping.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from undying.jobfiles.records import Incident, IncidentKind
from undying.protocol.node_wire import RankProgress

__all__ = ["Action", "Decision", "PolicyContext", "WHOLE_GROUP", "decide", "stall_culprits"]


class Action(str, enum.Enum):
    RETRY = "retry"  # same processes, new process groups, re-run the step
    REPLACE = "replace"  # new processes for the dead ranks, state from peers
    # Every rank starts again: from the latest valid checkpoint when no peer holds the state, or,
    # for a script that does not use the step API (torchrun's recovery), from its start (its own
    # snapshot).
    RESTART = "restart"
    FAIL = "fail"  # stop the job with a report


@dataclass(frozen=True)
class PolicyContext:
    # Whole-group restarts allowed (torchrun's --max-restarts): the restart rung's bound.
    max_restarts: int
    # Ranks whose processes are alive and hold state (not replacements waiting for it).
    holders_alive: int
    # In-place retries of a communication error at one step before escalating.
    max_retries: int = 3
    # The step of the latest valid persisted checkpoint (None: none), for the restart rung.
    checkpoint_step: int | None = None
    # Whole-job restarts from a checkpoint so far (bounded by max_restarts).
    restarts: int = 0
    # The restore planner's words when no complete state exists (a shard in no survivor and no
    # checkpoint).
    no_state: str = ""
    # Recoveries of faults at one step (--max-step-recoveries); None: as many as max_restarts.
    max_step_recoveries: int | None = None
    # The script uses undying's step API; False: it holds no state undying can move, so a fault
    # restarts the whole group (torchrun's recovery), up to max_restarts times.
    step_api: bool = True

    @property
    def step_limit(self) -> int:
        return self.max_restarts if self.max_step_recoveries is None else self.max_step_recoveries


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def decide(incident: Incident, history: Sequence[Incident], ctx: PolicyContext) -> Decision:
    """The ladder: retry (comm errors, up to ``max_retries`` at a step) -> replace the rank (up to
    ``max_step_recoveries`` times for one rank at one step) -> restart every rank from the latest
    valid checkpoint when no peer holds the state (up to ``max_restarts`` times) -> fail with a
    report. A script that cannot run (a SyntaxError or ImportError) fails at once: no replacement
    would run it either. A rank that left early (``left-early``) is replaced once; leaving early
    again fails the job: its script stops before the others' (an injected leave is no script's, and
    never counts so). A script that does not use the step API has one rung below failing: the whole
    group restarts (``max_restarts`` times), as under torchrun."""
    if incident.kind is IncidentKind.SCRIPT_ERROR:
        return Decision(Action.FAIL, incident.error)
    if not ctx.step_api:
        return _restart_group(incident, ctx)
    if incident.kind is IncidentKind.LEFT_EARLY and not incident.detail.get("injected"):
        before = [i for i in history if i is not incident and i.kind is IncidentKind.LEFT_EARLY and
                  i.rank == incident.rank and i.action == Action.REPLACE.value
                  and not i.detail.get("injected")]
        if before:
            return Decision(Action.FAIL, f"rank {incident.rank} left the job early again at step "
                                         f"{incident.step} (exit 0 before its last step while the "
                                         "others went on; replaced for it at step "
                                         f"{before[0].step}): its script ends its loop before "
                                         "the others', and any new process would too; make every "
                                         "rank run the same steps")
    if ctx.no_state and ctx.holders_alive > 0:
        return Decision(Action.FAIL, "the surviving ranks do not hold the whole training state "
                                     f"and no valid checkpoint has the rest ({ctx.no_state}); "
                                     "restart the job")
    if ctx.holders_alive == 0:
        gone = ("every rank that held the training state is gone, so there is no peer to restore "
                "from")
        if ctx.checkpoint_step is None:
            return Decision(Action.FAIL,
                            f"{gone}, and there is no valid checkpoint to restart from; restart "
                            "the job")
        if ctx.restarts >= ctx.max_restarts:
            return Decision(
                Action.FAIL,
                f"{gone}, and the job was already restarted from a checkpoint {ctx.restarts} "
                f"time(s) (--max-restarts {ctx.max_restarts})",
            )
        return Decision(
            Action.RESTART,
            f"{gone}; every rank restarts from the checkpoint of step {ctx.checkpoint_step} "
            f"(restart {ctx.restarts + 1} of at most {ctx.max_restarts})",
        )
    earlier = [i for i in history if i is not incident and i.step == incident.step]
    if incident.kind is IncidentKind.COMM_ERROR:
        retries = sum(1 for i in earlier if i.kind is IncidentKind.COMM_ERROR
                      and i.action == Action.RETRY.value)
        if retries < ctx.max_retries:
            return Decision(Action.RETRY, "collective failed with every process alive")
    replacements = sum(1 for i in earlier if i.rank == incident.rank
                       and i.action == Action.REPLACE.value)
    if replacements >= ctx.step_limit:
        what = "raised" if incident.kind is IncidentKind.ERROR else "failed"
        return Decision(
            Action.FAIL,
            f"rank {incident.rank} {what} at step {incident.step}, which was already recovered "
            f"{replacements} time(s) at that step (--max-step-recoveries {ctx.step_limit}); "
            "a fault that repeats at the same step is a bug, not bad luck",
        )
    if incident.kind is IncidentKind.COMM_ERROR:
        return Decision(
            Action.REPLACE,
            f"collective failed at step {incident.step} again after {ctx.max_retries} retries "
            f"(--max-retries {ctx.max_retries}); rank {incident.rank} is replaced",
        )
    kinds = {IncidentKind.HANG: "stopped answering and was killed",
             IncidentKind.LEFT_EARLY: "left early (exit 0 while the others went on)"}
    what = kinds.get(incident.kind, "exited")
    return Decision(Action.REPLACE, f"rank {incident.rank} {what}; a new process takes its place")


WHOLE_GROUP = "this script does not use undying's step API"


def _restart_group(incident: Incident, ctx: PolicyContext) -> Decision:
    """torchrun's recovery for a script undying cannot recover in place: every rank starts again."""
    what = {IncidentKind.HANG: "hung and was killed",
            IncidentKind.NODE_LOSS: "was lost with its node",
            IncidentKind.COMM_ERROR: "lost its link"}.get(incident.kind, "exited")
    if ctx.restarts >= ctx.max_restarts:
        return Decision(
            Action.FAIL,
            f"rank {incident.rank} {what} ({incident.error or incident.kind}); the whole group was "
            f"already restarted {ctx.restarts} time(s) (--max-restarts {ctx.max_restarts}): "
            f"{WHOLE_GROUP}, so a fault restarts every rank",
        )
    return Decision(
        Action.RESTART,
        f"rank {incident.rank} {what}; whole-group restart {ctx.restarts + 1} of at most "
        f"{ctx.max_restarts}: {WHOLE_GROUP}, so every rank starts again (a script that saves its "
        "own snapshot resumes from it)",
    )


def stall_culprits(progress: Sequence[RankProgress], limit_s: float,
                   now: float) -> list[int] | None:
    """Of ranks stuck in a step together, the ones the others wait for.

    A collective counts on a rank when the rank enters it, so the ranks
    waiting in collective n have entered n, and a rank that never got there
    (an endless loop, a deadlock, a stop outside a collective) shows fewer.
    Those with the fewest are the culprits, if they are stuck themselves (no
    progress for ``limit_s`` by ``now``): one behind that still moves is slow,
    not stuck (a loaded host), and blaming it would replace a healthy rank, so
    the answer is ``None``: not yet, judged again on the next report. When
    every rank entered as many, all are inside the same collective and no
    rank is to blame: ``[]``. Only ranks running steps in the newest
    generation count.
    """
    running = [p for p in progress if p.phase == "step"]
    if not running:
        return []
    newest = max(p.generation for p in running)
    running = [p for p in running if p.generation == newest]
    if len(running) == 1 and len(progress) == 1:
        return [running[0].rank]  # a job of one rank has nobody else to wait for
    fewest = min(p.collectives for p in running)
    if fewest == max(p.collectives for p in running):
        return []
    stuck = sorted(p.rank for p in running if p.collectives == fewest
                   and now - p.progress_t > limit_s)
    return stuck or None
