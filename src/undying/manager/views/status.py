"""What the manager shows: the job's status as one JSON object (the API, the page, the CLI and the
metrics read it)."""

from __future__ import annotations

import time
from typing import Any

from undying.config import WHOLE_GROUP_LINE
from undying.jobfiles.goodput import Goodput, account
from undying.jobfiles.progress import Progress, compute
from undying.jobfiles.records import RankState
from undying.jobfiles.restarts import has_steps
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore
from undying.manager.preemption import Preemption
from undying.manager.recovery import Recoveries
from undying.manager.regroup import Regrouping
from undying.manager.tracing import TraceControl

__all__ = ["job_status", "rank_views", "job_progress", "job_goodput"]


def job_status(core: JobCore, *, checkpoints: Checkpoints, preemption: Preemption,
               recoveries: Recoveries, regrouping: Regrouping, trace: TraceControl,
               standbys: list[dict[str, Any]]) -> dict[str, Any]:
    config = core.config
    grace, basis = preemption.grace_period()
    incidents = [i.to_dict() for i in core.incidents]
    return {
        "job_id": config.job_id,
        "state": core.state.value,
        "generation": core.generations.current,
        "world_size": core.book.world_size,
        "nodes_in_use": list(core.book.nodes),
        "elastic": {"min_nodes": config.fewest_nodes, "max_nodes": config.nnodes},
        "regroup": regrouping.regroup.view() if regrouping.regroup is not None else None,
        "started_at": core.started_at,
        "step": core.book.slowest_step(),
        "rerun_steps": sorted(core.book.rerun_steps),
        "spares_ready": sum(a.spares_ready() for a in core.agents.values()),
        "exit_reason": core.exit_reason,
        "recovery_mode": ("" if recoveries.step_api
                          else WHOLE_GROUP_LINE.format(max_restarts=config.max_restarts)),
        # (a script that never calls job.steps: no step or goodput, its restarts instead)
        "has_steps": has_steps(step_api=recoveries.step_api, planned=core.clock.plan is not None,
                               committed=len(core.clock.ledger) > 0),
        "max_restarts": config.max_restarts,
        "checkpoints": {
            "dir": checkpoints.dir,
            "last": checkpoints.last,
            "resumed_from": checkpoints.resumed_from,
            "grace_period_s": round(grace, 3),
            "grace_basis": basis,
            "restarts": recoveries.restarts,
            "health": core.health.view(),
        },
        "preemption": preemption.view,
        # Under Slurm: its job id and how many times it was requeued (SLURM_RESTART_COUNT)
        "slurm": core.events.job_fact("slurm"),
        "trace": trace.status(),
        "step_times": [list(p) for p in core.clock.step_times],
        "progress": job_progress(core).to_dict(),
        "goodput": job_goodput(core, incidents).to_dict(),
        "ranks": rank_views(core),
        "nodes": [a.view() for a in core.agents.values()],
        # drained or quarantined: no new ranks there (manager/placement/hosts.py)
        "hosts_out": core.hosts.view(),
        "standbys": standbys,  # parked agents with no node yet: where a lost or moved node goes
        "incidents": incidents,
    }


def job_progress(core: JobCore) -> Progress:
    """Step of total, epoch, rate, ETA and the last values given to ``step.log``
    (``progress.compute``)."""
    clock = core.clock
    return compute(core.book.slowest_step(), clock.plan, clock.job_steps.recent,
                   world_size=core.book.world_size,
                   values=clock.job_steps.last_values, running=not core.winding_down)


def job_goodput(core: JobCore, incidents: list[dict[str, Any]]) -> Goodput:
    """The job's goodput so far (to its end once it ended), with its losses named
    (``goodput.account``)."""
    ended = core.state.terminal
    clock = core.clock
    return account(clock.ledger, incidents, clock.stalls, start=core.started_at,
                   end=core.machine.since if ended else time.time(), ended=ended,
                   folded_stall_s=clock.folded_stall_s)


def rank_views(core: JobCore) -> list[dict[str, Any]]:
    """The ranks, each with its phase as its agent last heard it (exited ranks have none)."""
    phases: dict[int, str] = {}
    for agent in core.agents.values():
        phases.update(agent.phases())
    views = []
    for info in core.ranks.values():
        view = info.to_dict()
        if info.state is not RankState.EXITED and info.rank in phases:
            view["phase"] = phases[info.rank]
        views.append(view)
    return views
