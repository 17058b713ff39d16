"""Preemption: SIGTERM, a stop step every rank agrees on, the dying gasp,
and an exit within the grace period.

Kubernetes (or a Slurm scheduler) gives a job a grace period between SIGTERM
and SIGKILL. The manager sizes its own from what it measured (the last
checkpoint's size and write speed, two of the slowest steps), asks every rank
where it is, tells all of them the step to stop after, has that step saved
(the dying gasp) and leaves. Whatever happens (a rank too slow, a save that
fails, a SIGTERM at the very end), the job ends PREEMPTED with a checkpoint
named and the steps a relaunch re-runs counted, or says why there is none.

What to do is decided by pure functions (``policy``: what a SIGTERM
does, the stop step, the ending); this module is their executor: it talks to
the ranks, waits within the grace period, looks on disk, and ends the job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from undying.checkpoint import Checkpoint
from undying.checkpoint.gasp import Measurement, recent_dying_gasp
from undying.jobfiles.records import Incident, IncidentKind, IncidentStatus, JobState
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore
from undying.manager.preemption.policy import (
    OnSigterm,
    Outcome,
    Saved,
    fallback_outcome,
    gasp_outcome,
    on_sigterm,
    resume_reruns,
    stop_step,
)
from undying.protocol.worker_wire import CheckpointSaved, Preempt, StopAt, StopProposal, Terminated

__all__ = ["Preemption"]

log = logging.getLogger("undying.manager")


class Preemption:
    def __init__(self, core: JobCore, checkpoints: Checkpoints) -> None:
        self.core = core
        self.checkpoints = checkpoints
        self.view: dict[str, Any] | None = None  # what status shows, once preempted
        self.proposals: dict[int, int] = {}  # rank -> the step it proposes to stop after
        self._gasp: CheckpointSaved | None = None
        self._task: asyncio.Task[None] | None = None

    def grace_period(self) -> tuple[float, str]:
        """Seconds from SIGTERM to every process gone, and how the figure was reached."""
        config = self.core.config
        if config.checkpoint.grace_period > 0:
            return config.checkpoint.grace_period, "--grace-period"
        step_s = self.core.clock.longest_rank_step_s()
        if self.checkpoints.state_bytes and self.checkpoints.write_bytes_per_s:
            m = Measurement(self.checkpoints.state_bytes, self.checkpoints.write_bytes_per_s,
                            "the last checkpoint written")
            return m.grace_period_s() + 2 * step_s, (
                f"{m.bytes} bytes at {m.write_bytes_per_s / 1e6:.1f} MB/s ({m.source}): "
                f"write {m.write_s:.3f}s, x2 margin, at least 5s, plus 2 steps of {step_s:.3f}s")
        return 5.0 + 2 * step_s, "no checkpoint measured yet: 5s plus 2 steps"

    def on_saved(self, message: CheckpointSaved) -> None:
        if self.view is not None and message.kind in ("dying-gasp", "existing"):
            self._gasp = message

    def on_stop_proposal(self, message: StopProposal) -> None:
        self.proposals[message.rank] = message.step
        self.core.events.event("stop_proposed", generation=message.generation, rank=message.rank,
                               step=message.step)

    def on_terminated(self, message: Terminated) -> None:
        """A rank's SIGTERM (its process's, a node's, the job's): the job is preempted,
        unless it is old news."""
        holder = self.core.ranks[message.rank].pid  # (0: its replacement has not started yet)
        if message.pid and message.pid != holder:
            # A process the rank was taken from (its host cut off, fenced, its agent stopping it):
            # old news.
            self.core.events.event("sigterm_stale", rank=message.rank, pid=message.pid,
                                   holder=holder)
            return
        self.core.events.event("sigterm", rank=message.rank)
        self.preempt(f"SIGTERM to rank {message.rank}", rank=message.rank, t=message.t)

    def preempt(self, reason: str, *, rank: int = -1, t: float | None = None) -> None:
        """SIGTERM (to the launcher, or to a worker): agree on a stop step, persist it, leave.

        A second SIGTERM while the dying gasp runs changes nothing: the one under way stands.
        """
        core = self.core
        t = time.time() if t is None else t
        decision = on_sigterm(preempting=self.view is not None, winding_down=core.winding_down)
        if decision is OnSigterm.AGAIN:
            core.events.event("sigterm_again", reason=reason)
            log.warning("job %s: %s: the dying gasp under way stands", core.config.job_id, reason)
            return
        if decision is OnSigterm.IGNORE:
            return
        grace, how = self.grace_period()
        self.view = {"reason": reason, "t": t, "grace_period_s": round(grace, 3),
                     "grace_basis": how}
        core.exit_reason = f"preempted ({reason})"
        core.move(JobState.STOPPING)
        log.warning("job %s: %s: dying gasp within a grace period of %.1fs (%s)",
                    core.config.job_id, reason, grace, how)
        self._task = asyncio.get_running_loop().create_task(self._dying_gasp(rank, t, grace))

    async def _dying_gasp(self, rank: int, t0: float, grace: float) -> None:
        core = self.core
        config = core.config
        assert self.view is not None
        newest = core.book.newest_step()
        incident = Incident(id=len(core.incidents) + 1, kind=IncidentKind.PREEMPT, rank=rank,
                            step=newest, fault_t=t0, recovery=0, action="dump",
                            error=self.view["reason"])
        incident.phases["detected"] = time.time()
        incident.detail["grace_period_s"] = self.view["grace_period_s"]
        core.incidents.append(incident)
        core.events.event("preempt", reason=self.view["reason"], rank=rank,
                          grace_period_s=self.view["grace_period_s"],
                          grace_basis=self.view["grace_basis"])
        deadline = t0 + grace
        reused = None
        if config.checkpoint.gasp_reuse_within > 0:
            reused = await asyncio.to_thread(recent_dying_gasp, self.checkpoints.dir,
                                             within_s=config.checkpoint.gasp_reuse_within)
            if reused is not None and reused.step < newest:
                # Steps were trained since: reusing it would lose them. Write a new one.
                core.events.event("dying_gasp_not_reused", step=reused.step, newest_step=newest)
                reused = None
        stop = -1
        late: list[int] = []
        if reused is not None:
            incident.detail["reused"] = reused.url
            created = reused.manifest.created_at if reused.manifest else 0
            core.events.event("dying_gasp_reused", step=reused.step, path=reused.url,
                              age_s=round(time.time() - created, 3))
            await core.stop_all(config.timeouts.stop_grace)
        else:
            stop, late = await self._stop_at_agreed_step(incident, newest, deadline, grace)
        await self._report(incident, t0, grace, reused, stop, late)

    async def _stop_at_agreed_step(self, incident: Incident, newest: int, deadline: float,
                                   grace: float) -> tuple[int, list[int]]:
        """Every rank stops after one step, saved;
        those still running at the deadline are killed, named."""
        core = self.core
        assert self.view is not None
        live = core.live_ranks()
        # Where is every rank? None runs a step past its answer until told the stop step.
        for r in live:
            core.agent_of(r).tell(r, Preempt(core.generations.current, self.view["reason"]))
        answer_by = time.monotonic() + min(2.0, grace / 4)
        while time.monotonic() < answer_by and not live <= set(self.proposals):
            await asyncio.sleep(0.01)
        stop = stop_step(self.proposals, newest)
        incident.phases["decided"] = time.time()
        core.events.event("stop_step", step=stop, proposals=dict(self.proposals),
                          missing=sorted(live - set(self.proposals)))
        for r in live:
            core.agent_of(r).tell(r, StopAt(stop, max(0.5, deadline - time.time())))
        while time.time() < deadline and core.live_ranks():
            await asyncio.sleep(0.02)
        late = sorted(core.live_ranks())
        if late:
            # Named before they go: who did not make it, and where each was.
            phases = {r: p for a in core.agents.values() for r, p in a.phases().items()}
            killed = [f"rank {r} ({phases.get(r, '?')}, last committed step {core.ranks[r].step})"
                      for r in late]
            incident.detail["killed_ranks"] = late
            core.events.event("grace_exceeded", grace_period_s=round(grace, 3), step=stop,
                              ranks=late, where=killed)
            log.error("job %s: the grace period of %.1fs passed before every rank finished step "
                      "%d; killing %s", core.config.job_id, grace, stop, ", ".join(killed))
            for r in late:  # as Kubernetes would at the deadline: no word, no handler
                core.kill(r)
            await core.stop_all(0.0)
        return stop, late

    async def _report(self, incident: Incident, t0: float, grace: float, reused: Checkpoint | None,
                      stop: int, late: list[int]) -> None:
        """Which checkpoint a relaunch resumes from and what it re-runs
        (``policy``); the job ends."""
        core = self.core
        gasp = self._gasp
        took = round(time.time() - t0, 3)
        outcome = gasp_outcome(all_done=core.book.all_done(), reused=_saved(reused), gasp=gasp,
                               stop=stop, t0=t0,
                               gasp_reuse_s=core.config.checkpoint.gasp_reuse_within)
        if outcome is None:  # no dying gasp stands: what is on disk
            latest = await asyncio.to_thread(self.checkpoints.latest)
            outcome = fallback_outcome(gasp=gasp, stop=stop, late=late, grace=grace,
                                       latest=_saved(latest), committed=core.book.newest_step())
        core.exit_reason = outcome.exit_reason
        if outcome.succeeded:
            incident.settle(IncidentStatus.IGNORED)
            core.events.incident(incident)
            core.end(JobState.SUCCEEDED)
            return
        self._end_preempted(incident, outcome, gasp, stop, late, took)

    def _end_preempted(self, incident: Incident, outcome: Outcome, gasp: CheckpointSaved | None,
                       stop: int, late: list[int], took: float) -> None:
        core = self.core
        assert self.view is not None
        step, path, what = outcome.step, outcome.path, outcome.what
        reruns = resume_reruns(outcome, gasp=gasp, stop=stop,
                               rank_steps=[r.step for r in core.ranks.values()])
        if outcome.gasp_t is not None:
            incident.phases["checkpoint_written"] = outcome.gasp_t
        if gasp is not None and gasp.error:
            incident.detail["dying_gasp_error"] = gasp.error
        incident.phases["exited"] = time.time()
        incident.settle(IncidentStatus.DUMPED if step >= 0 else IncidentStatus.FAILED)
        incident.detail.update({"checkpoint_step": step, "checkpoint": path, "stop_step": stop,
                                "dying_gasp_write_s": gasp.write_s if gasp is not None else None,
                                "sigterm_to_exit_s": took, "resume_reruns": reruns})
        core.events.incident(incident)
        self.view.update({"checkpoint_step": step, "checkpoint": path, "stop_step": stop,
                          "detail": what, "sigterm_to_exit_s": took, "killed_ranks": late,
                          "dying_gasp_write_s": gasp.write_s if gasp is not None else None,
                          "dying_gasp_error": gasp.error if gasp is not None else "",
                          "resume_reruns": reruns})
        core.events.event("preempted", step=step, path=path, detail=what, sigterm_to_exit_s=took,
                          resume_reruns=reruns)
        core.events.set_job("preemption", self.view)
        log.warning("job %s: %s", core.config.job_id, core.exit_reason)
        core.end(JobState.PREEMPTED)


def _saved(checkpoint: Checkpoint | None) -> Saved | None:
    if checkpoint is None:
        return None
    return Saved(checkpoint.step, checkpoint.url, checkpoint.kind, checkpoint.name)
