"""The recovery policy: a pure function from an incident and its history to an action.

Faults are bad luck and are recovered; the same fault at the same step again
and again is a bug, and the job stops with a report instead of looping.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from undying.jobfiles.records import Incident, IncidentKind
from undying.protocol.node_wire import RankProgress

__all__ = ["Action", "Decision", "PolicyContext", "WHOLE_GROUP", "decide", "certain_start",
           "recovery_stall", "stall_culprits"]


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
    # Some rank committed a step (False: the job has trained nothing yet, and a start of every rank
    # from the beginning loses nothing).
    trained: bool = True
    # The ranks of the job (0: unknown, and no start-up failure is judged certain).
    world_size: int = 0
    # For a whole-group restart (no step API): the exception each process of the previous attempt
    # raised, by rank ("" or absent: none it said), and those of this attempt's processes so far.
    last_start: Mapping[int, str] = field(default_factory=dict)
    this_start: Mapping[int, str] = field(default_factory=dict)

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
    group restarts (``max_restarts`` times), as under torchrun, and so does every rank of a job
    that lost them all before its first step with no checkpoint. A start-up error that every rank
    raised the same way twice in a row (``certain_start``) fails at once, whatever the limits say: a
    start raises it again."""
    if incident.kind is IncidentKind.SCRIPT_ERROR:
        return Decision(Action.FAIL, incident.error)
    certain = certain_start(incident, history, ctx)
    if certain:
        return Decision(Action.FAIL, certain)
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
        if ctx.checkpoint_step is None and not ctx.trained:
            return _restart_start(incident, ctx)
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
            "a fault that repeats at the same step is a bug, not bad luck"
            + (f" (the last: {incident.error})" if incident.kind is IncidentKind.HANG else ""),
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


def _shape(error: str) -> str:
    """An exception's words with their numbers left out: rank 0's and rank 1's "rank 0 has no data"
    are the same error."""
    return re.sub(r"\d+", "#", error.strip())


def certain_start(incident: Incident, history: Sequence[Incident], ctx: PolicyContext) -> str:
    """Why restarting after ``incident`` would fail again for sure, or "" (then the ladder decides).

    A start-up failure (the process committed no step: ``detail["startup"]``)
    with an exception (``detail["raised"]``) is certain when every rank raised
    that exception (numbers aside) and this rank raised it twice in a row. With
    the step API each rank's fault is an incident: every rank's latest one
    before this must be that start-up error, this rank's too. A whole-group
    restart kills the others at the first exit: their words are what their
    processes left (``ctx.last_start``, the attempt before; ``ctx.this_start``,
    this one), and every rank must have raised it in one of the two, this rank
    in the attempt before. A different error, or one rank only, is a flaky
    start: it gets its restarts.
    """
    raised = incident.detail.get("raised", "")
    if not raised or not incident.detail.get("startup") or ctx.world_size < 1:
        return ""
    shape = _shape(raised)
    others = [r for r in range(ctx.world_size) if r != incident.rank]
    if ctx.step_api:
        latest: dict[int, str] = {}
        for earlier in history:
            if earlier is not incident:
                latest[earlier.rank] = (_shape(earlier.detail.get("raised", ""))
                                        if earlier.detail.get("startup") else "")
        certain = all(latest.get(r) == shape for r in [incident.rank, *others])
    else:
        certain = (_shape(ctx.last_start.get(incident.rank, "")) == shape
                   and all(shape in (_shape(ctx.last_start.get(r, "")),
                                     _shape(ctx.this_start.get(r, ""))) for r in others))
    if not certain:
        return ""
    where = " before it committed a step" if ctx.step_api else ""
    return (f"every rank raised the same error{where}, twice in a row: {raised.strip()}; a "
            "restart would raise it again, so the job ends (whatever --max-restarts says): fix "
            "it and run the same command again")


def _restart_start(incident: Incident, ctx: PolicyContext) -> Decision:
    """Every rank failed before the job's first step, with no checkpoint: nothing is lost if every
    rank starts again from the beginning (a flaky start gets its restarts, ``max_restarts``)."""
    words = f"rank {incident.rank} {_what(incident)} ({incident.error or incident.kind})"
    if ctx.restarts >= ctx.max_restarts:
        return Decision(Action.FAIL, f"{words} before the job's first step, and every rank was "
                                     f"already started again {ctx.restarts} time(s) "
                                     f"(--max-restarts {ctx.max_restarts})")
    return Decision(Action.RESTART, f"{words}, and no rank holds state yet (the job trained no "
                                    f"step): every rank starts again from the beginning (restart "
                                    f"{ctx.restarts + 1} of at most {ctx.max_restarts})")


def _what(incident: Incident) -> str:
    return {IncidentKind.HANG: "hung and was killed",
            IncidentKind.NODE_LOSS: "was lost with its node",
            IncidentKind.COMM_ERROR: "lost its link"}.get(incident.kind, "exited")


WHOLE_GROUP = "this script does not use undying's step API"


def _restart_group(incident: Incident, ctx: PolicyContext) -> Decision:
    """torchrun's recovery for a script undying cannot recover in place: every rank starts again."""
    what = _what(incident)
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


def recovery_stall(progress: Sequence[RankProgress], generation: int, started: float,
                   limit_s: float, now: float) -> list[int] | None:
    """During a recovery into ``generation`` (begun at ``started``), the ranks of that generation
    the others wait for, once a rank in its first step has waited there past ``limit_s``
    (counted from ``started`` at the earliest); None: nothing to act on (yet).

    A rank still starting its steps (``init``: a replacement past its restore, replaying its
    loader to the step) while others wait in the step is the one they wait for: once it made no
    progress either (no batch read) past ``limit_s``, it waits in a collective of its own that
    the others never enter (one its loader's ``__iter__`` runs on this rank alone); one that
    still reads batches is slow, not stuck (None). A rank still restoring (``recovery``) is not
    judged here: the recovery's own deadline bounds it. When every rank is in the step,
    ``stall_culprits`` judges them as in any step: ``[]`` when none lags (the link), None when
    the ones behind still move.
    """
    members = [p for p in progress if p.generation == generation]
    waiting = [p for p in members
               if p.phase == "step" and now - max(p.progress_t, started) > limit_s]
    if not waiting or any(p.phase == "recovery" for p in members):
        return None
    late = [p for p in members if p.phase == "init"]
    if late:
        stuck = sorted(p.rank for p in late if now - max(p.progress_t, started) > limit_s)
        return stuck or None
    return stall_culprits([replace(p, progress_t=max(p.progress_t, started)) for p in progress],
                          limit_s, now)
