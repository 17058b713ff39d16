"""The step loop's line to its agent: its reports out (``AgentLink``), the agent's commands in
(``Commands``).

``Job`` builds both. The link is opened once the job's parts exist (a report
before it is dropped: none is sent then); the commands go, by message class,
to the part that carries them out: a fault armed (``worker.faults``), tracing
switched (``worker.tracing``), a preemption (``worker.gasp``), or an abort of
the generation (``worker.group``). Anything else is logged and ignored.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from undying.config import EXIT_MIGRATED, planned_leave_grace
from undying.protocol.codec import Message
from undying.protocol.worker_wire import Abort, ArmFault, Preempt, Stop, StopAt, TraceSet
from undying.worker.channel import AgentChannel
from undying.worker.context import JobContext
from undying.worker.gasp import Preemption
from undying.worker.group import break_connections

__all__ = ["AgentLink", "Commands", "leave_early"]

log = logging.getLogger("undying.worker")


class AgentLink:
    """This process's channel to its agent, once opened: what the job's parts send goes through
    ``send``."""

    def __init__(self) -> None:
        self._channel: AgentChannel | None = None

    def open(self, host: str, port: int, on_command: Callable[[Message], None]) -> None:
        self._channel = AgentChannel(host, port, on_command)

    def send(self, message: Message) -> None:
        if self._channel is not None:
            self._channel.send(message)

    def close(self) -> None:
        if self._channel is None:
            return
        with contextlib.suppress(Exception):
            self._channel.close()


class Commands:
    """The agent's commands to this process, by message class."""

    def __init__(self, ctx: JobContext, preemption: Preemption) -> None:
        self.ctx = ctx
        self._move_generation = -1  # the generation a planned move (undying migrate) was armed in
        self._handlers: dict[type[Message], Callable[[Any], None]] = {
            ArmFault: self._on_arm_fault,
            TraceSet: ctx.tracing.apply,
            Preempt: preemption.on_preempt,
            StopAt: preemption.on_stop_at,
            Stop: preemption.on_stop,
            Abort: self._on_abort,
        }

    def on_command(self, message: Message) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:
            log.warning("rank %d: ignoring unexpected command %r", self.ctx.rank, message)
            return
        handler(message)

    def _on_arm_fault(self, message: ArmFault) -> None:
        if message.kind == "slow":
            self.ctx.tracing.arm_slowdown(message)
            return
        if message.kind == "migrate":
            self._move_generation = self.ctx.generation
        self.ctx.faults.arm(message)

    def leave_for_migration(self) -> None:
        """``undying migrate``: at a step's start (the last one committed, nothing begun) this
        process leaves; the manager expects the exit and gives the rank to a replacement that takes
        the state.

        Not after a recovery since the move was armed: the manager cancelled the move then (this
        process holds the rank again, perhaps as the last holder of its state), so it stays
        (manager.migration).
        """
        if self.ctx.generation != self._move_generation:
            log.warning("rank %d: a recovery overtook the planned move armed in generation %d; "
                        "staying",
                        self.ctx.rank, self._move_generation)
            return
        self.ctx.exit_now(EXIT_MIGRATED)

    def _on_abort(self, message: Abort) -> None:
        ctx = self.ctx
        if message.generation != ctx.generation:
            return
        if message.at_step_start:
            # Planned: the step loop leaves at its next step's start (Job.steps); a rank that
            # reaches none within the grace (a long step, the final barrier) leaves then, at once.
            grace = self._leave_grace()
            log.info("rank %d: leaving generation %d at the start of the next step (within %.1fs): "
                     "%s", ctx.rank, message.generation, grace, message.reason)
            ctx.planned_leave = (message.generation, message.reason, True)
            timer = threading.Timer(grace, self._leave_unless_left, args=(message,))
            timer.daemon = True
            timer.start()
            return
        if message.from_step:
            self.leave_from(message)
            return
        # (INFO: a handled fault's detail, config/console.py)
        log.info("rank %d: leaving generation %d: %s", ctx.rank, message.generation,
                 message.reason)
        break_connections(reading_only=True)

    def leave_from(self, message: Abort) -> None:
        """A peer's process is gone: leave now if in step ``message.from_step`` or later, else at
        the next step's start (the step in flight can still finish: a peer completed it).

        The leave is asked first and the step read second, while the step loop sets the step
        first and looks for a leave second: however the two threads interleave, a rank that
        begins step ``from_step`` either takes the leave there or has its links broken here.
        """
        ctx = self.ctx
        ctx.planned_leave = (message.generation, message.reason, False)
        if ctx.step_in_flight >= message.from_step:
            # (INFO: a handled fault's detail, config/console.py)
            log.info("rank %d: leaving generation %d in step %d: %s", ctx.rank,
                     message.generation, ctx.step_in_flight, message.reason)
            break_connections(reading_only=True)
        else:
            log.info("rank %d: finishing step %d, then leaving generation %d: %s", ctx.rank,
                     ctx.step_in_flight, message.generation, message.reason)

    def _leave_grace(self) -> float:
        ctx = self.ctx
        heartbeat = ctx.env.timeouts.heartbeat_timeout if ctx.env is not None else 1.0
        return planned_leave_grace(heartbeat, ctx.tracing.slowest_recent_step())

    def take_planned_leave(self, index: int) -> bool:
        """At step ``index``'s start (the step loop's thread): whether a planned leave of this
        generation is due now, its reason then set as the recovery's."""
        ctx = self.ctx
        leave, ctx.planned_leave = ctx.planned_leave, None
        if leave is None or leave[0] != ctx.generation:
            return False
        what = "a planned leave" if leave[2] else "leaving"
        ctx.abort_reason = f"{what} at the start of step {index}: {leave[1]}"
        return True

    def _leave_unless_left(self, message: Abort) -> None:
        ctx = self.ctx
        if ctx.planned_leave != (message.generation, message.reason, True) or \
                ctx.generation != message.generation:
            return  # the step loop took it (or the generation is gone already)
        log.info("rank %d: no step started in generation %d since the planned leave was asked; "
                 "leaving now", ctx.rank, message.generation)
        break_connections(reading_only=True)


def leave_early() -> None:
    """``undying inject leave``: the script exits 0 here, as one that stops before the others
    does."""
    sys.exit(0)
