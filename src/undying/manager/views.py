"""What the manager shows: the job's status as one JSON object (the API, the page, the CLI and the metrics read it)."""

from __future__ import annotations

from typing import Any

from undying.config import WHOLE_GROUP_LINE
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore
from undying.manager.preemption import Preemption
from undying.manager.recovery import Recoveries
from undying.manager.regrouping import Regrouping
from undying.manager.state import RankState
from undying.manager.trace_control import TraceControl

__all__ = ["job_status", "rank_views"]


def job_status(core: JobCore, *, checkpoints: Checkpoints, preemption: Preemption, recoveries: Recoveries,
               regrouping: Regrouping, trace: TraceControl) -> dict[str, Any]:
    config = core.config
    grace, basis = preemption.grace_period()
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
        "recovery_mode": "" if recoveries.step_api else WHOLE_GROUP_LINE.format(max_restarts=config.max_restarts),
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
        "trace": trace.status(),
        "step_times": [list(p) for p in core.clock.step_times],
        "ranks": rank_views(core),
        "nodes": [a.view() for a in core.agents.values()],
        "incidents": [i.to_dict() for i in core.incidents],
    }


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
