"""What a manager and an agent say to each other: the one conversation of every job.

On separate hosts these messages travel on one TCP connection per node; with
the manager in the launcher (``undying run`` on one node) on an in-process line
that encodes and decodes each of them the same way (``undying.launch.in_process``).
Over TCP the agent writes ``FromAgent`` lines: its join, then
``NumberedReports``, each report a ``Report`` (its own, such as
``AgentState``, or a worker's, forwarded as the worker wrote it). The manager
writes ``ToAgent`` lines: its answer to the join, its beats and commands. A
command for one worker travels inside ``TellRank`` as the message itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from undying.protocol.codec import Codec, Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.worker_wire import (
    FORWARDED,
    ArmFault,
    CheckpointSaved,
    CommFailure,
    Done,
    Fatal,
    FaultInjected,
    Hello,
    Metric,
    Progress,
    StepBegun,
    StepCommitted,
    StopProposal,
    Terminated,
    TraceSet,
    TraceSummary,
    WorkerCommand,
)

__all__ = [
    "AgentJoin", "AgentWelcome", "AgentRefused", "AgentFenced", "AgentState", "ManagerBeat",
    "SpawnRank", "RankSpawned", "KillRank", "TellRank", "ArmRank", "AbortRank", "KeepSpares",
    "StopNode", "NodeStopped", "NodeLeaving", "RankExited", "RankHung", "RankProgress",
    "RanksStalled", "SpareEvent", "TraceFileSet", "TraceFileError", "NodeStep", "NumberedReports",
    "width", "Acked", "JobEnded", "FromAgent", "ToAgent", "Report", "FROM_WORKERS", "encode",
    "decode_from_agent", "decode_to_agent", "decode_agent_report", "reports_line", "StandbyJoin",
    "StandbyParked", "StandbyBeat",
]


@dataclass(frozen=True)
class RankProgress:
    """One rank's progress as its agent last heard it (inside RanksStalled, on a stall)."""

    rank: int
    pid: int
    generation: int
    phase: str
    step: int
    collectives: int
    progress_t: float


# --- agent -> manager ------------------------------------------------------


class AgentJoin(Message, frozen=True):
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


class AgentState(Message, frozen=True):
    """The node's beat (about twice a second): its live ranks (rank -> pid), their phases, warm
    spares, zygote."""

    node: int
    live: dict[str, int]
    phases: dict[str, str]
    spares_ready: int
    t: float
    zygote_pid: int = 0  # the process the node's workers fork from (0: none now)


class RankSpawned(Message, frozen=True):
    """The process that now holds ``rank`` (the answer to SpawnRank, or a stuck spare's
    replacement)."""

    rank: int
    pid: int
    warm: bool
    incarnation: int


class NodeStopped(Message, frozen=True):
    """The answer to StopNode ``seq``: every worker of the node is gone."""

    seq: int


class NodeLeaving(Message, frozen=True):
    """The agent got SIGTERM (its pod is being deleted): its node leaves the job."""

    node: int
    reason: str
    t: float


class RankExited(Message, frozen=True):
    rank: int
    pid: int
    returncode: int
    t: float


class RankHung(Message, frozen=True):
    """A rank silent past its timeout (``phase``: heartbeat, or init before its first word)."""

    rank: int
    pid: int
    phase: str
    last_seen: float
    t: float


class RanksStalled(Message, frozen=True):
    """Ranks that beat without progress past ``limit``: every live rank's progress, the manager
    judges."""

    progress: list[RankProgress]
    limit: float
    t: float


class SpareEvent(Message, frozen=True):
    """What happened to a node's hot spare (started, exited, hung, stuck taking a rank), for the
    job's log.

    ``what`` is the event's name in the log (``spare_started``, ...); ``detail`` its fields.
    """

    node: int
    pid: int
    what: str
    t: float
    detail: dict[str, Any] = {}


class TraceFileSet(Message, frozen=True):
    """The node's watched switch file changed: the manager spreads the switch to every node."""

    step: bool
    comm: bool
    by: str
    t: float


class TraceFileError(Message, frozen=True):
    message: str


class NodeStep(Message, frozen=True):
    """A node's ranks' commits of one step in one report: the wire unit that grows with nodes, not
    ranks.

    What the agent's ranks commit in one pass of its loop with the same
    ``generation`` and ``step`` (under DDP, all of them, within microseconds),
    per rank in ``ranks``' order: its commit time (``t``, so per-rank step
    times stay visible), its metrics, and its state's fingerprint
    (``fingerprints``, empty until workers send one). It stands for
    ``len(ranks)`` numbered reports, one a commit, so numbering, resending and
    acknowledging count commits exactly as they did one report each.
    """

    generation: int
    step: int
    ranks: list[int]
    t: list[float]
    metrics: list[dict[str, Metric]]
    fingerprints: list[str] = []

    def __post_init__(self) -> None:
        n = len(self.ranks)
        if not n or len(self.t) != n or len(self.metrics) != n or (
                self.fingerprints and len(self.fingerprints) != n):
            raise ValueError(f"a NodeStep of {len(self.ranks)} ranks needs as many times, metrics "
                             f"(and fingerprints, if any); got {len(self.t)}, {len(self.metrics)}, "
                             f"{len(self.fingerprints)}")

    @property
    def width(self) -> int:
        """How many numbered reports it stands for."""
        return len(self.ranks)

    def after(self, skip: int) -> NodeStep:
        """The same record without its first ``skip`` commits (those a manager has from an earlier
        send)."""
        if skip <= 0:
            return self
        return NodeStep(self.generation, self.step, self.ranks[skip:], self.t[skip:],
                        self.metrics[skip:], self.fingerprints[skip:])

    def commits(self) -> list[StepCommitted]:
        """Each rank's commit, as the rank sent it."""
        return [StepCommitted(rank, self.generation, self.step, t, metrics)
                for rank, t, metrics in zip(self.ranks, self.t, self.metrics, strict=True)]

    @classmethod
    def gather(cls, commits: list[StepCommitted]) -> list[NodeStep]:
        """Commits in order, one NodeStep per run of the same generation and step."""
        steps: list[NodeStep] = []
        run: list[StepCommitted] = []
        for commit in commits:
            if run and (commit.generation, commit.step) != (run[0].generation, run[0].step):
                steps.append(cls._of(run))
                run = []
            run.append(commit)
        if run:
            steps.append(cls._of(run))
        return steps

    @classmethod
    def _of(cls, run: list[StepCommitted]) -> NodeStep:
        return cls(run[0].generation, run[0].step, [c.rank for c in run], [c.t for c in run],
                   [c.metrics for c in run])


class NumberedReports(Message, frozen=True):
    """Several of an agent's reports in one line, numbered ``first``, ``first + 1``, ... in order.

    What the agent made in one pass of its event loop (a node's ranks commit a
    step within microseconds of each other) travels together. Each report is
    a ``Report``'s JSON object, kept raw here and decoded one by one
    (``decode_agent_report``): one bad report is dropped, not its line, and a
    report sent again after a break is skipped without being decoded. The
    agent keeps every report until the manager says it is in the log
    (``Acked``); a manager that died before writing some is sent them again
    by number, and one that already has them drops the copies.
    """

    first: int
    reports: list[msgspec.Raw]


def width(report: Message | None) -> int:
    """How many numbers a report takes in its session (a NodeStep one a commit; a bad one, one)."""
    return report.width if isinstance(report, NodeStep) else 1


# --- manager -> agent ------------------------------------------------------


class AgentWelcome(Message, frozen=True):
    """The node is in: its session, where the control store is, the job's dir, the trace switch."""

    session: str
    node: int
    control_port: int
    job_dir: str
    trace: TraceSet | None = None
    # The newest of this session's reports the manager holds: the agent resends the rest
    acked: int = 0


class AgentRefused(Message, frozen=True):
    """The agent cannot join (wrong token, another job, a bad node rank, flags that differ); it
    exits."""

    reason: str


class AgentFenced(Message, frozen=True):
    """The node was declared lost and its ranks given away: kill every worker, then join afresh."""

    reason: str


class ManagerBeat(Message, frozen=True):
    """The manager's beat to each agent: an agent that stops hearing it reconnects."""

    t: float


class Acked(Message, frozen=True):
    """Every report of the session up to ``seq`` is in the manager's log (committed)."""

    seq: int


class SpawnRank(Message, frozen=True):
    """Give ``rank`` a process in ``record``'s generation; answered by RankSpawned."""

    rank: int
    record: GenerationRecord
    joining: bool
    resume_from: str
    incarnation: int


class KillRank(Message, frozen=True):
    rank: int
    signal: int


class TellRank(Message, frozen=True):
    """A command for one worker (Preempt, StopAt, ...), which the agent writes to it."""

    rank: int
    command: WorkerCommand


class ArmRank(Message, frozen=True):
    rank: int
    fault: ArmFault


class AbortRank(Message, frozen=True):
    """``Abort`` for ``rank``'s worker (``at_step_start``: a planned leave; ``from_step``: a lost
    peer's survivors; see ``Abort``)."""

    rank: int
    generation: int
    reason: str
    at_step_start: bool = False
    from_step: int = 0


class KeepSpares(Message, frozen=True):
    pass


class StopNode(Message, frozen=True):
    """Stop every worker of the node (SIGTERM, SIGKILL after ``grace_s``); answered by
    NodeStopped."""

    grace_s: float
    seq: int


class JobEnded(Message, frozen=True):
    """The job is over (succeeded, failed, stopped, preempted): the agent exits with
    ``exit_code``."""

    state: str
    reason: str
    exit_code: int


# --- a warm standby agent (``undying run --standby``) --------------------------

class StandbyJoin(Message, frozen=True):
    """First message of a standby agent: its join, checked as a node's would be (its ``node`` is
    ignored).

    It has no node until the manager gives it a lost one; it is parked meanwhile.
    """

    join: AgentJoin


class StandbyParked(Message, frozen=True):
    """The manager's answer to a standby's join: it is the job's, with no node yet; keep warm and
    beat.

    It carries what the standby's zygote and spares must know before they
    start (the job dir, the control store's port, the trace switch). When a
    node is lost the manager gives it that node with an ``AgentWelcome`` on
    the same connection (a new session, the node's number); from then on it is
    that node's agent.
    """

    control_port: int
    job_dir: str
    trace: TraceSet | None = None


class StandbyBeat(Message, frozen=True):
    """A parked standby's beat (about twice a second): it is alive, and how many of its spares are
    warm."""

    spares_ready: int
    t: float


FromAgent = AgentJoin | NumberedReports | StandbyJoin | StandbyBeat
Report = (Hello | StepBegun | StepCommitted | Progress | CommFailure | FaultInjected | Fatal
          | TraceSummary | Done | CheckpointSaved | Terminated | StopProposal | SpareEvent
          | NodeStep | AgentState | RankExited | RankSpawned | RankHung | RanksStalled
          | NodeStopped | NodeLeaving | TraceFileSet | TraceFileError)
ToAgent = (AgentWelcome | AgentRefused | AgentFenced | ManagerBeat | Acked | SpawnRank
           | KillRank | TellRank | ArmRank | AbortRank | KeepSpares | StopNode | TraceSet
           | JobEnded | StandbyParked)

# The reports the manager takes as its workers' messages (``on_messages``, in runs): what workers
# forward, and the agent's word on its spares, which the manager logs as it logs the workers'.
FROM_WORKERS: frozenset[type[Message]] = frozenset((*FORWARDED, SpareEvent))

_from_agent: Codec[FromAgent] = Codec(FromAgent, "agent's connection")
_to_agent: Codec[ToAgent] = Codec(ToAgent, "manager's connection")
_reports: Codec[Report] = Codec(Report, "agent's connection (a report)")

encode = Codec.encode
decode_from_agent = _from_agent.decode
decode_to_agent = _to_agent.decode
decode_agent_report = _reports.decode


def reports_line(first: int, reports: list[bytes]) -> bytes:
    """A NumberedReports line of reports already encoded as objects: the bytes ``encode`` would
    write."""
    return b'{"type":"NumberedReports","first":%d,"reports":[%s]}\n' % (first, b",".join(reports))
