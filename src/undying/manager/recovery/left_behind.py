"""A survivor the old generation never let go: killed, and replaced in the round of its fault.

When a recovery opens, every survivor must leave the old generation
(``Recoveries.tell_to_leave``, ``leave_order.py``): one only watched so far is
told to once its step in flight had time to end, and one that has neither
failed nor joined the new generation a while later is stuck
(``Recoveries.stuck``): gloo leaves a send
queued to a peer that went away unsignalled, so the collective waits out its
whole timeout however its sockets end. Such a survivor is no fault of its own:
it is killed and, at its exit, replaced in a new generation of the same round,
named in the round's incidents (``left_behind``) and in a ``left_behind``
event, not counted as another incident.

Unless it is the last holder of the state (``Recoveries.kill_keeps_state``): a
2-rank job's survivor, a shard nobody else holds. Killing it would end the job
(no peer to restore from) or roll it back to the checkpoint; waiting gives its
collective the chance to end and the rank to leave. It is kept, with a
``left_behind_kept`` event and one warning saying why, until it leaves. A
collective stuck on such a send ends at gloo's own timeout
(``--collective-timeout``), and the rank leaves then with its state: until
that timeout (and a heartbeat's time) has passed since it was kept, neither the
step timeout's hang judgement nor the recovery timeout ends it
(``Recoveries.spared``); after it, they judge it as any rank. When it leaves at
last, the round forms a new generation (``on_kept_left``): the ranks that went
on may have given up the one it was late for, since gloo waits for a peer's
connection as long as for a collective.
"""

from __future__ import annotations

import logging

from undying.jobfiles.records import RankInfo
from undying.manager.core import JobCore
from undying.manager.recovery.rounds import Recoveries

__all__ = ["LeftBehind", "keep_stuck"]

log = logging.getLogger("undying.manager")


def keep_stuck(recoveries: Recoveries, info: RankInfo, now: float, waited: float,
               whose: str) -> None:
    """Keep a stuck rank that is the last holder of ``whose`` state (a recovery's survivor, a
    regroup's member): waited for, not killed (``Recoveries.kept``), with the ``left_behind_kept``
    event and one warning."""
    recoveries.kept[info.pid] = now
    core = recoveries.core
    core.events.event("left_behind_kept", generation=info.generation, rank=info.rank,
                      pid=info.pid, step=info.step + 1, waited_s=waited)
    log.warning("job %s: rank %d (pid %d) still in generation %d %.1fs after it was told to "
                "leave; it holds %s state no other rank has, so it is not killed: waiting for it "
                "to leave (a collective stuck in gloo ends at --collective-timeout, %.0fs)",
                core.config.job_id, info.rank, info.pid, info.generation, waited, whose,
                core.config.timeouts.collective_timeout)


class LeftBehind:
    def __init__(self, core: JobCore, recoveries: Recoveries) -> None:
        self.core = core
        self.recoveries = recoveries
        # pids stuck too, but the last holders of state (``keep_stuck``): waited for
        self.kept = recoveries.kept
        # pid -> its rank: killed for never leaving, replaced at its exit
        self.killed: dict[int, int] = {}

    def judge(self, now: float, resumed: float = 0.0) -> None:
        """Tell each watched survivor still in its step to leave; kill each one ``stuck`` (once: its
        exit carries the replacement)."""
        recovery = self.recoveries.current
        if recovery is None or recovery.leave is None:
            return
        order = recovery.leave
        waiting, stuck = self.recoveries.lingering(now, resumed)
        for info in waiting:  # (only while the order is not carried out: then it is, once)
            self.core.agents[info.node].abort(info.rank, order.previous, order.reason)
            order.aborted = True
        for info in stuck:
            if info.pid in self.killed or info.pid in self.kept:
                continue
            waited = round(now - order.t, 3)
            if not self.recoveries.kill_keeps_state(info.rank):
                keep_stuck(self.recoveries, info, now, waited, "the recovery's")
                continue
            self.killed[info.pid] = info.rank
            self.core.events.event("left_behind", generation=info.generation, rank=info.rank,
                                   pid=info.pid, step=info.step + 1, waited_s=waited)
            log.warning("job %s: rank %d (pid %d) still in generation %d %.1fs after it was told "
                        "to leave (its collective waits on a peer that left, and gloo never ends "
                        "that wait); killed and replaced in this recovery", self.core.config.job_id,
                        info.rank, info.pid, info.generation, waited)
            self.core.kill(info.rank)

    def on_kept_left(self, info: RankInfo, generation: int, *, reopen: bool) -> None:
        """A kept rank left ``generation`` at last (its collective ended, at gloo's timeout): it is
        kept no more, and (``reopen``: no regroup re-plans anyway) the round forms a new generation,
        so that it meets there the ranks that went on without it (they may have given the one it
        was late for up)."""
        if self.kept.pop(info.pid, None) is None or not reopen:
            return
        recovery, core = self.recoveries.current, self.core
        if recovery is None or generation >= core.generations.current:
            return  # the round ended meanwhile, or the rank left the generation it is in
        previous = core.generations.current
        record = core.open_generation(
            f"rank {info.rank} left generation {generation} at last, with the state it alone holds")
        self.recoveries.tell_to_leave(previous, f"rank {info.rank} joins late", abort=True)
        recovery.renew(record.generation)

    def on_exit(self, info: RankInfo, pid: int) -> bool:
        """True when this exit was a survivor's killed for never leaving: replaced in the round."""
        if self.killed.pop(pid, None) is None:
            return False
        recovery = self.recoveries.current
        if recovery is None:
            return False  # the round ended meanwhile: the exit is judged as any other
        core = self.core
        previous = core.generations.current
        record = core.open_generation(
            f"rank {info.rank} left behind in generation {info.generation}: replace")
        self.recoveries.tell_to_leave(previous, f"rank {info.rank} left behind: replace",
                                      abort=True)
        recovery.renew(record.generation)
        self.recoveries.replace_in_round(info.rank, record)
        for incident in recovery.name_left_behind(info.rank):
            core.events.incident(incident)
        return True
