"""The ranks' and nodes' comings and goings: a process started, a rank joined, a node joined; a rank
exited, a node was lost, ranks finished.

Each is a report of an agent (``node_wire``) or a worker's first word (``Hello``);
this part keeps the book of who is in the job and hands what is a fault to
recovery, what belongs to a regroup or a planned move to theirs, and ends the
job once every rank finished.
"""

from __future__ import annotations

import signal

from undying.jobfiles.records import JobState, RankInfo, RankState
from undying.manager.checkpoints import Checkpoints
from undying.manager.core import JobCore
from undying.manager.integrity import Divergence
from undying.manager.placement import Migrations
from undying.manager.recovery import Detection, LeftBehind, Recoveries
from undying.manager.regroup import Regrouping
from undying.protocol.worker_wire import Hello

__all__ = ["Comings"]


class Comings:
    """Who comes and goes: each arrival and departure of a rank's process or a node's agent."""

    def __init__(self, core: JobCore, *, checkpoints: Checkpoints, recoveries: Recoveries,
                 detection: Detection, regrouping: Regrouping, migrations: Migrations,
                 divergence: Divergence, left_behind: LeftBehind) -> None:
        self.core = core
        self.left_behind = left_behind
        self.checkpoints = checkpoints
        self.recoveries = recoveries
        self.detection = detection
        self.regrouping = regrouping
        self.migrations = migrations
        self.divergence = divergence
        # node -> its agent's session (a restarted manager honours them)
        self.sessions: dict[int, str] = {}

    # --- arrivals ----------------------------------------------------------------

    def on_spawned(self, rank: int, pid: int, warm: bool, incarnation: int) -> None:
        """A node across the network started the process of a rank
        (a spawn returns before it knows)."""
        info = self.core.ranks[rank]
        if incarnation != info.incarnation:
            return  # a process the rank was taken from since: fenced by the owner key
        info.pid = pid
        self.core.events.event("started", generation=info.generation, rank=rank, pid=pid,
                               spare=warm, incarnation=incarnation)
        self.core.book.persist(info)
        # (a moved rank's replacement on another host: what it was)
        self.migrations.on_spawned(rank, warm)
        recovery = self.recoveries.current
        # (a stuck spare's rank goes to another spare or a new process: said as it is)
        if recovery is not None:
            for incident in recovery.incidents:
                if incident.rank == rank and "replacement" in incident.detail:
                    incident.detail["replacement"] = "warm spare" if warm else "new process"

    def on_hello(self, message: Hello) -> None:
        info = self.core.ranks[message.rank]
        if message.incarnation and message.incarnation != info.incarnation:
            # A process the rank was taken from since (fenced by the owner key), e.g. a cancelled
            # move's replacement on its way out: taking its pid would judge its kill a crash of
            # the rank, whose process (perhaps the only holder of the state) still runs.
            self.core.events.event("hello_ignored", generation=message.generation,
                                   rank=message.rank, pid=message.pid,
                                   incarnation=message.incarnation)
            return
        self.core.events.event("joined", generation=message.generation, rank=message.rank,
                               pid=message.pid, joining=message.joining)
        info.pid = message.pid
        info.last_seen = message.t
        info.state = RankState.RECOVERING if message.joining else RankState.STARTING
        self.recoveries.on_joined(message.rank, message.t)
        # (a moved rank's replacement, started ahead, is ready)
        self.migrations.on_hello(message.rank, message.t)
        self.core.book.persist(info)

    def on_node_joined(self, node: int, session: str, host: str, live: dict[int, int]) -> None:
        events = self.core.events
        events.event("node_joined", node=node, session=session, host=host, live=live)
        self.sessions[node] = session
        events.set_job("sessions", self.sessions, flush=True)
        agent = self.core.agents.get(node)  # its welcome carried the trace switch
        if agent is not None and self.core.state is not JobState.STARTING:
            agent.keep_spares()
        if self.regrouping.active:
            self.regrouping.maybe_form_world()
        else:
            self.regrouping.maybe_grow()

    # --- departures --------------------------------------------------------------

    def on_exit(self, rank: int, pid: int, returncode: int, t: float) -> None:
        core = self.core
        core.events.event("exited", generation=core.generations.current, rank=rank, pid=pid,
                          returncode=returncode)
        # a moving rank's old process: the rank is its again
        self.migrations.before_exit(pid, returncode)
        # a kept survivor's exit (recovery/left_behind.py) is judged as any other; its pid may recur
        self.recoveries.kept.pop(pid, None)
        info = core.ranks.get(rank)
        if info is None or pid != info.pid:
            # a process already replaced (or numbered before a regroup); its exit is old news
            return
        finished_steps = info.state is RankState.DONE
        info.state = RankState.EXITED
        info.last_seen = t
        core.book.persist(info)
        if core.winding_down:
            return
        if self.regrouping.active:
            self.regrouping.member_exited(info, pid, returncode, t)
            return
        if self.migrations.on_exit(info, pid, returncode, t):
            return  # a planned move: its replacement is under way
        # A rank is finished when it exits cleanly, or when the job's final
        # barrier completed on some rank: then this one passed it too. A clean
        # exit before its last step is held: it may have left early (recovery/leaving.py).
        if self.detection.finished(returncode, finished_steps):
            if (returncode == 0 and not finished_steps
                    and self.detection.leavers.on_clean_exit(info, pid, t)):
                self.finish(*self.detection.leavers.all_left())
                return
            if returncode != 0:
                core.events.event("exit_after_done", rank=rank, returncode=returncode)
            self.finish(info)
            return
        if self.left_behind.on_exit(info, pid):
            return  # a survivor killed for never leaving the old generation: replaced in its round
        condemned = self.recoveries.condemned.pop(pid, None)
        if condemned is not None:
            self.recoveries.execute(*condemned)
            return
        self.detection.on_fault_exit(info, pid, returncode, t)

    def on_node_lost(self, node: int, reason: str, t: float) -> None:
        """Every process of ``node`` is gone or out of reach:
        its ranks are recovered like crashed ones.

        The survivors may be blocked on a peer that will never answer (a
        link cut rather than a process killed sends no reset), so every rank
        elsewhere is told to leave the old generation at once.
        """
        core = self.core
        core.events.event("node_lost", node=node, reason=reason)
        if core.winding_down or node not in core.book.nodes:
            return  # (a node the job does not train on: an elastic job's extra one)
        lost = [r for r in core.ranks.values()
                if r.node == node and r.state not in (RankState.EXITED, RankState.DONE)]
        # Ranks that reported their last step done and had not exited yet: no exit will come
        # now, and the job would wait for one for ever. Their part is done.
        done = [r for r in core.ranks.values() if r.node == node
                and r.state is RankState.DONE and r.rank not in core.book.finished]
        if done:
            self.finish(*done)
            if core.winding_down:
                return  # (that was the job's end)
        previous = core.generations.current
        for info in lost:
            self.detection.node_lost[info.pid] = (node, reason, t)
        # every rank of the node is replaced in the same new generation
        self.recoveries.one_generation = True
        try:
            for info in lost:
                self.on_exit(info.rank, info.pid, -int(signal.SIGKILL), t)
        finally:
            self.recoveries.end_shared_generation()
        for info in core.ranks.values():
            if (info.node != node and info.state is not RankState.EXITED
                    and info.generation <= previous):
                core.agents[info.node].abort(info.rank, previous, f"node {node} lost")

    # --- the job's end -------------------------------------------------------------

    def finish(self, *ranks: RankInfo) -> None:
        """These ranks' part of the job is done
        (then ranks held as perhaps early leavers may be too)."""
        for info in ranks:
            info.state = RankState.DONE
            self.core.book.finished.add(info.rank)
            self.core.book.persist(info)
        if ranks and self.detection.leavers.pending:
            self.finish(*self.detection.leavers.all_left())
        self._maybe_succeeded()

    def _maybe_succeeded(self) -> None:
        """Every rank finished: the job moves through STOPPING to SUCCEEDED
        (the only way it succeeds)."""
        core = self.core
        if len(core.book.finished) != len(core.ranks):
            return
        checkpoints = self.checkpoints
        last = checkpoints.last["step"] if checkpoints.last else \
            checkpoints.resumed_from["step"] if checkpoints.resumed_from else None
        core.exit_reason = ("every rank finished its last step"
                            + core.health.warning(core.book.newest_step(), last)
                            + self.divergence.warning())
        core.move(JobState.STOPPING)
        core.end(JobState.SUCCEEDED)
