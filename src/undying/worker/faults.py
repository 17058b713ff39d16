"""Faults a worker inflicts on itself on request: real signals, at a chosen point.

The agent arms a fault ("crash at step 12 in backward"); the worker library
checks the switch at its own seams (step start, forward, gradient all-reduce,
optimizer step, recovery). When off, a check is one attribute test.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping

from undying.protocol.codec import Message
from undying.protocol.worker_wire import ArmFault, FaultInjected

__all__ = ["FaultSwitch", "crash_self", "stop_self", "spin_forever", "block_forever"]


def crash_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def stop_self() -> None:
    """A hang: SIGSTOP, the whole process, heartbeat thread included."""
    os.kill(os.getpid(), signal.SIGSTOP)


def spin_forever() -> None:
    """A hang with the process alive and busy: an endless loop in Python (heartbeats go on)."""
    while True:
        pass


def block_forever() -> None:
    """A hang with the process alive and idle: a deadlock (heartbeats go on).

    Left in a step's forward pass or backward, the rank never joins the next
    collective, and its peers are stuck in it.
    """
    threading.Event().wait()


class FaultSwitch:
    """``actions`` says what each fault kind does: crash (SIGKILL), comm-error (break links)."""

    def __init__(self, rank: int, report: Callable[[Message], None],
                 actions: Mapping[str, Callable[[], object]]) -> None:
        self._rank = rank
        self._report = report
        self._actions = actions
        self._armed: tuple[ArmFault, ...] = ()
        self._lock = threading.Lock()

    def arm(self, fault: ArmFault) -> None:
        with self._lock:
            self._armed = (*self._armed, fault)

    def check(self, phase: str, step: int) -> None:
        if not self._armed:
            return
        with self._lock:
            due = next((f for f in self._armed if f.phase == phase and step >= f.at_step), None)
            if due is None:
                return
            self._armed = tuple(f for f in self._armed if f is not due)
        armed = due
        self._report(FaultInjected(self._rank, armed.kind, step, phase, time.time()))
        self._actions[armed.kind]()
