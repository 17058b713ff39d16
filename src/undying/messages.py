"""Typed messages between the worker library, the agent and the manager.

One newline-delimited JSON object per message with a ``type`` field naming the
dataclass. Both ends decode into these classes, so a field added here is seen
by every part at once, and an unknown or malformed message is an error rather
than a silently ignored dict.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "Message",
    "Hello",
    "Heartbeat",
    "StepCommitted",
    "Progress",
    "CommFailure",
    "FaultInjected",
    "Fatal",
    "Done",
    "ArmFault",
    "Abort",
    "RankProgress",
    "WORKER_PHASES",
    "SpareReady",
    "SpareTaken",
    "SpareEvent",
    "Assign",
    "CheckpointSaved",
    "Terminated",
    "StopProposal",
    "Preempt",
    "StopAt",
    "Stop",
    "TraceSet",
    "TraceSummary",
    "SLOW_PHASES",
    "AgentJoin",
    "AgentWelcome",
    "AgentRefused",
    "AgentFenced",
    "AgentState",
    "ManagerBeat",
    "SpawnRank",
    "RankSpawned",
    "KillRank",
    "TellRank",
    "ArmRank",
    "AbortRank",
    "KeepSpares",
    "StopNode",
    "NodeStopped",
    "NodeLeaving",
    "RankExited",
    "RankReport",
    "RankHung",
    "RanksStalled",
    "TraceFileSet",
    "TraceFileError",
    "JobEnded",
    "Numbered",
    "NumberedReports",
    "Acked",
    "WORKER_MESSAGES",
    "encode",
    "decode",
    "from_object",
    "RECOVERY_PHASES",
    "INJECT_PHASES",
]

# The timeline of an incident, in order (DESIGN.md §3).
RECOVERY_PHASES = (
    "detected",
    "decided",
    "replacement_ready",
    "group_rebuilt",
    "state_restored",
    "first_step_done",
)

# Where a worker can be made to fault: at the start of a step (between steps),
# in the forward pass, in backward's gradient all-reduce, in the optimizer
# step, when it starts a recovery, or (for the rank's next replacement
# process) once it has joined and received its state.
# "regroup": in a regroup generation, once the state is restored, before it is saved (see worker.job).
INJECT_KINDS = ("crash", "hang", "comm-error", "slow")  # what /api/inject and undying inject accept
HANG_HOWS = ("stop", "spin", "block")  # how an injected hang hangs
INJECT_PHASES = ("step", "forward", "backward", "optimizer", "recovery", "rejoin", "regroup")

# Where an injected slowdown puts its extra time: the forward/backward compute,
# the wait for the next batch, or the training loop's checkpoint stall.
SLOW_PHASES = ("compute", "data", "ckpt")


@dataclass(frozen=True)
class Message:
    registry: ClassVar[dict[str, type[Message]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Message.registry[cls.__name__] = cls


# --- worker -> agent -------------------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    """First message on a worker's channel: who it is."""

    rank: int
    pid: int
    generation: int
    joining: bool
    t: float


# What a worker is doing, as its heartbeats say: starting up (imports, the
# first step), running steps, or rejoining after a fault, or finished.
WORKER_PHASES = ("init", "step", "recovery", "done")


@dataclass(frozen=True)
class Heartbeat(Message):
    """Sent by a worker thread about once a second: the process is alive, and how far it got.

    ``collectives`` counts the collectives this rank entered in ``generation``
    (the process group's sequence number); ``progress_t`` is when the worker
    last saw its (generation, phase, step, collectives) change. A rank alive
    but stuck keeps beating with an old ``progress_t``; of ranks stuck
    together the one that entered fewer collectives is the one the others
    wait for.
    """

    rank: int
    t: float
    generation: int = -1
    phase: str = "init"
    step: int = 0
    collectives: int = -1
    progress_t: float = 0.0


@dataclass(frozen=True)
class RankProgress(Message):
    """One rank's progress as its agent last heard it (agent -> manager, on a stall)."""

    rank: int
    pid: int
    generation: int
    phase: str
    step: int
    collectives: int
    progress_t: float


@dataclass(frozen=True)
class StepCommitted(Message):
    """A rank finished a step's body: its state is now at ``step``."""

    rank: int
    generation: int
    step: int
    t: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress(Message):
    """A recovery milestone of one rank (``group_rebuilt``, ``state_restored``)."""

    rank: int
    generation: int
    phase: str
    t: float
    step: int = -1
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CommFailure(Message):
    """A collective failed on this rank; it left ``generation`` and waits for the next."""

    rank: int
    generation: int
    step: int
    error: str
    t: float


@dataclass(frozen=True)
class FaultInjected(Message):
    """Sent right before a worker faults itself on request (the fault's time)."""

    rank: int
    kind: str
    step: int
    phase: str
    t: float


@dataclass(frozen=True)
class Fatal(Message):
    """The user's code raised: a bug, not a fault. Carries the traceback."""

    rank: int
    step: int
    error: str
    traceback: str
    t: float


@dataclass(frozen=True)
class TraceSummary(Message):
    """A rank's compact trace summary over a window of steps (undying.trace.summary), for slow-rank detection."""

    rank: int
    generation: int
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Done(Message):
    """The rank finished its last step; ``digest`` fingerprints its final state."""

    rank: int
    step: int
    digest: str
    t: float


@dataclass(frozen=True)
class SpareReady(Message):
    """A hot spare finished importing and waits for a rank."""

    pid: int
    t: float


@dataclass(frozen=True)
class SpareEvent(Message):
    """What happened to a node's hot spare (started, exited, hung, stuck taking a rank), for the job's log.

    ``what`` is the event's name in the log (``spare_started``, ...); ``detail`` its fields.
    """

    node: int
    pid: int
    what: str
    t: float
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointSaved(Message):
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


@dataclass(frozen=True)
class Terminated(Message):
    """This worker received SIGTERM (a kill of its process group): the job should take its dying gasp."""

    rank: int
    t: float


@dataclass(frozen=True)
class StopProposal(Message):
    """Answer to Preempt: the newest step this rank has started (or committed, between steps).

    The rank runs no step past it until it hears StopAt.
    """

    rank: int
    generation: int
    step: int
    t: float


# --- agent -> worker -------------------------------------------------------


@dataclass(frozen=True)
class Preempt(Message):
    """The job is preempted: say where you are (StopProposal) and start no new step until StopAt."""

    generation: int
    reason: str


@dataclass(frozen=True)
class StopAt(Message):
    """Finish steps up to ``step``, then stop; rank 0 writes the dying-gasp checkpoint of ``step`` first."""

    step: int
    grace_s: float


@dataclass(frozen=True)
class Stop(Message):
    """Exit now (an ordered stop, not a preemption): the SIGTERM that follows is not a dying gasp."""

    reason: str



@dataclass(frozen=True)
class Assign(Message):
    """Turn a hot spare into a rank: its environment, as a fresh worker would get it."""

    env: dict[str, str]


@dataclass(frozen=True)
class SpareTaken(Message):
    """The spare's answer to Assign: it took the rank and runs the script now (within --spare-take-timeout).

    Kept by the agent (beside Assign, not among the reports a worker's agent forwards).
    """

    pid: int
    t: float


@dataclass(frozen=True)
class Abort(Message):
    """Leave the current process group now (its collective is stuck): break its connections."""

    generation: int
    reason: str


@dataclass(frozen=True)
class ArmFault(Message):
    """Fault this worker when it reaches ``at_step`` (and ``phase``).

    For kind ``slow``, ``phase`` is one of SLOW_PHASES and every step from
    ``at_step`` on takes ``factor`` times as long, the extra time spent there.
    """

    kind: str
    at_step: int
    phase: str = "step"
    factor: float = 1.0


@dataclass(frozen=True)
class TraceSet(Message):
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


# --- agent <-> manager, across hosts (undying/manager/nodes.py, undying/agent/remote.py) ---
#
# With the manager in the launcher the agent calls it directly; on separate
# hosts the same calls travel as these messages on one TCP connection per
# node. A worker's own message crosses unchanged: to the manager as an object
# inside NumberedReports, back inside TellRank.


@dataclass(frozen=True)
class AgentJoin(Message):
    """First message of an agent: the job it is for, its node, its flags, and its session.

    ``session`` is empty for a new agent; an agent that lost its connection
    rejoins with the session it was given, and is fenced if the manager gave
    its node to another agent since.
    """

    job_id: str
    node: int
    nnodes: int
    nproc_per_node: int
    token: str
    session: str
    pid: int
    host: str
    config: dict[str, Any]
    live: dict[str, int]
    t: float


@dataclass(frozen=True)
class AgentWelcome(Message):
    """The node is in: its session, where the control store is, the job's dir."""

    session: str
    node: int
    control_port: int
    job_dir: str
    trace: dict[str, Any] = field(default_factory=dict)
    acked: int = 0  # the newest of this session's reports the manager holds: the agent resends the rest


@dataclass(frozen=True)
class AgentRefused(Message):
    """The agent cannot join (wrong token, another job, a bad node rank, flags that differ); it exits."""

    reason: str


@dataclass(frozen=True)
class AgentFenced(Message):
    """The node was declared lost and its ranks given away: kill every worker, then join afresh."""

    reason: str


@dataclass(frozen=True)
class AgentState(Message):
    """The node's beat (about twice a second): its live ranks (rank -> pid), their phases, warm spares."""

    node: int
    live: dict[str, int]
    phases: dict[str, str]
    spares_ready: int
    t: float


@dataclass(frozen=True)
class ManagerBeat(Message):
    """The manager's beat to each agent: an agent that stops hearing it reconnects."""

    t: float


@dataclass(frozen=True)
class SpawnRank(Message):
    rank: int
    record: dict[str, Any]
    joining: bool
    resume_from: str
    incarnation: int


@dataclass(frozen=True)
class RankSpawned(Message):
    rank: int
    pid: int
    warm: bool
    incarnation: int


@dataclass(frozen=True)
class KillRank(Message):
    rank: int
    signal: int


@dataclass(frozen=True)
class TellRank(Message):
    """A message for one worker (Preempt, StopAt, ...), encoded as the worker reads it."""

    rank: int
    body: str


@dataclass(frozen=True)
class ArmRank(Message):
    rank: int
    fault: dict[str, Any]


@dataclass(frozen=True)
class AbortRank(Message):
    rank: int
    generation: int
    reason: str


@dataclass(frozen=True)
class KeepSpares(Message):
    pass


@dataclass(frozen=True)
class StopNode(Message):
    """Stop every worker of the node (SIGTERM, SIGKILL after ``grace_s``); answered by NodeStopped."""

    grace_s: float
    seq: int


@dataclass(frozen=True)
class NodeStopped(Message):
    seq: int


@dataclass(frozen=True)
class NodeLeaving(Message):
    """The agent got SIGTERM (its pod is being deleted): its node leaves the job."""

    node: int
    reason: str
    t: float


@dataclass(frozen=True)
class RankExited(Message):
    rank: int
    pid: int
    returncode: int
    t: float


@dataclass(frozen=True)
class RankReport(Message):
    """A worker's message, as the agent received it, in a Numbered line (agents now send NumberedReports)."""

    body: str


@dataclass(frozen=True)
class RankHung(Message):
    rank: int
    pid: int
    phase: str
    last_seen: float
    t: float


@dataclass(frozen=True)
class RanksStalled(Message):
    progress: list[dict[str, Any]]
    limit: float
    t: float


@dataclass(frozen=True)
class TraceFileSet(Message):
    step: bool
    comm: bool
    by: str
    t: float


@dataclass(frozen=True)
class TraceFileError(Message):
    message: str


@dataclass(frozen=True)
class Numbered(Message):
    """An agent's report with its number in the session, so none is lost or taken twice.

    The agent keeps every report until the manager says it is in the log
    (Acked); a manager that died before writing some is sent them again by
    number, and one that already has them drops the copies.
    """

    seq: int
    body: str


@dataclass(frozen=True)
class NumberedReports(Message):
    """Several of an agent's reports in one line, numbered ``first``, ``first + 1``, ... in order.

    What the agent made in one pass of its event loop (a node's ranks commit a
    step within microseconds of each other) travels together. Each report is a
    message object (its fields and its ``type``, as ``encode`` writes it): the
    agent's own (AgentState, RankExited, ...) and its workers' messages as the
    workers sent them (StepCommitted, Hello, ...; see WORKER_MESSAGES), not
    strings inside strings. Numbers and acknowledgements are per report, as
    with Numbered: a manager that has some of them takes only the rest.
    """

    first: int
    reports: list[dict[str, Any]]


@dataclass(frozen=True)
class Acked(Message):
    """Every report of the session up to ``seq`` is in the manager's log (committed)."""

    seq: int


@dataclass(frozen=True)
class JobEnded(Message):
    """The job is over (succeeded, failed, stopped, preempted): the agent exits with ``exit_code``."""

    state: str
    reason: str
    exit_code: int


# A worker's messages, which an agent forwards to the manager unchanged (inside NumberedReports); every
# other report of an agent is its own.
WORKER_MESSAGES: tuple[type[Message], ...] = (
    Hello, StepCommitted, Progress, CommFailure, FaultInjected, Fatal, TraceSummary, Done, CheckpointSaved,
    Terminated, StopProposal,
    SpareEvent,  # the agent's own word on its spares, which the manager logs as it logs the workers'
)


def encode(message: Message) -> bytes:
    body = dataclasses.asdict(message)
    body["type"] = type(message).__name__
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str) -> Message:
    try:
        body = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed message: {line!r:.200}") from e
    if not isinstance(body, dict) or "type" not in body:
        raise ValueError(f"message without a type: {line!r:.200}")
    return from_object(body)


def from_object(body: dict[str, Any]) -> Message:
    """The message a decoded JSON object stands for (a line's, or one report of NumberedReports); takes its ``type``."""
    if not isinstance(body, dict):
        raise ValueError(f"not a message object: {body!r:.200}")
    kind = body.pop("type", None)
    cls = Message.registry.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown message type in {body!r:.200} (type {kind!r:.50})")
    try:
        return cls(**body)
    except TypeError as e:
        raise ValueError(f"bad fields for {cls.__name__}: {e}") from e
