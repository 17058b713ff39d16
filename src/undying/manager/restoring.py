"""A restarted manager carries the job on from its log: what the old manager wrote is what this one
knows."""

from __future__ import annotations

import logging

from undying.jobfiles.records import Incident, IncidentStatus, JobState
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore
from undying.manager.placement import LOG_KEY as HOSTS_KEY
from undying.manager.placement import Migrations
from undying.manager.recovery import Recoveries, Recovery
from undying.manager.regroup import LOG_KEY as REGROUP_KEY
from undying.manager.regroup import Regrouping
from undying.manager.views import RunHistory

__all__ = ["restore_job"]

log = logging.getLogger("undying.manager")


def restore_job(core: JobCore, *, checkpoints: Checkpoints, recoveries: Recoveries,
                history: RunHistory,
                regrouping: Regrouping, migrations: Migrations) -> dict[int, str]:
    """Read the job back from its log into the manager's parts; returns the agents' sessions.

    The generation, every rank (its process, step, owner), every incident
    (one still open belongs to a recovery this manager finishes), the
    newest step each rank committed (so a step re-run after the restart is
    still seen) and the checkpoints. The commits are read one by one, never
    held all at once: a restart's memory does not grow with the job's length.
    """
    events = core.events
    saved = events.saved_job()
    job = saved.facts
    core.generations.current = generation = int(job.get("generation", -1))
    core.started_at = float(job.get("started_at", core.started_at))
    core.machine.state = JobState(job.get("state", JobState.RUNNING.value))
    checkpoints.resumed_from = job.get("resumed_from")
    checkpoints.last = job.get("last_checkpoint")
    core.book.rerun_steps = set(job.get("rerun_steps", []))
    if "nodes" in job:
        core.set_layout([int(n) for n in job["nodes"]], persist=False)
    core.book.restore(saved.ranks, saved.newest_steps)
    history.replay(events.path, core.book.world_size)
    core.clock.replay(saved.commits, saved.reports)
    open_incidents: list[Incident] = []
    for incident in saved.incidents:
        core.incidents.append(incident)
        recoveries.count = max(recoveries.count, incident.recovery)
        if incident.status is IncidentStatus.OPEN and not core.health.adopt(incident):
            # (failing saves are no recovery: CheckpointHealth keeps them)
            open_incidents.append(incident)
    if open_incidents:
        recoveries.current = Recovery(id=open_incidents[0].recovery, generation=generation,
                                      incidents=open_incidents)
    regrouping.restore(job.get(REGROUP_KEY))
    migrations.restore(job.get(HOSTS_KEY))
    events.event("manager_restarted", generation=generation, state=core.state.value,
                 incidents=len(core.incidents), open_incidents=[i.id for i in open_incidents])
    log.warning("job %s: carried on from its log: generation %d, %s, %d incident(s), steps up "
                "to %d", core.config.job_id, generation, core.state.value, len(core.incidents),
                core.book.newest_step())
    return {int(n): str(s) for n, s in job.get("sessions", {}).items()}
