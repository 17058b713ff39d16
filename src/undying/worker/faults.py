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
from typing import Any

import torch

from undying.protocol.codec import Message
from undying.protocol.worker_wire import ArmFault, FaultInjected

__all__ = ["FaultSwitch", "crash_self", "stop_self", "spin_forever", "block_forever", "flip_bit",
           "NUMERIC_KINDS"]


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


NUMERIC_KINDS = ("nan", "bitflip")


def flip_bit(t: Any) -> None:
    """Flip the top exponent bit of the tensor's first element, in place: 0.01 becomes about
    1e36."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    view = t.reshape(-1)[:1].view(as_int)
    view.bitwise_xor_(1 << (8 * t.element_size() - 2))


def flip_mantissa(t: Any) -> None:
    """Flip the top mantissa bit of the tensor's largest value, in place: finite, off by a quarter
    to a half."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    mantissa = {2: 9, 4: 22, 8: 51}[t.element_size()] if t.dtype != torch.bfloat16 else 6
    flat = t.reshape(-1)
    at = int(flat.detach().abs().argmax())
    flat[at:at + 1].view(as_int).bitwise_xor_(1 << mantissa)


class FaultSwitch:
    """``actions`` says what each fault kind does: crash (SIGKILL), comm-error (break links)."""

    def __init__(self, rank: int, report: Callable[[Message], None],
                 actions: Mapping[str, Callable[[], object]]) -> None:
        self._rank = rank
        self._report = report
        self._actions = actions
        self._armed: tuple[ArmFault, ...] = ()
        self._numeric: tuple[ArmFault, ...] = ()  # nan and bitflip: done to a tensor (see corrupt)
        self._lock = threading.Lock()
        self.step = 0  # the step running now (its start is checked every step)

    def arm(self, fault: ArmFault) -> None:
        with self._lock:
            if fault.kind.split(":")[0] in NUMERIC_KINDS:
                self._numeric = (*self._numeric, fault)
            else:
                self._armed = (*self._armed, fault)

    def corrupt(self, grad: Any, module: Any) -> Any:
        """In backward, on this rank's own gradient before its all-reduce: a NaN or a flipped bit,
        if armed.

        Returns the gradient to use instead (None: unchanged). ``nan:persistent``
        strikes every run of its step (a replay too), the others the first run
        of a step at or after theirs. ``bitflip:param`` flips a bit of the
        module's first weight instead, through ``.data``: no error, the model
        itself is wrong from now on.
        """
        if not self._numeric:
            return None
        step = self.step
        with self._lock:
            due = next((f for f in self._numeric
                        if (step == f.at_step if f.kind.endswith(":persistent")
                            else step >= f.at_step)), None)
            if due is None:
                return None
            if not due.kind.endswith(":persistent"):
                self._numeric = tuple(f for f in self._numeric if f is not due)
        self._report(FaultInjected(self._rank, due.kind, step, due.phase, time.time()))
        if due.kind.startswith("nan"):
            out = grad.clone()
            out.view(-1)[0] = float("nan")
            return out
        if due.kind == "bitflip:param":
            flip_bit(next(module.parameters()).data)
            return None
        out = grad.clone()
        # Finite, no spike: only --verify-every's replay finds it.
        if due.kind == "bitflip:grad-finite":
            flip_mantissa(out)
        else:
            flip_bit(out)
        return out

    def check(self, phase: str, step: int) -> None:
        if phase == "step":
            self.step = step
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
