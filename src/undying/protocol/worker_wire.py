"""What crosses a worker's channel to its agent: reports up, commands down.

A worker (or a hot spare) writes reports (``WorkerReport``), the agent
decodes them with ``decode_from_worker``; the agent writes commands
(``WorkerCommand``), the worker decodes them with ``decode_to_worker``. Lines
of JSON (``undying.protocol.codec``). Reports a worker makes about the job
(``FORWARDED``) travel on unchanged to the manager; heartbeats and the
spare's own words stay with the agent.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from undying.protocol.codec import Codec, Message, members
from undying.protocol.env import DEFAULT_HEARTBEAT_TIMEOUT_S, TIMEOUT_HEARTBEAT_ENV

__all__ = [
    "Hello", "Heartbeat", "StepBegun", "StepCommitted", "Progress", "CommFailure", "FaultInjected",
    "Fatal", "TraceSummary", "Done", "CheckpointSaved", "Terminated", "StopProposal", "SpareReady",
    "SpareTaken", "Preempt", "StopAt", "Stop", "Assign", "Abort", "ArmFault", "TraceSet",
    "WorkerReport", "WorkerCommand", "FORWARDED", "COMMANDS", "encode", "decode_from_worker",
    "decode_to_worker", "spare_beat_interval", "Metric", "wire_metrics",
]


# --- worker -> agent -------------------------------------------------------


class Hello(Message, frozen=True):
    """First message on a worker's channel: who it is.

    ``incarnation``: the process number its owner key carries (0: not known,
    an unmanaged script). A process the rank was taken from since (a cancelled
    move's replacement, started ahead) may still say hello on its way out: the
    manager knows it by this and leaves the rank to its process.
    """

    rank: int
    pid: int
    generation: int
    joining: bool
    t: float
    incarnation: int = 0


class Heartbeat(Message, frozen=True):
    """Sent by a worker thread about once a second: the process is alive, and how far it got.

    ``phase`` is a ``WorkerPhase``. ``collectives`` counts the collectives this
    rank entered in ``generation`` (the process group's sequence number);
    ``progress_t`` is when the worker last saw its (generation, phase, step,
    collectives) change. A rank alive but stuck keeps beating with an old
    ``progress_t``; of ranks stuck together the one that entered fewer
    collectives is the one the others wait for.
    """

    rank: int
    t: float
    generation: int = -1
    phase: str = "init"
    step: int = 0
    collectives: int = -1
    progress_t: float = 0.0


class StepBegun(Message, frozen=True):
    """A rank began a step with this batch: ``batch`` fingerprints it
    (``undying.worker.fingerprint``).

    Sent when the step's batch is known (``step.batch``, or what the script
    hands to ``step.uses``), so the batch of a step a rank died in is on record:
    the rank that re-runs that step must begin it with the same batch, or the
    run after the fault is not the run it replaces (the manager's
    ``divergence``).
    """

    rank: int
    generation: int
    step: int
    batch: str


# A step.log value: a number, or "inf", "-inf", "nan" (JSON has no such numbers)
Metric = str | float


def wire_metrics(metrics: Mapping[str, float | str]) -> dict[str, Metric]:
    """Metrics as they travel and are kept: a non-finite number as its name, which JSON can carry.

    A loss of ``inf`` (a step whose gradients a GradScaler skipped) would be
    ``null`` in JSON, and no float: the commit would be refused at the agent.
    """
    return {name: value if not isinstance(value, float) or math.isfinite(value) else repr(value)
            for name, value in metrics.items()}


def float_metrics(metrics: Mapping[str, Metric]) -> dict[str, float]:
    """Metrics as numbers again (``wire_metrics`` undone): what the manager computes and logs
    with."""
    return {name: float(value) for name, value in metrics.items()}


class StepCommitted(Message, frozen=True):
    """A rank finished a step's body: its state is now at ``step``.

    ``metrics``: what the step logged (``step.log``), by name; a non-finite
    value travels as ``"inf"``, ``"-inf"`` or ``"nan"`` (``wire_metrics``).
    """

    rank: int
    generation: int
    step: int
    t: float
    metrics: dict[str, Metric] = {}

    def __post_init__(self) -> None:
        if any(isinstance(v, float) and not math.isfinite(v) for v in self.metrics.values()):
            msgspec.structs.force_setattr(self, "metrics", wire_metrics(self.metrics))
        for name, value in self.metrics.items():
            if isinstance(value, str) and value not in _NON_FINITE:
                raise ValueError(f"metric {name!r} is {value!r}: a number, or one of "
                                 f"{', '.join(_NON_FINITE)}")


_NON_FINITE = ("inf", "-inf", "nan")


class Progress(Message, frozen=True):
    """A recovery milestone of one rank (``group_rebuilt``, ``state_restored``, ...)."""

    rank: int
    generation: int
    phase: str
    t: float
    step: int = -1
    detail: dict[str, Any] = {}


class CommFailure(Message, frozen=True):
    """A collective failed on this rank; it left ``generation`` and waits for the next.

    ``torn``: the rank's live state was already past ``step`` (its optimizer stepped, or the step's
    body ran to its end and the commit failed), so it is restored from a snapshot, not kept.
    ``unformed``: the rank never had ``generation``'s group: it failed while forming (a member
    that never came, a link that failed while connecting).
    """

    rank: int
    generation: int
    step: int
    error: str
    t: float
    torn: bool = False
    unformed: bool = False


class FaultInjected(Message, frozen=True):
    """Sent right before a worker faults itself on request (the fault's time)."""

    rank: int
    kind: str
    step: int
    phase: str
    t: float


class Fatal(Message, frozen=True):
    """The user's code raised: a bug, not a fault. Carries the traceback."""

    rank: int
    step: int
    error: str
    traceback: str
    t: float


class TraceSummary(Message, frozen=True):
    """A rank's compact trace summary over a window of steps (undying.trace.summary), for slow-rank
    detection."""

    rank: int
    generation: int
    summary: dict[str, Any] = {}


class Done(Message, frozen=True):
    """The rank finished its last step; ``digest`` fingerprints its final state."""

    rank: int
    step: int
    digest: str
    t: float


class CheckpointSaved(Message, frozen=True):
    """A checkpoint of ``step`` was committed (or, with ``error``, failed).

    ``blocking_s`` is the training loop's stall (the CPU copy), ``write_s`` the
    write beside training; ``kind`` periodic or dying-gasp. A failed one says
    what the OS said in ``os_error`` (``ENOSPC: No space left on device``), ""
    when the failure was not the storage's.
    """

    rank: int
    step: int
    kind: str
    path: str
    blocking_s: float
    write_s: float
    bytes: int
    t: float
    error: str = ""
    os_error: str = ""


class Terminated(Message, frozen=True):
    """This worker received SIGTERM (a kill of its process group): the job should take its dying
    gasp.

    ``pid``: the process that received it; a process the rank was since taken
    from (stopped by its fenced agent) is old news, not a preemption.
    """

    rank: int
    t: float
    pid: int = 0


class StopProposal(Message, frozen=True):
    """Answer to Preempt: the newest step this rank has started (or committed, between steps).

    The rank runs no step past it until it hears StopAt.
    """

    rank: int
    generation: int
    step: int
    t: float


class SpareReady(Message, frozen=True):
    """A hot spare finished importing and waits for a rank."""

    pid: int
    t: float


class SpareTaken(Message, frozen=True):
    """The spare's answer to Assign: it took the rank and runs the script now (within
    --spare-take-timeout)."""

    pid: int
    t: float


# --- agent -> worker -------------------------------------------------------


class Preempt(Message, frozen=True):
    """The job is preempted: say where you are (StopProposal) and start no new step until StopAt."""

    generation: int
    reason: str


class StopAt(Message, frozen=True):
    """Finish steps up to ``step``, then stop; rank 0 writes the dying-gasp checkpoint of ``step``
    first."""

    step: int
    grace_s: float


class Stop(Message, frozen=True):
    """Exit now (an ordered stop, not a preemption): the SIGTERM that follows is not a dying
    gasp."""

    reason: str


class Assign(Message, frozen=True):
    """Turn a hot spare into a rank: its environment, as a fresh worker would get it."""

    env: dict[str, str]


class Abort(Message, frozen=True):
    """Leave the current process group now (its collective is stuck): end the rank's reading of
    its connections, so its collective fails (``worker.group.break_connections``).

    ``at_step_start``: a planned leave (an elastic job growing), with every peer
    healthy: leave at the start of the next step instead, with no collective in
    flight, so that no step's work is dropped and no connection is broken under a
    transfer (gloo leaves a send it was writing when its connection closed waiting
    for the collective timeout). A rank that reaches no step start within its
    grace leaves at once, as without it.

    ``from_step``: a peer's process is gone (a crash, a hang killed), and no
    rank is known to have completed a step past ``from_step - 1``. A rank in
    step ``from_step`` or later leaves now (that step can finish nowhere); one
    still in an earlier step finishes it (the lost peer had sent its part of
    it: a peer committed it) and leaves at the next step's start. Every
    survivor hears it at once, rather than one after another as each one's
    neighbour in gloo's ring gives up (4-6 ms a hop on 2 cores).
    """

    generation: int
    reason: str
    at_step_start: bool = False
    from_step: int = 0


class ArmFault(Message, frozen=True):
    """Fault this worker when it reaches ``at_step`` (and ``phase``, an ``InjectPhase``).

    ``kind`` is an ``InjectKind``, or ``hang:spin`` / ``hang:block`` for a hang
    done by the training thread. For kind ``slow``, ``phase`` is a
    ``SlowPhase`` and every step from ``at_step`` on takes ``factor`` times as
    long, the extra time spent there.
    """

    kind: str
    at_step: int
    phase: str = "step"
    factor: float = 1.0


class TraceSet(Message, frozen=True):
    """The trace switch: step/ckpt/fp/data markers on or off together, comm markers alone.

    Comm markers come from a DDP communication hook, and a DDP takes a hook only
    when it is built: every rank rebuilds its DDP, with or without the hook, at
    the first step ``>= comm_from_step``, a step the manager picked far enough
    ahead that every rank hears of it first (building a DDP is a collective).
    """

    step: bool
    comm: bool
    by: str
    t: float
    comm_from_step: int = 0


WorkerReport = (Hello | Heartbeat | StepBegun | StepCommitted | Progress | CommFailure
                | FaultInjected | Fatal | TraceSummary | Done | CheckpointSaved | Terminated
                | StopProposal | SpareReady | SpareTaken)
WorkerCommand = Preempt | StopAt | Stop | Assign | Abort | ArmFault | TraceSet

# A worker's reports about the job, which its agent forwards to the manager as they came.
FORWARDED: tuple[type[Message], ...] = (
    Hello, StepBegun, StepCommitted, Progress, CommFailure, FaultInjected, Fatal, TraceSummary,
    Done, CheckpointSaved, Terminated, StopProposal,
)

COMMANDS = members(WorkerCommand)

_reports: Codec[WorkerReport] = Codec(WorkerReport, "worker's channel")
_commands: Codec[WorkerCommand] = Codec(WorkerCommand, "agent's channel to a worker")

encode = Codec.encode
decode_from_worker = _reports.decode
decode_to_worker = _commands.decode


def spare_beat_interval(env: Mapping[str, str] | None = None) -> float:
    """Seconds between a waiting spare's SpareReady beats: a quarter of the heartbeat timeout, at
    most 1 s.

    Both ends of a spare's line go by it: the spare beats this often, the agent
    judges a spare silent for a few of these stopped or wedged.
    """
    env = os.environ if env is None else env
    try:
        heartbeat = float(env.get(TIMEOUT_HEARTBEAT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S))
    except ValueError:
        heartbeat = DEFAULT_HEARTBEAT_TIMEOUT_S
    return max(0.05, min(1.0, heartbeat / 4))
