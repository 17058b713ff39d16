"""The node's ranks: which process holds each one, and the words the agent sends them.

One named part of the agent (``agent/agent.py``), the one owner of two tables:
each rank's newest process (``workers``) and every process that holds or held
a rank still watched, by PID (``by_pid``: a planned move's old process keeps
running beside the new one). The workers' channel reads ``by_pid`` (a Hello
makes a line a rank's), the hang watch reads ``workers``; a process is put in
(``hold``) when the agent gives a rank one, and taken out when it ends
(``ended``). The words to a rank (kill, abort, a command, an armed fault, the
trace switch, the stop) go through here: held until the rank's Hello when its
process has no line yet.
"""

from __future__ import annotations

import os
import signal

from undying.agent.worker_channel import LocalWorker
from undying.protocol.codec import Message
from undying.protocol.kinds import InjectPhase
from undying.protocol.worker_wire import Abort, ArmFault, Stop, TraceSet, encode

__all__ = ["LocalRanks"]


class LocalRanks:
    """Each rank's process on this node, and what the agent tells it."""

    def __init__(self) -> None:
        self.workers: dict[int, LocalWorker] = {}
        self.by_pid: dict[int, LocalWorker] = {}
        # faults armed for a rank's next replacement
        self._for_replacement: dict[int, list[ArmFault]] = {}
        # faults armed before the rank had a process
        self._armed_early: dict[int, list[ArmFault]] = {}

    def held_for(self, rank: int, *, joining: bool) -> list[Message]:
        """The faults a new process of ``rank`` gets once it says hello (taken: they are its
        now)."""
        return [*self._armed_early.pop(rank, []),
                *(self._for_replacement.pop(rank, []) if joining else [])]

    def hold(self, worker: LocalWorker) -> None:
        """``worker``'s process holds its rank now (a live older one, a planned move's, stays
        watched)."""
        old = self.workers.get(worker.rank)
        if old is not None and old.process.returncode is not None:
            self.by_pid.pop(old.pid, None)
        self.workers[worker.rank] = worker
        self.by_pid[worker.pid] = worker

    def replace(self, old_pid: int, worker: LocalWorker) -> None:
        """A stuck spare's rank given to ``worker``: the spare's exit is no rank's crash."""
        self.by_pid.pop(old_pid, None)
        self.workers[worker.rank] = worker
        self.by_pid[worker.pid] = worker

    def ended(self, pid: int) -> LocalWorker | None:
        """Process ``pid`` ended: the worker it was, if it held a rank.

        When it was the rank's newest process while an older one runs (a
        cancelled move, manager.placement.migration), that one holds the rank again.
        """
        worker = self.by_pid.pop(pid, None)
        if worker is not None and self.workers.get(worker.rank) is worker:
            self.workers.update({w.rank: w for w in self.by_pid.values() if w.rank == worker.rank})
        return worker

    def live(self) -> list[LocalWorker]:
        return [w for w in self.workers.values() if w.process.returncode is None]

    def any_live(self) -> bool:
        return any(w.process.returncode is None for w in self.workers.values())

    def pids(self) -> set[int]:
        """Every process that holds or held a rank and is still watched."""
        return {*self.by_pid, *(w.pid for w in self.workers.values())}

    def live_pids(self) -> dict[int, int]:
        return {r: w.pid for r, w in self.workers.items() if w.process.returncode is None}

    def phases(self) -> dict[int, str]:
        """Each live rank's phase from its latest heartbeat (init, step, recovery, done)."""
        return {r: w.progress().phase for r, w in self.workers.items()
                if w.process.returncode is None}

    def kill(self, rank: int, sig: signal.Signals) -> bool:
        worker = self.workers.get(rank)
        if worker is None or worker.process.returncode is not None:
            return False
        try:
            os.kill(worker.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def abort(self, rank: int, generation: int, reason: str, at_step_start: bool = False,
              from_step: int = 0) -> bool:
        """Have ``rank`` leave ``generation`` (now: its stuck collective fails; or at its next
        step's start; see ``Abort``): it rejoins."""
        worker = self.workers.get(rank)
        if worker is None or worker.writer is None or worker.process.returncode is not None:
            return False
        worker.writer.write(encode(Abort(generation, reason, at_step_start, from_step)))
        return True

    def tell(self, rank: int, message: Message) -> bool:
        """Send a command to ``rank``'s worker (queued until it says hello); False if it has no
        process."""
        worker = self.workers.get(rank)
        if worker is None or worker.process.returncode is not None:
            return False
        if worker.writer is None:
            worker.pending.append(message)
        else:
            worker.writer.write(encode(message))
        return True

    def arm(self, rank: int, fault: ArmFault) -> None:
        # for the rank's next replacement process, not this one
        if fault.phase == InjectPhase.REJOIN:
            self._for_replacement.setdefault(rank, []).append(fault)
            return
        worker = self.workers.get(rank)
        if worker is None:  # armed before the rank's first process exists: it gets it when spawned
            self._armed_early.setdefault(rank, []).append(fault)
            return
        if worker.writer is None:
            worker.pending.append(fault)
        else:
            worker.writer.write(encode(fault))

    def set_trace(self, switch: TraceSet) -> None:
        """Every live worker with a line follows ``switch`` now (later ones get it with their
        Hello)."""
        for worker in self.workers.values():
            if worker.writer is not None and worker.process.returncode is None:
                worker.writer.write(encode(switch))

    def say_stop(self) -> None:
        """Said before a stop's SIGTERM: it is a stop, not a preemption to take a dying gasp for."""
        for worker in self.workers.values():
            if worker.writer is not None and worker.process.returncode is None:
                worker.writer.write(encode(Stop("stopped by the agent")))
