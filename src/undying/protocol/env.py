"""The environment contract: every variable undying sets or reads, by name, defined here once.

The torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) keep
their names; undying's own all start with ``UNDYING_``, so a script's
environment shows at a glance which are ours, and the agent can pass them on
or drop them as a whole.

Each variable is one constant, named by rule: ``UNDYING_X`` is ``X_ENV``. No
other module spells an ``UNDYING_`` name (``tests/unit/test_one_name.py``
checks it): they import the constant, so a name is changed, or found, in one
place. How each one is read and bounded is ``undying.inputs.ENV_VARS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = [
    "ENV_PREFIX",
    # The job's settings, set by undying run from its options for every rank.
    "SEED_ENV", "VIRTUAL_RANKS_ENV", "NUMERICS_ENV", "VERIFY_EVERY_ENV", "REPLICATE_ENV",
    "REPLICATE_EVERY_ENV", "CHECKPOINT_DIR_ENV", "SAVE_EVERY_ENV", "SAVE_INTERVAL_ENV", "KEEP_ENV",
    "TRACE_DIR_ENV", "TRACE_MAX_FILE_MB_ENV", "TRACE_MAX_DIR_MB_ENV",
    "LOG_DIR_ENV", "REDIRECTS_ENV", "TEE_ENV", "CONSOLE_ENV",
    # The timeouts.
    "TIMEOUT_RENDEZVOUS_ENV", "TIMEOUT_CONNECT_ENV", "TIMEOUT_COLLECTIVE_ENV", "TIMEOUT_RECOVERY_ENV",
    "TIMEOUT_COMM_ERROR_GRACE_ENV", "TIMEOUT_STOP_GRACE_ENV", "TIMEOUT_HEARTBEAT_ENV",
    "TIMEOUT_INIT_ENV", "TIMEOUT_NODE_WAIT_ENV", "TIMEOUT_STEP_ENV", "TIMEOUT_SPARE_TAKE_ENV",
    "TIMEOUT_EXIT_ENV", "TIMEOUT_ENVS", "DEFAULT_HEARTBEAT_TIMEOUT_S",
    # Who a worker is and where it reaches its agent and manager, set by the agent for each worker.
    "JOB_ID_ENV", "JOB_DIR_ENV", "NODE_NAME_ENV", "AGENT_ADDR_ENV", "AGENT_PID_ENV",
    "CONTROL_ADDR_ENV", "STORE_ADDR_ENV", "GENERATION_ENV", "JOINING_ENV", "BACKEND_ENV",
    "INCARNATION_ENV", "RESUME_FROM_ENV", "RETURNED_FILE_ENV",
    # Secrets and keys.
    "TOKEN_ENV", "CHECKPOINT_KEY_ENV", "STORE_KEY_ENV", "AGENT_KEY_ENV", "VERIFY_KEY_ENV",
    "VERIFY_SERVE_DIR_ENV",
    # Switches a user (or a test) sets for undying's own processes.
    "WORKER_START_ENV", "HOST_NAME_ENV", "RESUME_DIGEST_ENV", "DEMO_QUIET_ENV",
]

# The prefix of them all: the verifier keeps none of a rank's but those it names (worker/verify.py).
ENV_PREFIX = "UNDYING_"

# --- the job's settings: set by undying run from its options, for every rank ---------------------
# `undying run --seed`: undying.init() seeds torch, random and NumPy from it (worker/seed.py).
SEED_ENV = "UNDYING_SEED"
# `undying run --virtual-ranks V`: invariant mode (worker/virtual.py).
VIRTUAL_RANKS_ENV = "UNDYING_VIRTUAL_RANKS"
# `undying run --numerics POLICY [--spike-factor F] [--rollback-steps N]`: the default of
# job.steps(numerics=...), as comma-separated field=value pairs of undying.Numerics (worker/numerics.py).
NUMERICS_ENV = "UNDYING_NUMERICS"
# `undying run --verify-every K`: every rank's verification period (worker/verify.py).
VERIFY_EVERY_ENV = "UNDYING_VERIFY_EVERY"
# `undying run --replicate off|ring` and `--replicate-every N`: in-memory replicas of each shard
# (worker/replica.py ReplicationConfig; the launcher's default when the flag is not given).
REPLICATE_ENV = "UNDYING_REPLICATE"
REPLICATE_EVERY_ENV = "UNDYING_REPLICATE_EVERY"
# `--checkpoint-dir`, `--save-every`, `--save-interval`, `--keep` (config.checkpoint_from_env, in a rank).
CHECKPOINT_DIR_ENV = "UNDYING_CHECKPOINT_DIR"
SAVE_EVERY_ENV = "UNDYING_SAVE_EVERY"
SAVE_INTERVAL_ENV = "UNDYING_SAVE_INTERVAL"
KEEP_ENV = "UNDYING_KEEP"
# `--trace-dir`, `--trace-max-file-mb`, `--trace-max-dir-mb` (config.trace_from_env, in a rank).
TRACE_DIR_ENV = "UNDYING_TRACE_DIR"
TRACE_MAX_FILE_MB_ENV = "UNDYING_TRACE_MAX_FILE_MB"
TRACE_MAX_DIR_MB_ENV = "UNDYING_TRACE_MAX_DIR_MB"
# A rank's output streams, set by the agent from --log-dir, --redirects, --tee and
# --local-ranks-filter (agent/torchrun_env.py; read by worker/streams.py): the log folder, the
# torchrun Std numbers (1 stdout, 2 stderr, 3 both), and "0" when the console hides this rank.
LOG_DIR_ENV = "UNDYING_LOG_DIR"
REDIRECTS_ENV = "UNDYING_REDIRECTS"
TEE_ENV = "UNDYING_TEE"
CONSOLE_ENV = "UNDYING_CONSOLE"

# --- the timeouts: undying.config.Timeouts' fields, in seconds (config.timeouts_from_env) -----------
TIMEOUT_RENDEZVOUS_ENV = "UNDYING_TIMEOUT_RENDEZVOUS"  # a rank: the wait for the next generation
TIMEOUT_CONNECT_ENV = "UNDYING_TIMEOUT_CONNECT"  # a rank: building a process group
TIMEOUT_COLLECTIVE_ENV = "UNDYING_TIMEOUT_COLLECTIVE"  # a rank: gloo's own collective timeout
TIMEOUT_RECOVERY_ENV = "UNDYING_TIMEOUT_RECOVERY"
TIMEOUT_COMM_ERROR_GRACE_ENV = "UNDYING_TIMEOUT_COMM_ERROR_GRACE"
TIMEOUT_STOP_GRACE_ENV = "UNDYING_TIMEOUT_STOP_GRACE"
# A rank beats well within it (worker/job.py), a spare at a quarter of it (worker_wire.spare_beat_interval).
TIMEOUT_HEARTBEAT_ENV = "UNDYING_TIMEOUT_HEARTBEAT"
TIMEOUT_INIT_ENV = "UNDYING_TIMEOUT_INIT"
TIMEOUT_NODE_WAIT_ENV = "UNDYING_TIMEOUT_NODE_WAIT"
# Read into a rank's Timeouts if set, but never shipped: only the agent judges a step's stall,
# from its own config (`--step-timeout`).
TIMEOUT_STEP_ENV = "UNDYING_TIMEOUT_STEP"
TIMEOUT_SPARE_TAKE_ENV = "UNDYING_TIMEOUT_SPARE_TAKE"
TIMEOUT_EXIT_ENV = "UNDYING_TIMEOUT_EXIT"  # a rank: how long its exit may take (worker/boot.py)
# Each timeout's variable by its field of undying.config.Timeouts (UNDYING_TIMEOUT_<FIELD>).
TIMEOUT_ENVS: Mapping[str, str] = MappingProxyType({
    "rendezvous": TIMEOUT_RENDEZVOUS_ENV, "connect": TIMEOUT_CONNECT_ENV,
    "collective": TIMEOUT_COLLECTIVE_ENV, "recovery": TIMEOUT_RECOVERY_ENV,
    "comm_error_grace": TIMEOUT_COMM_ERROR_GRACE_ENV, "stop_grace": TIMEOUT_STOP_GRACE_ENV,
    "heartbeat": TIMEOUT_HEARTBEAT_ENV, "init": TIMEOUT_INIT_ENV, "node_wait": TIMEOUT_NODE_WAIT_ENV,
    "step": TIMEOUT_STEP_ENV, "spare_take": TIMEOUT_SPARE_TAKE_ENV, "exit": TIMEOUT_EXIT_ENV,
})
# The heartbeat timeout's default, its one place: Timeouts.heartbeat, and a spare's beat period when
# the variable is unset (worker_wire.spare_beat_interval), and a job whose stored config lacks it.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0

# --- who a worker is and where it reaches its agent and manager: set by the agent for each worker --
JOB_ID_ENV = "UNDYING_JOB_ID"  # the job's id (worker/env.py)
JOB_DIR_ENV = "UNDYING_JOB_DIR"  # the job's folder: a script error's file, the verifier's (worker)
# What a rank's traces name its node by (worker/tracing.py).
NODE_NAME_ENV = "UNDYING_NODE_NAME"
AGENT_ADDR_ENV = "UNDYING_AGENT_ADDR"  # HOST:PORT of the agent's worker channel (worker/boot.py)
# The agent that started a process: its parent-death target (worker/boot.py), and the mark by which
# the agent knows a process a rank left behind as its own to end (agent/children.py, protocol/keys.py).
AGENT_PID_ENV = "UNDYING_AGENT_PID"
CONTROL_ADDR_ENV = "UNDYING_CONTROL_ADDR"  # HOST:PORT of the manager's control store (worker/env.py)
# HOST:PORT of the generation's store, which env:// rendezvous opens (protocol/store_client.py).
STORE_ADDR_ENV = "UNDYING_STORE_ADDR"
# The rank's generation (worker/env.py; kept current by worker/group.py for store_client.py).
GENERATION_ENV = "UNDYING_GENERATION"
JOINING_ENV = "UNDYING_JOINING"  # "1": a replacement joining a running generation (worker/env.py)
BACKEND_ENV = "UNDYING_BACKEND"  # gloo or nccl (worker/env.py)
INCARNATION_ENV = "UNDYING_INCARNATION"  # the manager's number for this holder of the rank
RESUME_FROM_ENV = "UNDYING_RESUME_FROM"  # a checkpoint to start from (worker/env.py)
# The file a rank writes when its script returned (agent/torchrun_env.py; worker/boot.py).
RETURNED_FILE_ENV = "UNDYING_RETURNED_FILE"

# --- secrets and keys (protocol/keys.py keeps the token out of every child's environment) ---------
# The job's token: a launcher's or a command's (manager/auth.py), never a worker's.
TOKEN_ENV = "UNDYING_TOKEN"
# Hex keys derived from the token, set by the agent for its workers: checkpoint manifests' MAC
# (checkpoint/mac.py) and the proof to the job's stores (protocol/store_wire.py).
CHECKPOINT_KEY_ENV = "UNDYING_CHECKPOINT_KEY"
STORE_KEY_ENV = "UNDYING_STORE_KEY"
# The key of a worker's channel to its agent (protocol/channel_key.py; agent/agent.py sets it).
AGENT_KEY_ENV = "UNDYING_AGENT_KEY"
# The verifier's own key and folder, set by a rank for the verifier it starts (worker/verify.py;
# worker/verifier.py, worker/verify_files.py): a process with the folder set serves as the verifier.
VERIFY_KEY_ENV = "UNDYING_VERIFY_KEY"
VERIFY_SERVE_DIR_ENV = "UNDYING_VERIFY_SERVE_DIR"

# --- switches a user or a test sets for undying's own processes -----------------------------------
WORKER_START_ENV = "UNDYING_WORKER_START"  # zygote (default) or spawn (agent/zygote.py)
HOST_NAME_ENV = "UNDYING_HOST_NAME"  # the host name an agent reports to its manager (agent/remote.py)
# "1": a rank's checkpoint_loaded event carries its restored state's digest (worker/shards.py, tests).
RESUME_DIGEST_ENV = "UNDYING_RESUME_DIGEST"
DEMO_QUIET_ENV = "UNDYING_DEMO_QUIET"  # set: `undying demo` prints no walkthrough (cli/demo.py)
