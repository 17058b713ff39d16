"""Regrouping: an elastic job moves to the nodes it has, losing no completed step.

The live ranks meet in a regroup generation of their own, renumbered, agree
on one state as in any recovery (the newest step one of them holds cleanly)
and save it; every one then leaves, and the job starts again on the nodes it
has from that checkpoint. A new world size changes what every rank's script
builds (samplers, schedules), hence new processes rather than survivors
renumbered in place, as torchrun restarts its workers when an elastic job's
membership changes. A sharded state is not whole on the survivors (a lost
node's shards and their replicas were there): it starts again from the
latest persisted checkpoint, its steps since re-run. The regroup's record and
what a second fault makes of it are in ``regroup.record``; when to
grow, form the world, wait, re-plan or fail is decided by the pure functions of
``regroup.policy``, and which state the members save and the new
world starts from by the one restore planner (``checkpoint.planner.plan_regroup``);
this module carries them out.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from undying.checkpoint.planner import PersistedState, plan_regroup
from undying.config import planned_leave_grace
from undying.jobfiles.records import IncidentKind, JobState, RankInfo, RankState
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore
from undying.manager.recovery import (
    Detection,
    LeaveOrder,
    Recoveries,
    describe_exit,
    keep_stuck,
)
from undying.manager.regroup.policy import (
    Replan,
    WorldNext,
    form_world,
    grow,
    overdue,
    replan,
    waiting_for_members,
)
from undying.manager.regroup.record import LOG_KEY, SAVED_KINDS, Regroup

__all__ = ["Regrouping"]

log = logging.getLogger("undying.manager")


class Regrouping:
    def __init__(self, core: JobCore, recoveries: Recoveries, checkpoints: Checkpoints,
                 detection: Detection) -> None:
        self.core = core
        self.recoveries = recoveries
        self.checkpoints = checkpoints
        self.detection = detection
        self.regroup: Regroup | None = None
        # The members told to leave their generation, judged as a recovery's survivors are
        # (``recovery.leave_order``); and those killed for never leaving it: pid -> rank.
        self._leave: LeaveOrder | None = None
        self._left_behind: dict[int, int] = {}

    @property
    def active(self) -> bool:
        return self.regroup is not None

    def lost_nodes(self) -> list[int]:
        """Nodes the job trains on whose agent is gone."""
        available = set(self.core.nodes_available())
        return [n for n in self.core.book.nodes if n not in available]

    def maybe_grow(self) -> None:
        """An elastic job below MAX with a node here that it does not train on:
        regroup to take it in.

        Only while the job runs undisturbed: a node that joins during a recovery
        is taken once it completed; none once a rank finished its last step.
        """
        core = self.core
        decision = grow(elastic=core.config.elastic, available=core.nodes_available(),
                        trained=core.book.nodes, nnodes=core.config.nnodes,
                        running=core.state is JobState.RUNNING,
                        recovering=self.recoveries.current is not None,
                        any_done=core.book.any_done())
        if decision is None:
            return
        now = time.time()
        view = core.agents[decision.nodes[0]].view()
        incident = self.recoveries.new_incident(
            kind=IncidentKind.NODE_JOINED, rank=-1, step=core.book.newest_step(),
            fault_t=now, detected_t=now,
            error=f"{decision.named} joined ({view.get('host', '')})")
        incident.action = "regroup"
        incident.phases["decided"] = now
        core.events.incident(incident)
        # Planned, every rank healthy: the members leave at their next step's start.
        self.begin(f"{decision.named} joined: the job grows to {decision.size} nodes", planned=True)

    def begin(self, why: str, *, again: Regroup | None = None, planned: bool = False) -> None:
        """Go on with the nodes the job has now: save the state they hold, then start again from it.

        ``again``: the regroup under way broke (a member lost before the state
        was saved): its live members meet in a new regroup generation.
        ``planned``: no fault (a node joined): the members leave their generation
        at their next step's start rather than mid-step (``worker_wire.Abort``).
        """
        core = self.core
        ranks = core.ranks
        available = set(core.nodes_available())
        for agent in core.agents.values():
            agent.drop_waiting()  # replacements waiting for a lost node's host: no longer wanted
        live = sorted(r for a in core.agents.values() for r in a.live_ranks()
                      if r in ranks and ranks[r].node in available
                      and ranks[r].state is not RankState.EXITED)
        newest = core.book.newest_step()
        regroup = (again.successor(live, newest) if again is not None
                   else Regroup(why=why, members={r: i for i, r in enumerate(live)}, step=newest,
                                first_members=len(live)))
        self.regroup = regroup
        core.move(JobState.RECOVERING)
        sharded = self.checkpoints.sharded
        # The one planner: the members keep their newest step and save it,
        # or the latest checkpoint.
        saving = plan_regroup(members=live, newest=newest, sharded=sharded)
        self._leave = None
        if saving.source.kind == "self":
            previous = core.generations.current
            record = core.open_generation(f"regroup: {regroup.cause()}", members=regroup.members,
                                          purpose="regroup")
            regroup.generation = record.generation
            self.persist()  # (before any member hears of it)
            for rank in live:
                core.agent_of(rank).abort(rank, previous, why, at_step_start=planned)
            # A planned leave may take a member its grace (worker.commands) before it is due.
            due = time.time() + (planned_leave_grace(core.config.timeouts.heartbeat_timeout,
                                                     core.clock.longest_rank_step_s())
                                 if planned else 0.0)
            self._leave = LeaveOrder(previous, why, due, aborted=True,
                                     told={r: ranks[r].pid for r in live})
        else:
            self.persist()
            for rank in live:
                core.kill(rank)
        core.events.event("regroup", why=why, members=live, generation=regroup.generation,
                          step=newest, nodes=sorted(available), sharded=sharded,
                          attempt=regroup.attempt, faults=regroup.faults,
                          restore_plan=saving.describe())
        log.warning("job %s: %s; %s", core.config.job_id, regroup.cause(), saving.reason)
        self.maybe_form_world()

    def maybe_form_world(self) -> None:
        """Once every member left: start the job on the nodes here from the saved state,
        or wait for nodes."""
        core = self.core
        config = core.config
        regroup = self.regroup
        if regroup is None or waiting_for_members(
                regroup, now=time.time(), heartbeat_s=config.timeouts.heartbeat_timeout,
                all_attached=all(a.attached for a in core.agents.values())):
            # (a restarted manager's agents have their heartbeat timeout to come back:
            # the watch retries)
            return
        if regroup.checkpoint is None:
            # The members saved synchronously before they left:
            # the newest valid checkpoint is theirs.
            regroup.checkpoint = self.checkpoints.latest()
        ckpt = regroup.checkpoint
        world = form_world(regroup, checkpoint_step=ckpt.step if ckpt is not None else None,
                           checkpoint_dir=str(self.checkpoints.dir),
                           available=core.nodes_available(),
                           nnodes=config.nnodes, fewest=config.fewest_nodes)
        nodes = world.nodes
        if world.next is WorldNext.FAIL:
            core.fail(world.reason)
            return
        assert ckpt is not None
        if world.next is WorldNext.WAIT_FOR_NODES:
            if world.first_wait:
                regroup.waiting_since = time.time()
                self.persist()
                core.events.event("waiting_for_nodes", nodes=nodes, need=config.fewest_nodes,
                                  checkpoint=ckpt.url, step=ckpt.step)
                log.warning("job %s: the state of step %d is saved (%s); waiting for %d node(s), "
                            "%d here: start `undying run --node-rank I --manager ...` on a host",
                            config.job_id, ckpt.step, ckpt.url, config.fewest_nodes, len(nodes))
            return
        # The one planner: every rank of the new world loads this checkpoint;
        # the steps after it are re-run.
        start = plan_regroup(members=sorted(regroup.members), newest=regroup.step,
                             sharded=self.checkpoints.sharded,
                             checkpoint=PersistedState(ckpt.step, path=ckpt.url))
        lost = start.lost_steps
        before = (list(core.book.nodes), core.book.world_size)
        core.set_layout(nodes, step=ckpt.step)
        # Over, in the same commit as the new generation, before any of its ranks starts: a
        # manager restarted after it carries on that generation, and never starts it twice.
        self.regroup = None
        self.persist(commit=False)
        record = core.open_generation(f"{len(nodes)} node(s) {nodes}, "
                                      f"{core.book.world_size} ranks, from step {ckpt.step}")
        recovery = self.recoveries.current
        # a regroup starts from an incident (a node lost, or one joining)
        assert recovery is not None
        recovery.renew(record.generation)
        recovery.replaced = set(core.ranks)
        recovery.ready.clear()
        for info in core.ranks.values():
            core.spawn(info.rank, record, joining=False, resume_from=start.source.path)
        waited = round(time.time() - regroup.waiting_since, 3) if regroup.waiting_since else 0.0
        detail: dict[str, Any] = {
            "from_nodes": before[0], "from_world_size": before[1], "nodes": nodes,
            "world_size": core.book.world_size, "checkpoint": ckpt.url,
            "checkpoint_step": ckpt.step, "checkpoint_kind": ckpt.kind,
            "waited_for_nodes_s": waited,
            "attempts": regroup.attempt, "faults": regroup.faults,
            "restore_plan": start.describe()}
        for incident in recovery.incidents:
            incident.action = "regroup"
            incident.detail["regroup"] = detail
            incident.detail["lost_steps"] = lost
            incident.phases.setdefault("checkpoint_written", time.time())
            core.events.incident(incident)
        core.events.event("regrouped", generation=record.generation, lost_steps=lost, detail=detail)
        log.warning("job %s gen %d: regrouped on node(s) %s (%d ranks, was %d) from %s (step %d)%s",
                    config.job_id, record.generation, nodes, core.book.world_size, before[1],
                    ckpt.url, ckpt.step,
                    f"; steps {ckpt.step + 1}..{regroup.step} are re-run" if lost
                    else ", no step lost")

    def watch(self, resumed: float = 0.0) -> None:
        """The regroup's clock: re-plan a broken one, let members go once saved, and bound every
        wait (``resumed``: the manager's return from a stall of its own,
        ``regroup_policy.overdue``)."""
        regroup = self.regroup
        assert regroup is not None
        core = self.core
        config = core.config
        now = time.time()
        # a second fault broke it before the save
        again = replan(regroup, now=now, max_retries=config.max_retries)
        if again is Replan.FAIL:
            self.recoveries.fail(f"{regroup.cause()}; the regroup broke {regroup.attempt} times, "
                                 "its limit")
            return
        if again is Replan.AGAIN:
            self.begin(regroup.why, again=regroup)
            return
        self.judge_left_behind(regroup, now, resumed)
        for rank in regroup.to_release():  # the state is saved: whoever is left holds nothing more
            regroup.released.append(rank)
            self.persist()
            core.kill(rank)
        self.maybe_form_world()  # (also what a restarted manager waited for)
        if self.regroup is not regroup:
            return
        saved = regroup.checkpoint
        why = overdue(regroup, now=now, rendezvous_s=config.timeouts.rendezvous_timeout,
                      recovery_s=config.timeouts.recovery_timeout,
                      fewest=config.fewest_nodes, available=core.nodes_available(),
                      saved_step=saved.step if saved is not None else regroup.step,
                      saved_at=saved.url if saved is not None else regroup.saved, resumed=resumed)
        if why and not regroup.waiting_since and self.recoveries.spared(now):
            return  # the unsaved state's last holder is waited for (``Recoveries.spared``)
        if why:
            self.recoveries.fail(why)

    def judge_left_behind(self, regroup: Regroup, now: float, resumed: float) -> None:
        """Kill each member that neither failed nor joined the regroup's generation in time.

        gloo can leave a member's collective waiting out its whole timeout (a
        send it was writing when its connection closed): no fault of its own,
        judged as a recovery's survivor is (``recovery.left_behind``), in
        seconds rather than at the step timeout. Its exit re-plans the regroup
        with the members left, with no incident of its own.

        Unless the state is not saved yet and the member is its last holder (the
        only member left, or any member of a sharded state: its shard is its own):
        then it is waited for, as a recovery's last holder is
        (``recovery/left_behind.py``), with a ``left_behind_kept`` event.
        """
        order, core = self._leave, self.core
        if order is None or regroup.generation != core.generations.current:
            return
        for info in order.stuck(core.ranks, regroup.generation, now, resumed,
                                core.clock.longest_rank_step_s()):
            if info.pid in self._left_behind or info.pid in self.recoveries.kept:
                continue
            waited = round(now - order.t, 3)
            alone = self.checkpoints.sharded or regroup.remaining() == [info.rank]
            if not regroup.saved and alone:
                keep_stuck(self.recoveries, info, now, waited, "the regroup's unsaved")
                continue
            self._left_behind[info.pid] = info.rank
            core.events.event("left_behind", generation=info.generation, rank=info.rank,
                              pid=info.pid, step=info.step + 1, waited_s=waited)
            log.warning("job %s: rank %d (pid %d) still in generation %d %.1fs after the regroup "
                        "told it to leave (gloo never ends its collective's wait); killed, the "
                        "regroup goes on with the members left", core.config.job_id, info.rank,
                        info.pid, info.generation, waited)
            core.kill(info.rank)

    def member_exited(self, info: RankInfo, pid: int, returncode: int, t: float) -> None:
        """A process ended during the regroup: a member leaving as asked,
        a second fault, or old news."""
        regroup = self.regroup
        assert regroup is not None
        # Members leave once the state is saved;
        # any other process of the old layout is no fault now.
        if info.rank not in regroup.members or info.rank in regroup.left:
            return
        if self._left_behind.pop(pid, None) is not None:
            what = f"rank {info.rank} left behind in generation {info.generation}"
            regroup.member_left(info.rank, returncode, what)
            recovery = self.recoveries.current
            for incident in recovery.name_left_behind(info.rank) if recovery is not None else []:
                self.core.events.incident(incident)
            self.persist()
            self.maybe_form_world()
            return
        cause = self.detection.cause_of(info, pid, returncode, t)
        lost, hung = cause.lost, cause.hung
        what = (f"node {lost[0]} lost ({lost[1]})" if lost else
                f"rank {info.rank} hung ({hung[2]} timeout)" if hung else
                f"rank {info.rank} {describe_exit(returncode)}")
        if regroup.member_left(info.rank, returncode, what):
            # A fault: an incident of the regroup's recovery,
            # which re-plans with the members it has left.
            kind = (IncidentKind.NODE_LOSS if lost else IncidentKind.HANG if hung
                    else IncidentKind.CRASH)
            incident = self.recoveries.new_incident(kind=kind, rank=info.rank, step=info.step + 1,
                                                    fault_t=t, detected_t=t,
                                                    error=f"{what} during the regroup")
            incident.action = "regroup"
            incident.phases["decided"] = time.time()
            incident.detail.update({"returncode": returncode, "pid": pid, "node": info.node})
            self.core.events.incident(incident)
            log.warning("job %s gen %d: %s during the regroup; %s", self.core.config.job_id,
                        self.core.generations.current, what,
                        "the state is saved" if regroup.saved else
                        "the members left meet again" if regroup.remaining()
                        else "no member is left")
        self.persist()
        self.maybe_form_world()

    def on_group_broke(self, generation: int, why: str) -> None:
        """A member's collective failed: the regroup re-plans (after the grace), no retry."""
        assert self.regroup is not None
        self.regroup.group_broke(generation, why, self.core.config.timeouts.comm_error_grace)

    def on_saved(self, kind: str, path: str) -> None:
        if self.regroup is not None and kind in SAVED_KINDS:
            self.regroup.on_saved(path)
            self.persist()

    def restore(self, logged: Any) -> None:
        """A restarted manager carries on the regroup under way (its record in the log)."""
        if logged:
            self.regroup = Regroup.from_log(logged)

    def persist(self, *, commit: bool = True) -> None:
        """Write the record to the log, committed at once (``commit``) unless a commit follows.

        Write-ahead: a manager may be SIGKILLed the moment after a member is told
        to leave, let go or started. Its successor knows only what was committed,
        and the agents tell it again only what came after the last commit (a
        member's exit as it left): a record committed late would have it take
        that leave for a crash. So each change is committed before what it
        decided reaches an agent; they are a handful a regroup.
        """
        logged = self.regroup.to_log() if self.regroup is not None else None
        self.core.events.set_job(LOG_KEY, logged, flush=commit)
