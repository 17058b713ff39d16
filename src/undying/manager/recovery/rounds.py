"""Recovery: from an incident to the next generation, and the round's timeline until the job trains
again.

An incident opens (or joins) a recovery round. The policy (``policy.decide``,
a pure function) picks the rung: retry in place, replace the rank, restart
every rank from the latest valid checkpoint, or fail. This module carries the
decision out (the executor) and watches the round: it ends when every rank of
the new generation committed a step, with the incident's phases (replacement
ready, group rebuilt, state restored, first step) taken from the ranks' reports.

Every survivor of the generation left behind must leave it (``leave_order.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from undying.checkpoint import Checkpoint
from undying.checkpoint.planner.holdings import RestorePlan
from undying.config import SHOWN_LOG
from undying.jobfiles.records import (
    Incident,
    IncidentKind,
    IncidentStatus,
    JobState,
    RankInfo,
    RankState,
)
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore
from undying.manager.recovery.incident_plan import plan_after
from undying.manager.recovery.leave_order import LeaveOrder
from undying.manager.recovery.policy import Action, Decision, PolicyContext, decide
from undying.manager.recovery.round_record import Recovery
from undying.manager.recovery.starts import Attempts
from undying.protocol.generations import GenerationRecord

__all__ = ["Recoveries"]

log = logging.getLogger("undying.manager")
shown = logging.getLogger(SHOWN_LOG)  # (a line a person reads at INFO: the launcher shows it)


class Recoveries:
    def __init__(self, core: JobCore, checkpoints: Checkpoints) -> None:
        self.core = core
        self.checkpoints = checkpoints
        self.current: Recovery | None = None
        self.count = 0
        self.restarts = 0
        self.restart_from: Checkpoint | None = None
        self.attempts = Attempts(core.config.job_dir)  # a whole-group restart's processes
        # the planner's word on the incident decided last
        self.restore_plan: RestorePlan | None = None
        # pid -> the incident and decision its exit carries on (a live rank escalated from retries,
        # killed).
        self.condemned: dict[int, tuple[Incident, Decision]] = {}
        # Every rank of a lost node is replaced in the same new generation: set while they are
        # handled.
        self.one_generation = False
        self._shared_record: GenerationRecord | None = None
        # A rank said hello: the script uses the step API even if the launcher's look at it said
        # otherwise.
        self.hello_seen = False
        # Told of the first incident of each new round, before it is decided: e.g. a planned move
        # the round overtakes is cancelled first (manager.placement.migration), so its last holder
        # keeps the rank.
        self.round_opened: list[Callable[[Incident], None]] = []
        # Stuck ranks kept as the last holders of state (a recovery's survivor, a regroup's
        # member; recovery/left_behind.py): pid -> when kept. Waited for until their collective's
        # own timeout can end it (``spared``).
        self.kept: dict[int, float] = {}

    @property
    def step_api(self) -> bool:
        """Whether the script uses undying's step API (else a fault restarts the whole group)."""
        return self.core.config.step_api or self.hello_seen

    def new_incident(self, *, kind: IncidentKind, rank: int, step: int, fault_t: float,
                     detected_t: float, error: str = "", traceback: str = "") -> Incident:
        """An incident of the round under way (or of a new round)."""
        opened = self.current is None
        if self.current is None:
            self.count += 1
            self.current = Recovery(id=self.count, generation=self.core.generations.current)
        incidents = self.core.incidents
        incident = Incident(id=len(incidents) + 1, kind=kind, rank=rank, step=step,
                            fault_t=min(fault_t, detected_t), recovery=self.current.id, error=error,
                            traceback=traceback)
        incident.phases["detected"] = detected_t
        incidents.append(incident)
        self.current.incidents.append(incident)
        # (a planned move's own incident overtakes nothing)
        if opened and kind is not IncidentKind.MIGRATION:
            for told in self.round_opened:
                told(incident)
        return incident

    def end_shared_generation(self) -> None:
        self.one_generation, self._shared_record = False, None

    def _replaced(self) -> set[int]:
        return self.current.replaced if self.current else set()

    def holders_alive(self, excluding: int) -> int:
        """Ranks whose processes live and hold the state (not replacements waiting for it)."""
        return len(self.core.ranks) - len(self._holding_nothing(excluding))

    def _holding_nothing(self, rank: int) -> set[int]:
        """``rank`` and every rank whose process is gone or is a replacement waiting for state."""
        replaced = self._replaced()
        return {r.rank for r in self.core.ranks.values()
                if r.rank == rank or r.state is RankState.EXITED or r.rank in replaced}

    def kill_keeps_state(self, rank: int) -> bool:
        """Whether killing ``rank`` (a survivor that never left the old generation) leaves the
        round's state as whole as it is: every shard it holds is held by a live rank too, or the
        round reads the checkpoint anyway. Killing the last holder of a step fails the job (or
        rolls it back) for certain; waiting gives the stuck rank's collective the chance to end.
        """
        if not self.step_api:
            return True  # nothing of undying's to keep: every rank starts again anyway
        found, _, _ = plan_after(self.core, self.checkpoints, self._holding_nothing(rank))
        if found is None:
            return False
        current = self.restore_plan
        return not found.needs_checkpoint or (current is not None and current.needs_checkpoint)

    def spared(self, now: float) -> set[int]:
        """The kept pids still waited for. gloo ends a collective stuck on a send it never wakes
        only at its own timeout (``--collective-timeout``); the rank then leaves with its state.
        Until then, and a heartbeat's time to say so, neither the step timeout nor the recovery
        timeout ends it (``Detection.on_stall``, ``overdue``)."""
        timeouts = self.core.config.timeouts
        bound = timeouts.collective_timeout + timeouts.heartbeat_timeout
        return {pid for pid, since in self.kept.items() if now - since < bound}

    def plan(self, incident: Incident) -> tuple[RestorePlan | None, str]:
        """Where every rank's state comes from after this incident, and its words
        (``incident_plan.py``); the checkpoint it read, if any, is the restart rung's."""
        found, words, self.restart_from = plan_after(self.core, self.checkpoints,
                                                     self._holding_nothing(incident.rank))
        return found, words

    def handle(self, incident: Incident) -> None:
        """Decide the rung for ``incident`` by the restore plan and the policy, and carry it out."""
        core = self.core
        if self.step_api:
            found, words = self.plan(incident)
            incident.detail["restore_plan"] = words
        else:  # (no state of the script's is undying's to plan: every rank starts again)
            found, words, self.restart_from = None, "", None
        self.restore_plan = found
        # Ranks that keep state through this recovery: none when every rank must start from the
        # checkpoint.
        holders = self.holders_alive(incident.rank)
        if found is not None and found.needs_checkpoint and not self.checkpoints.sharded:
            holders = 0  # (sharded ranks roll back to the checkpoint in place: they live on)
        # (what every rank's process raised at the whole group's starts: read only without steps)
        last, this = self.attempts.words(core.ranks.values(), read=not self.step_api)
        decision = decide(
            incident, core.incidents,
            PolicyContext(core.config.max_restarts, holders, core.config.max_retries,
                          checkpoint_step=self.restart_from.step if self.restart_from else None,
                          restarts=self.restarts,
                          max_step_recoveries=core.config.max_step_recoveries,
                          step_api=self.step_api, world_size=core.book.world_size,
                          trained=core.book.newest_step() > 0,
                          last_start=last, this_start=this,
                          # (a failed collective loses no process: its retry needs no state from
                          # anyone)
                          no_state=words if found is None
                          and incident.kind is not IncidentKind.COMM_ERROR else ""),
        )
        incident.action = decision.action.value
        incident.phases["decided"] = time.time()
        incident.detail["reason"] = decision.reason
        core.events.event("decided", rank=incident.rank, incident=incident.id,
                          action=decision.action.value, reason=decision.reason)
        log.warning("job %s gen %d: %s of rank %d at step %d -> %s (%s)", core.config.job_id,
                    core.generations.current, incident.kind, incident.rank, incident.step,
                    decision.action.value, decision.reason)
        if decision.action is Action.FAIL:
            incident.settle(IncidentStatus.FAILED)
            core.events.incident(incident)
            report = decision.reason
            if incident.traceback:
                report += "\n" + incident.traceback
            core.fail(report)
            return
        core.events.incident(incident)
        core.move(JobState.RECOVERING)
        info = core.ranks[incident.rank]
        if decision.action is Action.REPLACE and info.state is not RankState.EXITED:
            # Escalated from retries: the process lives. Kill it; its exit carries on here.
            self.condemned[info.pid] = (incident, decision)
            core.kill(incident.rank)
            return
        self.execute(incident, decision)

    def execute(self, incident: Incident, decision: Decision) -> None:
        """Carry out a retry, a replacement or a restart: the next generation and who joins it."""
        core = self.core
        previous = core.generations.current
        if self._shared_record is not None and decision.action is Action.REPLACE:
            record = self._shared_record
        else:
            record = core.open_generation(
                f"{incident.kind} of rank {incident.rank}: {decision.action.value}")
            if self.one_generation:
                self._shared_record = record
        assert self.current is not None
        if decision.action is not Action.RESTART:
            # Nothing failed by itself in a stuck collective or a link's retry: every rank is told
            # to leave. A replaced rank's process is gone: its peers find that out by themselves.
            stuck = bool(incident.detail.get("stuck_collective"))
            abort = stuck or decision.action is Action.RETRY
            # A lost process: a step no rank completed can finish nowhere, and its survivors are
            # told so at once (the leave order still watches those finishing an earlier step).
            self.tell_to_leave(previous, f"stuck collective: {decision.action.value}" if stuck else
                               f"{incident.kind} of rank {incident.rank}: {decision.action.value}",
                               abort=abort,
                               from_step=0 if abort else core.book.newest_step() + 1)
        self.current.renew(record.generation)
        if decision.action is Action.REPLACE:
            warm = self.replace_in_round(incident.rank, record)
            incident.detail["replacement"] = "warm spare" if warm else "new process"
            core.events.incident(incident)
        elif decision.action is Action.RESTART and self.restart_from is None:
            self._restart_group(incident, record)
        elif decision.action is Action.RESTART:
            # (the plan that read the checkpoint named restart_from)
            assert self.restore_plan is not None
            self._restart_all(incident, record, self.restore_plan)

    def replace_in_round(self, rank: int, record: GenerationRecord) -> bool:
        """A new process for ``rank`` joins the round in ``record`` (True: a warm spare)."""
        assert self.current is not None
        self.current.replaced.add(rank)
        self.current.ready.pop(rank, None)
        return self.core.spawn(rank, record, joining=True)

    def tell_to_leave(self, previous: int, reason: str, *, abort: bool, from_step: int = 0) -> None:
        """Every rank with a process must leave generation ``previous``; ``abort``: it is told to at
        once (one that already left ignores it), else only watched for now (``leave_order.py`` says
        when). ``from_step``: watched, and told at once to leave any step from that one on, which
        no rank completed (``worker_wire.Abort``)."""
        assert self.current is not None
        core = self.core
        order = LeaveOrder(previous, reason, time.time(), aborted=abort)
        for info in core.ranks.values():
            if info.state is RankState.EXITED:
                continue
            if abort:
                core.agents[info.node].abort(info.rank, previous, reason)
            elif from_step and info.state is RankState.RUNNING:
                core.agents[info.node].abort(info.rank, previous, reason, from_step=from_step)
            if info.state is RankState.RUNNING:
                order.told[info.rank] = info.pid
        self.current.leave = order

    def lingering(self, now: float, resumed: float = 0.0) -> tuple[list[RankInfo], list[RankInfo]]:
        """Survivors of the round's leave order still in the old generation: (to tell now, stuck).

        A replacement of this round is no survivor and is not judged here; a newer generation than
        the round's (a regroup renumbered the ranks) makes the order old news.
        """
        recovery = self.current
        if (recovery is None or recovery.leave is None
                or recovery.generation != self.core.generations.current):
            return [], []
        order, ranks, generation = recovery.leave, self.core.ranks, recovery.generation
        longest = self.core.clock.longest_rank_step_s()
        survivors = [i for i in order.abort_due(ranks, generation, now, resumed, longest)
                     if i.rank not in recovery.replaced]
        stuck = [i for i in order.stuck(ranks, generation, now, resumed, longest)
                 if i.rank not in recovery.replaced]
        return survivors, stuck

    def stuck(self, now: float, resumed: float = 0.0) -> list[RankInfo]:
        """Survivors told to leave the old generation that neither failed nor joined the new one in
        time."""
        return self.lingering(now, resumed)[1]

    def _restart_group(self, incident: Incident, record: GenerationRecord) -> None:
        """torchrun's recovery for a script that does not use the step API (or a job that lost every
        rank before its first step): every rank starts again, now.

        Every live rank is killed (its peers of the old group would wait on the
        dead one forever) and every rank, a finished one too, gets a new
        process in the new generation, from the script's start: a script that
        saves its own snapshot loads it. No rank of such a script commits a
        step, so the round ends here, with the new processes started.
        """
        core = self.core
        assert self.current is not None
        self.restarts += 1
        self.attempts.restarting(core.ranks.values())
        for info in core.ranks.values():
            if info.state is not RankState.EXITED:
                core.kill(info.rank)
        core.book.finished.clear()
        for info in core.ranks.values():
            self.current.replaced.add(info.rank)
            core.spawn(info.rank, record, joining=False, restart=True)
        started = time.time()
        incident.detail.update({"restart": self.restarts,
                                "replacement": "every rank: new processes"})
        core.events.event("restarted", generation=record.generation, step=0, path="",
                          kind="whole-group", lost_steps=0, restart=self.restarts)
        log.warning("job %s gen %d: every rank starts again (whole-group restart %d of at most %d)",
                    core.config.job_id, record.generation, self.restarts, core.config.max_restarts)
        for settled in self.current.incidents:
            if settled.status is IncidentStatus.OPEN:
                settled.phases["replacement_ready"] = started
                settled.settle(IncidentStatus.RECOVERED)
                settled.detail["generation"] = record.generation
            core.events.incident(settled)
        self.current = None
        core.move(JobState.RUNNING)

    def _restart_all(self, incident: Incident, record: GenerationRecord, plan: RestorePlan) -> None:
        """The restart rung: new processes for every rank, all starting from the checkpoint ``plan``
        names (the latest valid one, read when no step had every shard in memory).

        Replacements already started for the dead ranks wait for a donor that no
        longer exists: they are killed too. The steps since the checkpoint are
        re-run (and counted as lost).
        """
        core = self.core
        assert self.current is not None and self.restart_from is not None
        ckpt = self.restart_from
        assert plan.checkpoint_path == ckpt.url, (plan.checkpoint_path, ckpt.url)
        self.restarts += 1
        newest = core.book.newest_step()
        for info in core.ranks.values():
            if info.state is not RankState.EXITED:
                core.kill(info.rank)
        for info in core.ranks.values():
            self.current.replaced.add(info.rank)
            self.current.ready.pop(info.rank, None)
            core.spawn(info.rank, record, joining=False, resume_from=plan.checkpoint_path,
                       restart=True)
        lost = max(0, newest - ckpt.step)
        incident.detail.update({"checkpoint": ckpt.url, "checkpoint_step": ckpt.step,
                                "lost_steps": lost, "restart": self.restarts})
        core.events.event("restarted", generation=record.generation, step=ckpt.step, path=ckpt.url,
                          kind=ckpt.kind, lost_steps=lost, restart=self.restarts)
        core.events.incident(incident)
        log.warning("job %s gen %d: every rank restarts from %s (step %d); steps %d..%d are re-run",
                    core.config.job_id, record.generation, ckpt.url, ckpt.step, ckpt.step + 1,
                    newest)

    def on_joined(self, rank: int, t: float) -> None:
        """A rank's process joined its generation: a replacement is ready (and the script uses the
        step API)."""
        self.hello_seen = True
        if self.current is not None and rank in self.current.replaced:
            self.current.ready[rank] = t

    def on_progress(self, rank: int, generation: int, step: int, phase: str, detail: dict[str, Any],
                    t: float) -> None:
        """A rank's progress in the round's generation: the phases of the incidents' timeline."""
        recovery = self.current
        if recovery is None or generation != recovery.generation:
            return
        if phase in ("shards_restored", "rolled_back") and rank == 0:
            # What the ranks did, which the plan made at the incident could only foresee.
            for incident in recovery.incidents:
                incident.detail["restored"] = detail.get("plan") or detail.get("reason", "")
                incident.detail["lost_steps"] = int(detail.get("lost_steps", 0))
                if phase == "rolled_back":
                    incident.detail["checkpoint"] = detail.get("checkpoint", "")
                self.core.events.incident(incident)
        if phase == "group_rebuilt":
            recovery.group_rebuilt[rank] = t
        elif phase == "state_restored":
            recovery.state_restored[rank] = t
            recovery.restored_step = step

    def maybe_finish(self, rank: int, t: float, *, message_generation: int) -> bool:
        """A rank's first step in the round's generation; True when it was the last one's (the round
        is over)."""
        recovery = self.current
        core = self.core
        if recovery is None or message_generation < recovery.generation:
            return False
        recovery.first_step.setdefault(rank, t)
        if len(recovery.first_step) < core.book.world_size:
            return False
        phases = {
            "replacement_ready": (max(recovery.ready.values())
                                  if recovery.replaced and recovery.ready else None),
            "group_rebuilt": (max(recovery.group_rebuilt.values())
                              if recovery.group_rebuilt else None),
            "state_restored": (max(recovery.state_restored.values())
                               if recovery.state_restored else None),
            "first_step_done": max(recovery.first_step.values()),
        }
        for incident in recovery.incidents:
            if incident.status is not IncidentStatus.OPEN:
                continue
            incident.phases.update({k: v for k, v in phases.items() if v is not None})
            incident.settle(IncidentStatus.RECOVERED)
            incident.detail["generation"] = recovery.generation
            incident.detail["restored_step"] = recovery.restored_step
            core.events.incident(incident)
            # (INFO, shown: the fault was the warning; config/console.py)
            shown.info("job %s gen %d: recovered from %s of rank %d in %.2f s, restored step %d",
                       core.config.job_id, recovery.generation, incident.kind, incident.rank,
                       incident.mttr_s or -1.0, recovery.restored_step)
        self.current = None
        if core.state is JobState.RECOVERING:
            core.move(JobState.RUNNING)
        return True

    def fail(self, reason: str) -> None:
        """The round cannot complete: its incidents failed, and the job with them."""
        if self.current is not None:
            for incident in self.current.incidents:
                if incident.status is IncidentStatus.OPEN:
                    incident.settle(IncidentStatus.FAILED)
                self.core.events.incident(incident)
        self.core.fail(reason)

    def overdue(self, now: float, resumed: float = 0.0) -> str:
        """Why the round is past the recovery timeout, or "" (a lost node's round waits for
        --node-wait).

        The timeout counts from the round's start or from ``resumed``, the manager's return from a
        stall of its own (``protocol/judge_clock.py``), whichever is later.
        """
        recovery = self.current
        timeouts = self.core.config.timeouts
        if recovery is None or now - max(recovery.started, resumed) <= timeouts.recovery_timeout:
            return ""
        if self.spared(now):
            return ""  # a last holder of the state is waited for (``spared``)
        return (f"recovery {recovery.id} did not complete within {timeouts.recovery_timeout:.0f}s "
                f"(generation {recovery.generation}; ranks with a first step: "
                f"{sorted(recovery.first_step)})")
