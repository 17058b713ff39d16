"""A stop signal at a node of a multi-node job: the node leaving, or the job's preemption
reaching it.

Two rules meet here. A SIGTERM to a node's agent is that node leaving the job (a pod deleted,
a host drained): its ranks are recovered elsewhere. A SIGTERM to a worker (a kill of its
process group) asks the job for its dying gasp. A scheduler that signals every process of a
job at once (Slurm's ``scancel``, its preemption and its time limit reach every process of
every step) sets off both on every node: each node left, each was fenced, the gasp was lost.

So the agent judges over a short window (``WINDOW_S``):

- Its own signal is the node's. Its workers' SIGTERMs within the window of it, before or
  after, are the same signal: dropped, not a preemption.
- It leaves when the window has passed, unless the job's preemption reached it meanwhile (the
  manager told one of its ranks to stop: ``Preempt``). Then the node stays for the dying gasp
  and ends with the job (exit 75), as a single-node job does.
- A worker's SIGTERM that no signal of the agent's claims within the window goes to the
  manager, late by the window: a preemption, as before (dropped if the preemption already
  reached the node).

The manager preempts on its own SIGTERM. Under Slurm it runs on the job's first node, so a
signal to the whole job reaches it and the job is preempted, while a signal to another
node's processes alone is that node leaving. (The first node signalled alone is the
manager's node: the job is preempted then too, with its gasp.)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from undying.protocol.codec import Message
from undying.protocol.node_wire import TellRank
from undying.protocol.worker_wire import Preempt, Terminated

__all__ = ["NodeSignals", "WINDOW_S"]

log = logging.getLogger("undying.agent.remote")

WINDOW_S = 3.0  # a signal to every process of a job lands within milliseconds; the manager's
# Preempt follows its own SIGTERM within one pass of its loop


class NodeSignals:
    """The node's stop signals judged over ``window_s``; ``leave(sig)`` when the node leaves."""

    def __init__(self, node: Callable[[], int], leave: Callable[[signal.Signals], None],
                 send: Callable[[Message], None], *, window_s: float = WINDOW_S) -> None:
        self._node = node
        self._leave = leave
        self._send = send
        self.window_s = window_s
        self.signalled_t: float | None = None  # monotonic: the agent's own signal
        self.preempting = False  # the job's preemption reached this node
        self._held: list[tuple[float, Terminated]] = []
        self._decision: asyncio.TimerHandle | None = None

    def signalled(self, sig: signal.Signals) -> None:
        """The agent's own stop signal (on its loop)."""
        if self.preempting:
            log.warning("node %d: %s while the job's dying gasp is under way: this node stays "
                        "for it", self._node(), sig.name)
            return
        if self.signalled_t is not None:
            return  # one judgement per node; its leave is on its way
        self.signalled_t = time.monotonic()
        dropped, self._held = self._held, []
        if dropped:
            log.info("node %d: %d SIGTERM(s) of its workers came with its own: the node's, not "
                     "a preemption", self._node(), len(dropped))
        log.warning("node %d: %s: this node leaves the job in %gs unless the whole job is "
                    "being stopped", self._node(), sig.name, self.window_s)
        loop = asyncio.get_running_loop()
        self._decision = loop.call_later(self.window_s, self._decide, sig)

    def _decide(self, sig: signal.Signals) -> None:
        self._decision = None
        if self.preempting:
            log.warning("node %d: the job is being preempted: this node stays for its dying "
                        "gasp", self._node())
            return
        self._leave(sig)

    def worker_report(self, message: Message) -> None:
        """A worker's report on its way to the manager: a SIGTERM is judged, the rest passes."""
        if not isinstance(message, Terminated):
            self._send(message)
            return
        now = time.monotonic()
        if self.signalled_t is not None and now - self.signalled_t <= self.window_s:
            log.info("node %d: rank %d's SIGTERM came with the node's own: not a preemption",
                     self._node(), message.rank)
            return
        if self.preempting:
            return  # a preemption is under way: the manager would only say so again
        self._held.append((now, message))
        asyncio.get_running_loop().call_later(self.window_s, self._release, message)

    def _release(self, message: Terminated) -> None:
        """The window passed with no signal of the agent's: the worker's SIGTERM is a
        preemption."""
        for i, (_, held) in enumerate(self._held):
            if held is message:
                del self._held[i]
                self._send(message)
                return

    def heard(self, message: Message) -> None:
        """A command from the manager: a ``Preempt`` for a rank here is the job's preemption."""
        if isinstance(message, TellRank) and isinstance(message.command, Preempt):
            if not self.preempting:
                self.preempting = True
                if self._decision is not None:
                    log.warning("node %d: the job is being preempted: this node stays for its "
                                "dying gasp", self._node())
                    self._decision.cancel()
                    self._decision = None
            self._held.clear()  # the preemption they asked for is under way

    def close(self) -> None:
        if self._decision is not None:
            self._decision.cancel()
            self._decision = None
