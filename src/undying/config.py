"""The job's configuration: one dataclass, one environment prefix (``UNDYING_``).

One name per value, by rule: the option ``--a-b`` of ``undying run`` is the field ``a_b`` of
``JobConfig`` or of exactly one of its sections (``timeouts``, ``checkpoint``, ``trace``,
``connections``, ``launch``): ``--exit-grace`` is ``timeouts.exit_grace``, ``--trace-dir`` is
``trace.trace_dir``. Its default is written once, on the field: the option's default is the
field's (``cli/settings.py``), and its help shows it with argparse's ``%(default)``. The
options of ``undying manager`` are ``manager.service.ManagerOptions``' fields by the same rule.
``tests/unit/test_one_name.py`` checks all of it on the syntax tree.

Every timeout is positive and bounded; defaults suit a real cluster, tests pass
short ones. Workers receive the timeouts they read through their environment
(``JobConfig.timeout_env``), so that a replacement process sees exactly what
the first one saw; no other is sent.
"""

from __future__ import annotations

import dataclasses
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from undying.errors import UsageError
from undying.inputs import check_finite, check_job_id, env_value
from undying.protocol.env import (
    CHECKPOINT_DIR_ENV,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    KEEP_ENV,
    REPLICATE_ENV,
    REPLICATE_EVERY_ENV,
    SAVE_EVERY_ENV,
    SAVE_INTERVAL_ENV,
    TIMEOUT_ENVS,
    TRACE_DIR_ENV,
    TRACE_MAX_DIR_MB_ENV,
    TRACE_MAX_FILE_MB_ENV,
)

__all__ = [
    "JobConfig",
    "CheckpointConfig",
    "Timeouts",
    "timeouts_from_env",
    "flag",
    "checkpoint_from_env",
    "TraceConfig",
    "TRACE_INITIAL",
    "trace_from_env",
    "EXIT_PREEMPTED",
    "EXIT_PREEMPTED_BEHIND",
    "EXIT_FENCED",
    "DEFAULT_MANAGER_PORT",
    "ConnectionLimits",
    "ManagerOptions",
    "default_max_connections",
    "LaunchConfig",
    "worker_dir",
    "WHOLE_GROUP_LINE",
]

_MAX_TIMEOUT_S = 24 * 3600.0


def flag(field_name: str) -> str:
    """The option of a field, by the rule: ``exit_grace`` is ``--exit-grace``."""
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class Timeouts:
    """Seconds. Each must be > 0 and <= one day; the step timeout may be None (auto).

    Each field is its option of ``undying run`` (``--exit-grace`` is ``exit_grace``). A rank is
    sent, and reads, only those of ``protocol.env.TIMEOUT_ENVS``; the agent and the manager judge
    the others from their own config.
    """

    # A worker waits this long for the manager to open the next generation.
    rendezvous_timeout: float = 300.0
    # Building a process group (connecting every pair of ranks).
    connect_timeout: float = 120.0
    # A collective that makes no progress (gloo's own timeout).
    collective_timeout: float = 600.0
    # A recovery that has not completed its first step by then escalates.
    recovery_timeout: float = 600.0
    # A collective error with every process alive waits this long for a
    # process exit before it is treated as a transient communication error.
    comm_error_grace: float = 1.0
    # Graceful stop: SIGTERM, then SIGKILL after this.
    stop_grace: float = 10.0
    # A started rank that sends no heartbeat for this long is hung (stopped,
    # or stuck with the interpreter locked): it is killed and replaced.
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    # From spawning a rank to its first word (the script's imports run meanwhile),
    # and from then to its first completed step.
    init_timeout: float = 600.0
    # A lost node's ranks wait this long for a replacement host. Then the job goes on without
    # it: on fewer nodes when --nnodes MIN:MAX allows, else from a checkpoint of the survivors'
    # state once enough nodes have joined. Also how long a job of MIN:MAX nodes waits, once
    # MIN have joined, for the others before it starts.
    node_wait: float = 60.0
    # A rank that beats but makes no progress in a step (enters no collective,
    # completes no step) for this long is stuck. None: auto, derived where it is judged from the
    # observed step times (agent/liveness.py step_timeout: AUTO_STEP_TIMEOUT_FACTOR x the slowest
    # recent step, at least AUTO_STEP_TIMEOUT_FLOOR_S).
    step_timeout: float | None = None
    # A warm spare given a rank must say it took it within this long (it only has to read
    # one line and answer): one stopped or wedged is killed and the rank goes to another
    # spare or a fresh process, instead of the recovery waiting out ``init_timeout``.
    spare_take_timeout: float = 2.0
    # A rank whose script returned but whose process has not exited this long after (stuck in its
    # own exit: a thread that never ends, a deadlocked atexit handler) is killed; the job's result
    # stands, with the stuck exit noted. Never the init timeout: the script's work is done.
    exit_grace: float = 10.0

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "step_timeout":
                continue  # auto
            if not (0 < value <= _MAX_TIMEOUT_S):  # nan and inf fail this too
                raise UsageError(
                    f"{flag(f.name)} must be > 0 and <= {_MAX_TIMEOUT_S:.0f} seconds, got {value}"
                )


# With --step-timeout auto: the slowest recent step times this, but never
# less than the floor (a step that needs a minute now and then is not a hang).
AUTO_STEP_TIMEOUT_FLOOR_S = 30.0
AUTO_STEP_TIMEOUT_FACTOR = 10.0


# The launcher's (and a worker's) exit code after a preemption (SIGTERM) whose
# dying-gasp checkpoint of the stop step stands (or one holding every committed
# step): run the same command again to resume, no step lost. 75 is EX_TEMPFAIL ("try again later"); 143 stays a plain SIGTERM stop.
EXIT_PREEMPTED = 75
# Preempted, and the dying gasp of the stop step was not written (a full disk, the grace period
# ran out): an older checkpoint stands and a resume re-runs the steps after it (the exit reason
# counts them). Not 75, which promises nothing is lost. 74 is EX_IOERR: the state did not reach storage.
EXIT_PREEMPTED_BEHIND = 74
# A worker whose rank was given to a newer process (its host was declared lost) exits with this.
EXIT_FENCED = 76
# A worker that saved or handed on its state in a regroup generation and left: the job starts
# again from that checkpoint on its new set of nodes.
EXIT_REGROUPED = 77
# A worker whose script could not run: a SyntaxError or ImportError (printed by the worker in a few
# lines). No fault to recover from: the job fails at once. 78 is EX_CONFIG.
EXIT_SCRIPT_ERROR = 78
# A worker whose rank an operator moved to another process (`undying migrate`): it leaves at a step
# boundary, its replacement takes the state from a peer; the manager expects this exit.
EXIT_MIGRATED = 79
# Where the first rank whose script could not run leaves the error, in the job dir, for the manager.
SCRIPT_ERROR_FILE = "script-error.txt"
# Each worker process's own folder in the job dir: <job dir>/workers/<rank>-<incarnation>/, holding
# torchrun's error file (error.json, TORCHELASTIC_ERROR_FILE) and the mark that its script returned.
WORKERS_DIR = "workers"
ERROR_FILE = "error.json"
# In the job dir: what the launcher, an agent and their ranks wrote to a terminal after it hung up (agent.hangup).
HANGUP_LOG = "launcher.log"
RETURNED_FILE = "returned"


def worker_dir(job_dir: str, rank: int, incarnation: int) -> str:
    """The folder of the process that holds ``rank`` as ``incarnation`` (the agent and the manager agree on it)."""
    return os.path.join(os.path.abspath(job_dir), WORKERS_DIR, f"{rank}-{incarnation}")


# What the start banner and `undying status` say of a job whose script does not use the step API.
WHOLE_GROUP_LINE = ("whole-group restart: this script does not use undying's step API, so a fault restarts every "
                    "rank (--max-restarts {max_restarts}) and a script that saves its own snapshot resumes from "
                    "it; to recover a rank in place instead, adopt the step API (README: \"Adopting it\", about "
                    "ten lines)")

# `undying manager`'s agent port; the control store is on the next port, its HTTP API on the one after.
DEFAULT_MANAGER_PORT = 29400


@dataclass(frozen=True)
class CheckpointConfig:
    """Persistent checkpoints: where, how often, how many; and the dying gasp on SIGTERM."""

    # A folder or fsspec URL; "" means <job dir>/checkpoints.
    checkpoint_dir: str = ""
    # Save after every N committed steps (0: not by steps).
    save_every: int = 0
    # Save when this many seconds passed since the last save (0: not by time).
    save_interval: float = 0.0
    # Checkpoints kept (the latest valid one is always kept).
    keep: int = 3
    # Seconds from SIGTERM to every process gone; 0: sized from the measured checkpoint.
    grace_period: float = 0.0
    # A second SIGTERM within this many seconds of a dying gasp reuses it.
    gasp_reuse_within: float = 60.0
    # Sharded state: "ring" keeps a copy of each rank's shard on its ring successor (worker.replica).
    replicate: str = "off"
    # With replicate="ring": replicate every this many steps (a fault re-runs up to K-1 steps).
    replicate_every: int = 1

    def validate(self) -> None:
        for option, value in (("--save-interval", self.save_interval), ("--grace-period", self.grace_period),
                              ("--gasp-reuse-within", self.gasp_reuse_within)):
            check_finite(option, value)
        if self.save_every < 0:
            raise UsageError(f"--save-every must be >= 0 steps, got {self.save_every}")
        if self.save_interval < 0:
            raise UsageError(f"--save-interval must be >= 0 seconds, got {self.save_interval}")
        if self.keep < 1:
            raise UsageError(f"--keep must be at least 1, got {self.keep}")
        if self.grace_period < 0 or self.grace_period > _MAX_TIMEOUT_S:
            raise UsageError(f"--grace-period must be between 0 (auto) and {_MAX_TIMEOUT_S:.0f}, got {self.grace_period}")
        if self.gasp_reuse_within < 0:
            raise UsageError(f"--gasp-reuse-within must be >= 0 seconds, got {self.gasp_reuse_within}")
        if self.replicate not in ("off", "ring"):
            raise UsageError(f"--replicate must be off or ring, got {self.replicate!r}")
        if self.replicate_every < 1:
            raise UsageError(f"--replicate-every must be at least 1 step, got {self.replicate_every}")

    def env(self, job_dir: str) -> dict[str, str]:
        return {
            CHECKPOINT_DIR_ENV: self.resolved_dir(job_dir),
            SAVE_EVERY_ENV: str(self.save_every),
            SAVE_INTERVAL_ENV: repr(self.save_interval),
            KEEP_ENV: str(self.keep),
            REPLICATE_ENV: self.replicate,  # read by undying.worker.replica.ReplicationConfig
            REPLICATE_EVERY_ENV: str(self.replicate_every),
        }

    def resolved_dir(self, job_dir: str) -> str:
        if self.checkpoint_dir:
            return self.checkpoint_dir if "://" in self.checkpoint_dir else os.path.abspath(self.checkpoint_dir)
        return os.path.join(os.path.abspath(job_dir), "checkpoints")


def checkpoint_from_env(env: os._Environ[str] | dict[str, str] | None = None) -> CheckpointConfig:
    env = os.environ if env is None else env
    given = _given(env, save_every=SAVE_EVERY_ENV, save_interval=SAVE_INTERVAL_ENV, keep=KEEP_ENV)
    return CheckpointConfig(checkpoint_dir=env.get(CHECKPOINT_DIR_ENV, ""), **given)


def _given(env: Mapping[str, str], **names: str) -> dict[str, Any]:
    """The fields whose variable (``names``: field=variable) is set in ``env``, each read by its one reader.

    A field left out keeps its dataclass default: each default is written once, on its field.
    """
    return {field: value for field, name in names.items() if (value := env_value(name, env)) is not None}


@dataclass(frozen=True)
class TraceConfig:
    """Lightweight tracing (undying.trace): where records go, how big they may grow, the first setting."""

    # A folder; "" means <job dir>/traces. Records go to <dir>/<job id>/<rank>/.
    trace_dir: str = ""
    # A new record file when the newest passes this size.
    trace_max_file_mb: float = 10.0
    # The oldest 20% of the trace files are deleted when the folder passes this size.
    trace_max_dir_mb: float = 1000.0
    # The switch at start: off, on (step, ckpt, fp and data markers) or comm (those and collectives).
    trace: str = "off"
    # A JSON file watched for the switch (a mounted Kubernetes ConfigMap), e.g. {"step": "on", "comm": "off"}.
    trace_switch_file: str = ""

    def validate(self) -> None:
        check_finite("--trace-max-file-mb", self.trace_max_file_mb)
        check_finite("--trace-max-dir-mb", self.trace_max_dir_mb)
        if self.trace not in TRACE_INITIAL:
            raise UsageError(f"--trace must be one of {', '.join(TRACE_INITIAL)}, got {self.trace!r}")
        if not 0 < self.trace_max_file_mb <= 100_000:
            raise UsageError(f"--trace-max-file-mb must be > 0, got {self.trace_max_file_mb}")
        if not 0 < self.trace_max_dir_mb <= 100_000_000:
            raise UsageError(f"--trace-max-dir-mb must be > 0, got {self.trace_max_dir_mb}")
        if self.trace_max_dir_mb < self.trace_max_file_mb:
            raise UsageError(
                f"--trace-max-dir-mb ({self.trace_max_dir_mb}) must be at least --trace-max-file-mb "
                f"({self.trace_max_file_mb})"
            )

    def resolved_dir(self, job_dir: str) -> str:
        return os.path.abspath(self.trace_dir) if self.trace_dir else os.path.join(os.path.abspath(job_dir), "traces")

    def env(self, job_dir: str) -> dict[str, str]:
        return {
            TRACE_DIR_ENV: self.resolved_dir(job_dir),
            TRACE_MAX_FILE_MB_ENV: repr(self.trace_max_file_mb),
            TRACE_MAX_DIR_MB_ENV: repr(self.trace_max_dir_mb),
        }


TRACE_INITIAL = ("off", "on", "comm")


def trace_from_env(env: os._Environ[str] | dict[str, str] | None = None) -> TraceConfig:
    env = os.environ if env is None else env
    given = _given(env, trace_max_file_mb=TRACE_MAX_FILE_MB_ENV, trace_max_dir_mb=TRACE_MAX_DIR_MB_ENV)
    return TraceConfig(trace_dir=env.get(TRACE_DIR_ENV, ""), **given)


# A listening socket's header and idle timeouts are tens of seconds at most (undying.manager.conns).
_MAX_CONN_TIMEOUT_S = 60.0


def default_max_connections() -> int:
    """A quarter of this process's descriptor limit (the rest stays for the job), 16 to 1024."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 4))


@dataclass(frozen=True)
class ConnectionLimits:
    """Seconds and counts that bound each listening socket of the manager (HTTP API and agents' port)."""

    # From accept (or the end of the previous response) to a request's complete headers; also a body's limit.
    http_header_timeout: float = 10.0
    # A keep-alive connection with no request for this long is closed.
    http_idle_timeout: float = 30.0
    # Open connections per listening socket; 0: a quarter of RLIMIT_NOFILE, 16 to 1024.
    max_connections: int = 0

    def validate(self) -> None:
        for option, value in (("--http-header-timeout", self.http_header_timeout),
                              ("--http-idle-timeout", self.http_idle_timeout)):
            check_finite(option, value)
            if not 0 < value <= _MAX_CONN_TIMEOUT_S:
                raise UsageError(f"{option} must be > 0 and <= {_MAX_CONN_TIMEOUT_S:.0f} seconds, got {value}")
        if not 0 <= self.max_connections <= 65536:
            raise UsageError(f"--max-connections must be between 0 (auto) and 65536, got {self.max_connections}")

    @property
    def cap(self) -> int:
        return self.max_connections or default_max_connections()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ConnectionLimits:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})



@dataclass(frozen=True, kw_only=True)
class ManagerOptions:
    """``undying manager``'s options, each the field of its name by the rule (``--http-port``: ``http_port``)."""

    job_id: str
    job_dir: str
    # The address agents join on (and the HTTP API's): this host only by default.
    host: str = "127.0.0.1"
    # Where agents join; the control store is on the next port.
    port: int = DEFAULT_MANAGER_PORT
    # The HTTP API's port (the command's default: --port + 2).
    http_port: int
    open_status: bool = False
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)


# The workers' output streams, as torchrun's --redirects/--tee take them: none, stdout, stderr, both.
STREAMS = ("none", "stdout", "stderr", "both")


@dataclass(frozen=True)
class LaunchConfig:
    """How this node starts its workers, as torchrun's flags say it (the same on every node, or per node).

    ``redirects``/``tee``: per local rank (key -1: every rank not named) a number 0-3 (torchrun's
    ``Std``: 0 none, 1 stdout, 2 stderr, 3 both) of the streams that go to a file under
    ``log_dir`` (redirects: only there; tee: there and on the console). ``local_ranks_filter``:
    the local ranks whose output reaches the console (empty: all).
    """

    # Run the script as a module (python -m), or as an executable with no Python (--no-python).
    module: bool = False
    no_python: bool = False
    log_dir: str = ""
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: tuple[int, ...] = ()
    # ROLE_NAME, as torchrun's --role gives it.
    role: str = "default"
    # MASTER_ADDR/MASTER_PORT: where a script that hosts its own store (rank 0) puts it; "" and 0:
    # loopback and a free port on one node; the manager's host and port 29500 on several.
    master_addr: str = ""
    master_port: int = 0

    def validate(self) -> None:
        if self.module and self.no_python:
            raise UsageError("-m/--module and --no-python exclude each other: a module is run by Python")
        for option, table in (("--redirects", self.redirects), ("--tee", self.tee)):
            for local, std in table.items():
                if not 0 <= std <= 3 or local < -1:
                    raise UsageError(f"{option}: expected 0-3 or LOCAL_RANK:0-3,..., got {local}:{std}")
        if (self.redirects or self.tee) and not self.log_dir:
            raise UsageError("--redirects/--tee need --log-dir DIR: the folder the streams are written to")
        if not 0 <= self.master_port < 65536:
            raise UsageError(f"--master-port must be in [0, 65535], got {self.master_port}")
        if not self.role or len(self.role) > 256 or not self.role.isprintable():
            raise UsageError(f"--role must be 1 to 256 printable characters, got {self.role!r:.80}")

    def streams(self, local_rank: int, table: dict[int, int]) -> int:
        """The torchrun Std number (0-3) for ``local_rank`` in ``table``."""
        return table.get(local_rank, table.get(-1, 0))


@dataclass(frozen=True)
class JobConfig:
    job_id: str
    job_dir: str
    nproc_per_node: int = 1
    nnodes: int = 1  # the most nodes the job trains on (MAX of --nnodes MIN:MAX)
    node_rank: int = 0
    # The fewest nodes it may train on (MIN of --nnodes MIN:MAX); 0: as many as nnodes (a fixed size).
    min_nodes: int = 0
    host: str = "127.0.0.1"
    port: int = 29500
    http_port: int = 0
    backend: str = "gloo"
    # Whole-group restarts (torchrun's --max-restarts): every rank started again, from the latest
    # valid checkpoint or, for a script that does not use the step API, from the start (its own
    # snapshot is its to load).
    max_restarts: int = 3
    # Recoveries of faults at one step before the job stops (a fault repeating at one step is a bug).
    max_step_recoveries: int = 3
    # In-place retries of a communication error at one step before the rank is replaced.
    max_retries: int = 3
    # Hot spares per node: processes with torch imported, waiting to replace a rank.
    spares: int = 1
    timeouts: Timeouts = field(default_factory=Timeouts)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    # Timeouts and a cap for the manager's HTTP API and agents' port.
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    # Serve the read-only status (the page, /api/status, /metrics) without the token.
    open_status: bool = False
    # The user named the job (--job-id) rather than taking the random default: a checkpoint
    # of another job in the checkpoint folder is then refused at start, not resumed.
    job_id_given: bool = True
    # Every checkpoint in the folder rejected (corrupt, unsigned, ...): start from step 1 anyway
    # instead of stopping with the list of reasons.
    start_fresh: bool = False
    # Train again a job whose log says it already succeeded (else: say so and exit 0).
    force: bool = False
    # The job's seed: every worker's UNDYING_SEED (undying.init seeds torch, random and NumPy from it).
    seed: int = 0
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    # The script uses undying's step API (it imports undying); False: a fault restarts the whole group,
    # no init or step timeout applies, and the banner and the status say so.
    step_api: bool = True

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.resolved_dir(self.job_dir)

    @property
    def world_size(self) -> int:
        """The most ranks (every node of --nnodes present); an elastic job may train on fewer."""
        return self.nproc_per_node * self.nnodes

    @property
    def fewest_nodes(self) -> int:
        return self.min_nodes or self.nnodes

    @property
    def elastic(self) -> bool:
        return self.fewest_nodes < self.nnodes

    def validate(self) -> None:
        check_job_id(self.job_id, "the job id")
        if self.nproc_per_node < 1:
            raise UsageError(
                f"--nproc-per-node must be at least 1, got {self.nproc_per_node}; "
                "pass the number of worker processes to start on this node"
            )
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.min_nodes <= self.nnodes:
            raise UsageError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {self.min_nodes}:{self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}"
            )
        if not 0 <= self.port < 65536:
            raise UsageError(f"--port must be in [0, 65535], got {self.port}")
        if not 0 <= self.http_port < 65536:
            raise UsageError(f"--http-port must be in [0, 65535], got {self.http_port}")
        if not 0 <= self.spares <= max(8, self.nproc_per_node):
            raise UsageError(
                f"--spares must be between 0 and {max(8, self.nproc_per_node)} (a spare per local rank "
                f"at most), got {self.spares}"
            )
        if self.max_retries < 0:
            raise UsageError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.max_step_recoveries < 0:
            raise UsageError(f"--max-step-recoveries must be >= 0, got {self.max_step_recoveries}")
        if not 0 <= self.seed < 2**63:
            raise UsageError(f"--seed must be between 0 and 2**63-1, got {self.seed}")
        if self.backend not in ("gloo", "nccl"):
            raise UsageError(f"--backend must be gloo or nccl, got {self.backend!r}")
        self.timeouts.validate()
        self.checkpoint.validate()
        self.trace.validate()
        self.connections.validate()
        self.launch.validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """The inverse of ``to_dict`` (an agent's flags, sent to a manager on another host)."""
        try:
            known = {f.name for f in dataclasses.fields(cls)}
            body = {k: v for k, v in data.items() if k in known}
            body["timeouts"] = Timeouts(**body.get("timeouts", {}))
            body["checkpoint"] = CheckpointConfig(**body.get("checkpoint", {}))
            body["trace"] = TraceConfig(**body.get("trace", {}))
            body["connections"] = ConnectionLimits.from_dict(body.get("connections"))
            launch = dict(body.get("launch", {}))
            for table in ("redirects", "tee"):  # (JSON keys are strings)
                launch[table] = {int(k): int(v) for k, v in launch.get(table, {}).items()}
            launch["local_ranks_filter"] = tuple(launch.get("local_ranks_filter", ()))
            body["launch"] = LaunchConfig(**launch)
            return cls(**body)
        except (TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"a job configuration this version cannot read: {e}") from e

    def differences(self, other: JobConfig) -> list[str]:
        """The flags in which two nodes of one job disagree (per-node ones aside)."""
        mine, theirs = _flatten(self.to_dict()), _flatten(other.to_dict())
        per_node = {"node_rank", "job_dir", "host", "port", "http_port", "trace.trace_switch_file", "job_id_given",
                    "open_status"}
        per_node |= {"launch.log_dir", "launch.local_ranks_filter"}
        return sorted(k for k in mine.keys() | theirs.keys()
                      if k not in per_node and not k.startswith(("connections.", "launch.redirects", "launch.tee"))
                      and mine.get(k) != theirs.get(k))

    def timeout_env(self) -> dict[str, str]:
        """The timeouts a worker reads, as environment variables: those of ``TIMEOUT_ENVS``, no other.

        The rest (the step timeout, the recovery's, a spare's take, ...) are judged by the agent
        or the manager from its own config: no worker code reads them, so none is sent.
        """
        return {name: repr(getattr(self.timeouts, field)) for field, name in TIMEOUT_ENVS.items()}


def timeouts_from_env(env: os._Environ[str] | dict[str, str] | None = None) -> Timeouts:
    """A worker's timeouts: those it reads (``TIMEOUT_ENVS``) from its environment, the rest their defaults."""
    env = os.environ if env is None else env
    kwargs: dict[str, Any] = {}
    for field_name, name in TIMEOUT_ENVS.items():
        raw = env.get(name)
        if raw is None:
            continue
        try:
            kwargs[field_name] = float(raw)
        except ValueError as e:
            raise UsageError(f"{name}={raw!r} is not a number of seconds") from e
    timeouts = Timeouts(**kwargs)
    timeouts.validate()
    return timeouts


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
