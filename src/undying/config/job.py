"""The job's settings: ``JobConfig``, which holds every section, and ``LaunchConfig``, how this node
starts its workers.

Its sections are the package's other modules: ``timeouts``, ``sections`` (checkpoint, trace)
and ``manager`` (the sockets' limits). ``JobConfig.to_dict``/``from_dict`` carry the whole
config to a manager on another host; ``differences`` says where two nodes of one job disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from undying.config.manager import PROGRESS_EVERY_S, ConnectionLimits, check_progress_every
from undying.config.sections import CheckpointConfig, TraceConfig
from undying.config.timeouts import Timeouts
from undying.errors import UsageError
from undying.inputs import check_job_id
from undying.protocol.env import TIMEOUT_ENVS

__all__ = ["JobConfig", "LaunchConfig", "STREAMS", "WHOLE_GROUP_LINE", "TRACKER_NAMES"]


# What the start banner and `undying status` say of a job whose script does not use the step API.
WHOLE_GROUP_LINE = ("whole-group restart: this script does not use undying's step API, "
                    "so a fault restarts every rank (--max-restarts {max_restarts}) "
                    "and a script that saves its own snapshot resumes from it; "
                    "to recover a rank in place instead, adopt the step API "
                    "(README: \"Adopting it\", about ten lines)")


# The experiment trackers the manager can send step.log values to (manager/trackers/).
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")


# The workers' output streams, as torchrun's --redirects/--tee take them: none, stdout, stderr,
# both.
STREAMS = ("none", "stdout", "stderr", "both")


@dataclass(frozen=True)
class LaunchConfig:
    """How this node starts its workers, as torchrun's flags say it (the same on every node, or per
    node).

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
    # The launcher's progress on its stderr (cli/progress_show.py): a live line on a terminal, else
    # a line every this many seconds; 0: neither. (Per node: a multi-node job's agent shows none.)
    progress_every: float = PROGRESS_EVERY_S

    def validate(self) -> None:
        if self.module and self.no_python:
            raise UsageError("-m/--module and --no-python exclude each other: "
                             "a module is run by Python")
        for option, table in (("--redirects", self.redirects), ("--tee", self.tee)):
            for local, std in table.items():
                if not 0 <= std <= 3 or local < -1:
                    raise UsageError(f"{option}: expected 0-3 or LOCAL_RANK:0-3,..., "
                                     f"got {local}:{std}")
        if (self.redirects or self.tee) and not self.log_dir:
            raise UsageError("--redirects/--tee need --log-dir DIR: "
                             "the folder the streams are written to")
        if not 0 <= self.master_port < 65536:
            raise UsageError(f"--master-port must be in [0, 65535], got {self.master_port}")
        check_progress_every(self.progress_every)
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
    # The fewest nodes it may train on (MIN of --nnodes MIN:MAX); 0: as many as nnodes (a fixed
    # size).
    min_nodes: int = 0
    host: str = "127.0.0.1"
    # The port of the manager's c10d store on one node: 0 picks a free one (as torchrun
    # --standalone does), so jobs side by side on a machine never collide; several nodes use the
    # `undying manager`'s own ports instead.
    port: int = 0
    http_port: int = 0
    backend: str = "gloo"
    # Whole-group restarts (torchrun's --max-restarts): every rank started again, from the latest
    # valid checkpoint or, for a script that does not use the step API, from the start (its own
    # snapshot is its to load).
    max_restarts: int = 3
    # Recoveries of faults at one step before the job stops (a fault repeating at one step is a
    # bug).
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
    # The job's seed: every worker's UNDYING_SEED (undying.init seeds torch, random and NumPy from
    # it).
    seed: int = 0
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    # The script uses undying's step API (it imports undying); False: a fault restarts the whole
    # group, no init or step timeout applies, and the banner and the status say so.
    step_api: bool = True
    # Experiment trackers (of TRACKER_NAMES) the manager sends each committed step's step.log
    # values to, once per step (manager/trackers/); () for none.
    trackers: tuple[str, ...] = ()

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
            raise UsageError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, "
                             f"got {self.min_nodes}:{self.nnodes}")
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
                f"--spares must be between 0 and {max(8, self.nproc_per_node)} "
                f"(a spare per local rank at most), got {self.spares}"
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
        for name in self.trackers:
            if name not in TRACKER_NAMES:
                raise UsageError(f"--trackers: unknown tracker {name!r}; choose from "
                                 f"{', '.join(TRACKER_NAMES)} (comma-separated)")
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
            body["trackers"] = tuple(str(name) for name in body.get("trackers", ()))
            return cls(**body)
        except (TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"a job configuration this version cannot read: {e}") from e

    def differences(self, other: JobConfig) -> list[str]:
        """The flags in which two nodes of one job disagree (per-node ones aside)."""
        mine, theirs = _flatten(self.to_dict()), _flatten(other.to_dict())
        per_node = {"node_rank", "job_dir", "host", "port", "http_port", "trace.trace_switch_file",
                    "job_id_given", "open_status"}
        per_node |= {"launch.log_dir", "launch.local_ranks_filter", "launch.progress_every"}
        return sorted(k for k in mine.keys() | theirs.keys()
                      if k not in per_node
                      and not k.startswith(("connections.", "launch.redirects", "launch.tee"))
                      and mine.get(k) != theirs.get(k))

    def timeout_env(self) -> dict[str, str]:
        """The timeouts a worker reads, as environment variables: those of ``TIMEOUT_ENVS``, no
        other.

        The rest (the step timeout, the recovery's, a spare's take, ...) are judged by the agent
        or the manager from its own config: no worker code reads them, so none is sent.
        """
        return {name: repr(getattr(self.timeouts, field)) for field, name in TIMEOUT_ENVS.items()}

def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
