"""The manager's side of numeric faults: a worker's verdict becomes an incident;
nan and bitflip drills are armed.

Rank 0 reports each numeric fault once, after the replay decided it
(``worker.numerics``): transient (replayed, committed as the fault-free run),
persistent (the batch skipped, or the job stopped: it fails at once, as no
replacement would pass that step) or non-deterministic. The
incident names the rank whose gradients changed between the two runs, or, for
a persistent fault, the rank whose own gradients were not finite.

A rank named alone by ``FAULTS_TO_REPLACE`` faults of the job (transient or
non-deterministic: its gradients changed between a step and its replay) is
replaced like a crash: its process is killed, and the recovery's usual path
(``manager.recovery``) puts a new one in its place with the state from a peer;
the incident says why, and a ``faulty_rank`` event names its host, which a
multi-node job should take out of placement (quarantine). A persistent fault
is the data's, not a rank's: it does not count.

Skipping is bounded (``skip_limit``): a persistent fault skips its batch (or
rolls back), and a job whose every batch fails would skip them all and
"succeed" with nothing trained. The job fails, with the reason in one line,
once more than ``max_skips_in_a_row`` steps in a row were skipped, or once
more than that many were skipped in all and they are more than
``max_skipped_share`` of the steps run (the limits come with each report:
``undying run --max-skips-in-a-row``/``--max-skipped-share`` or the script's
``Numerics``). The manager judges it from the incidents, so a replaced rank 0
or a restarted manager counts on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

from undying.errors import ConflictError, UsageError
from undying.jobfiles.records import (
    Incident,
    IncidentDetail,
    IncidentKind,
    IncidentStatus,
    JobState,
    RankState,
)
from undying.manager.core import JobCore
from undying.manager.placement import node_host, quarantine
from undying.manager.recovery import Action, Decision, Recoveries
from undying.protocol.kinds import NumericHow
from undying.protocol.worker_wire import ArmFault, Progress

__all__ = ["on_numeric_fault", "arm_numeric", "skip_limit", "NUMERIC_PHASE"]

NUMERIC_PHASE = "numeric_fault"
# How each kind may strike, and the first the default.
_HOWS = {"nan": ("once", "persistent"), "bitflip": ("grad", "param", "grad-finite")}
# A rank named alone by this many faults (since it was last replaced for them) is replaced like a
# crash.
FAULTS_TO_REPLACE = 2
# Verdicts that name a rank: its own gradients changed between the step and its replay.
_RANK_VERDICTS = ("transient", "nondeterministic")
# The bounds on skipped steps when a report carries none (worker.numerics' defaults).
_LIMITS = {"max_skips_in_a_row": 10, "max_skipped_share": 0.1}
_SKIPPING = ("skip", "rollback")


def on_numeric_fault(core: JobCore, message: Progress,
                     recoveries: Recoveries | None = None) -> None:
    """Record a worker's numeric verdict as an incident (the job went on,
    or stops by its own report)."""
    detail: dict[str, Any] = dict(message.detail)
    suspects = [int(r) for r in detail.get("suspects", []) if isinstance(r, int)]
    action = str(detail.get("action", ""))
    failed_t = detail.pop("fault_t", None)
    in_order = isinstance(failed_t, int | float) and failed_t <= message.t
    fault_t = float(failed_t) if in_order else message.t
    incident = Incident(
        id=len(core.incidents) + 1, kind=IncidentKind.NUMERIC,
        rank=suspects[0] if suspects else -1,
        step=message.step, fault_t=fault_t, recovery=0, action=action,
        status=IncidentStatus.FAILED if action == "stop" else IncidentStatus.RECOVERED,
        error=str(detail.get("summary", "")),
        detail=cast(IncidentDetail, {**detail, "ranks": suspects}),
    )
    incident.phases["detected"] = fault_t  # the check failed
    # replayed (and committed) or skipped: the job steps on, mttr_s is the replay's time
    if action != "stop":
        incident.phases["first_step_done"] = message.t
    core.incidents.append(incident)
    core.events.incident(incident)
    if action == "stop":  # the policy's word: no replacement would pass this step either
        core.fail(f"numeric fault, stopped by policy: {_report(incident.error, detail)}")
    elif action in _SKIPPING:
        skipped = skipped_steps(core.incidents)
        given = detail.get("limits")
        limits: dict[str, Any] = given if isinstance(given, dict) else {}
        over = skip_limit(skipped, max(core.book.newest_step(), message.step or 0),
                          {**_LIMITS, **limits})
        if over is not None:
            core.events.event("numerics_gave_up", step=message.step, skipped=len(skipped),
                              reason=over)
            core.fail(f"{over}; the last at step {message.step}: {detail.get('reason', '?')}")
    elif recoveries is not None and len(suspects) == 1 and detail.get("verdict") in _RANK_VERDICTS:
        _replace_if_found_again(core, recoveries, suspects[0])


def skipped_steps(incidents: list[Incident]) -> set[int]:
    """Every step whose batch a numeric fault's policy skipped (skip: the step;
    rollback: its range)."""
    steps: set[int] = set()
    for incident in incidents:
        if incident.kind is not IncidentKind.NUMERIC or incident.action not in _SKIPPING:
            continue
        listed = incident.detail.get("skipped")
        if isinstance(listed, list):
            steps.update(s for s in listed if isinstance(s, int))
        else:
            steps.add(incident.step)
    return steps


def skip_limit(skipped: set[int], steps_run: int, limits: dict[str, Any]) -> str | None:
    """Why the job must stop skipping (one line), or None: a pure decision on the skipped steps.

    Past ``max_skips_in_a_row`` steps skipped in a row the data or the model is
    broken, not a batch; and past ``max_skipped_share`` of the steps run (once
    more than ``max_skips_in_a_row`` were skipped in all: a few early skips are
    no share) the run is not the run that was asked for.
    """
    if not skipped:
        return None
    in_a_row = int(limits.get("max_skips_in_a_row") or _LIMITS["max_skips_in_a_row"])
    share = float(limits.get("max_skipped_share") or _LIMITS["max_skipped_share"])
    newest = max(skipped)
    run = 1
    while newest - run in skipped:
        run += 1
    if run > in_a_row:
        return (f"numeric faults skipped {run} steps in a row "
                f"(steps {newest - run + 1}..{newest}), "
                f"more than --max-skips-in-a-row {in_a_row}: the data or the model is broken, "
                "not a batch; the job stops")
    total, steps = len(skipped), max(steps_run, newest, 1)
    if total > in_a_row and total > share * steps:
        return (f"numeric faults skipped {total} of {steps} steps ({total / steps:.0%}), more than "
                f"--max-skipped-share {share:g}: the data or the model is broken, not a batch; "
                "the job stops")
    return None


def _faults_of(core: JobCore, rank: int) -> list[Incident]:
    """The numeric faults that named ``rank`` alone since it was last replaced for them."""
    found: list[Incident] = []
    for incident in core.incidents:
        if incident.kind is not IncidentKind.NUMERIC or incident.rank != rank:
            continue
        if incident.detail.get("faulty_rank"):
            found = []  # a new process since: its own count starts
        elif (incident.detail.get("verdict") in _RANK_VERDICTS
              and incident.detail.get("ranks") == [rank]):
            found.append(incident)
    return found


def _replace_if_found_again(core: JobCore, recoveries: Recoveries, rank: int) -> None:
    """A rank at fault ``FAULTS_TO_REPLACE`` times is replaced as a crashed one is: killed,
    its exit recovered."""
    faults = _faults_of(core, rank)
    info = core.ranks.get(rank)
    if len(faults) < FAULTS_TO_REPLACE or info is None or core.winding_down \
            or info.state in (RankState.EXITED, RankState.DONE) or info.pid in recoveries.condemned:
        return  # (a rank that finished its steps has nothing left to get wrong)
    # (as requalification finds it: manager.placement.migration)
    host = node_host(core, info.node) or core.config.host
    steps = [i.step for i in faults]
    reason = (f"rank {rank} was found at fault {len(faults)} times (numeric faults at steps "
              f"{', '.join(map(str, steps))}, its gradients changed on replay each time): "
              f"its process is replaced like a crashed one; its host {host} (node {info.node}) "
              "is suspect")
    now = time.time()
    incident = recoveries.new_incident(kind=IncidentKind.NUMERIC, rank=rank, step=info.step + 1,
                                       fault_t=now, detected_t=now, error=reason)
    incident.detail.update(cast(IncidentDetail, {"faulty_rank": True, "host": host,
                                                  "node": info.node,
                                                  "faults": [i.id for i in faults],
                                                  "fault_steps": steps}))
    incident.action = Action.REPLACE.value
    incident.phases["decided"] = now
    core.events.event("faulty_rank", rank=rank, node=info.node, host=host, faults=len(faults),
                      steps=steps, incident=incident.id, reason=reason)
    # no new rank (standby, joining agent, move) placed there until undrained
    if core.config.nnodes > 1 and host:
        quarantine(core, host=host, reason=reason)
        incident.detail.update(cast(IncidentDetail, {"quarantined": True}))
    core.events.incident(incident)
    core.move(JobState.RECOVERING)
    recoveries.condemned[info.pid] = (incident, Decision(Action.REPLACE, reason))
    # its exit carries on in the recovery's usual path: a new process, the state from a peer
    core.kill(rank)


def _report(summary: str, detail: dict[str, Any]) -> str:
    """The stop's report in the job's failure reason: the step and verdict, the values,
    every rank's batch.

    The ranks raise the same text, but the job fails on this incident first:
    their own reports may come after it stopped them, so this one is whole.
    """
    batches = detail.get("batches") or {}
    ordered = sorted(batches.items(), key=lambda item: int(item[0]))
    where = "; ".join(f"rank {r}: {b}" for r, b in ordered)
    return (f"{summary}; values first {detail.get('first')}, replay {detail.get('replay')}"
            + (f"; batches {where}" if where else ""))


def arm_numeric(core: JobCore, kind: str, rank: int, at_step: int | None, how: str | None,
                phase: str | None = None, factor: float | None = None, *,
                due: Callable[[str, int, int | None, str], int]) -> dict[str, Any]:
    """Arm a NaN or a bit flip in a rank's step (``undying inject nan|bitflip``).

    A NaN and a gradient flip strike in backward, before the all-reduce; a
    weight flip at the step's backward too, in the model itself (``phase``
    may be given only as that). ``due`` gives the step it fires at, or refuses
    one it never would (``manager.injection``'s ``Injector.due_step``).
    """
    allowed = _HOWS[kind]
    how = how or allowed[0]
    if how not in allowed or how not in NumericHow:
        raise UsageError(f"how={how!r} does not apply to {kind}; "
                         f"choose one of {', '.join(allowed)}")
    if factor is not None:
        raise UsageError("factor applies to slow only (undying inject slow --factor F)")
    if phase not in (None, "backward"):
        raise UsageError(f"{kind} strikes in backward; phase={phase!r} does not apply "
                         "(leave it out)")
    if rank not in core.ranks:
        raise UsageError(f"rank {rank} does not exist; this job has ranks "
                         f"0..{core.book.world_size - 1}")
    if core.winding_down:
        raise ConflictError(f"job {core.config.job_id} is {core.state.value}; "
                            "nothing to inject into")
    info = core.ranks[rank]
    fault = ArmFault(kind=f"{kind}:{how}", at_step=due(kind, rank, at_step, "backward"),
                     phase="backward")
    core.agents[info.node].arm(rank, fault)
    core.events.event("fault_armed", rank=rank, kind=fault.kind, at_step=fault.at_step,
                      phase=fault.phase)
    return {"injected": kind, "rank": rank, "pid": info.pid, "at_step": fault.at_step,
            "phase": fault.phase, "how": how}
