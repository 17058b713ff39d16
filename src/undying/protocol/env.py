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
    "LOG_DIR_ENV", "REDIRECTS_ENV", "TEE_ENV", "CONSOLE_ENV", "VERBOSE_ENV",
    "LIVE_LINE_ENV",
    # The timeouts a rank reads.
    "TIMEOUT_RENDEZVOUS_ENV", "TIMEOUT_CONNECT_ENV", "TIMEOUT_COLLECTIVE_ENV",
    "TIMEOUT_HEARTBEAT_ENV", "TIMEOUT_EXIT_ENV", "TIMEOUT_ENVS", "DEFAULT_HEARTBEAT_TIMEOUT_S",
    # Who a worker is and where it reaches its agent and manager, set by the agent for each worker.
    "JOB_ID_ENV", "JOB_DIR_ENV", "NODE_NAME_ENV", "AGENT_ADDR_ENV", "AGENT_PID_ENV",
    "CONTROL_ADDR_ENV", "STORE_ADDR_ENV", "GENERATION_ENV", "JOINING_ENV", "BACKEND_ENV",
    "INCARNATION_ENV", "RESUME_FROM_ENV", "RETURNED_FILE_ENV",
    # Secrets and keys.
    "TOKEN_ENV", "CHECKPOINT_KEY_ENV", "STORE_KEY_ENV", "AGENT_KEY_ENV", "VERIFY_KEY_ENV",
    "VERIFY_SERVE_DIR_ENV",
    # Switches a user (or a test) sets for undying's own processes.
    "WORKER_START_ENV", "HOST_NAME_ENV", "RESUME_DIGEST_ENV", "DEMO_QUIET_ENV",
    "PROMETHEUS_DIR_ENV",
]

# The prefix of them all: a verifier keeps none of a rank's but those it names (worker/verify.py).
ENV_PREFIX = "UNDYING_"

# --- the job's settings: set by undying run from its options, for every rank ---------------------
# `--seed`: undying.init() seeds torch, random and NumPy from it (worker/seed.py).
SEED_ENV = "UNDYING_SEED"
# `--virtual-ranks V`: invariant mode (worker/virtual.py).
VIRTUAL_RANKS_ENV = "UNDYING_VIRTUAL_RANKS"
# `--numerics POLICY [--spike-factor F] [--rollback-steps N]`: the default of
# job.steps(numerics=...), as field=value pairs of undying.Numerics (worker/numerics.py).
NUMERICS_ENV = "UNDYING_NUMERICS"
# `--verify-every K`: every K steps one rank's step is replayed (worker/verify.py).
VERIFY_EVERY_ENV = "UNDYING_VERIFY_EVERY"
# `--replicate off|ring`: in-memory replicas of each shard (worker/replica.py; and the
# launcher's value when the flag is not given, cli/run_config.py).
REPLICATE_ENV = "UNDYING_REPLICATE"
# `--replicate-every N`: replicate every N steps (the same readers).
REPLICATE_EVERY_ENV = "UNDYING_REPLICATE_EVERY"
# `--checkpoint-dir`: where a rank's checkpoints go (config.checkpoint_from_env).
CHECKPOINT_DIR_ENV = "UNDYING_CHECKPOINT_DIR"
# `--save-every`: a rank saves every N committed steps (config.checkpoint_from_env).
SAVE_EVERY_ENV = "UNDYING_SAVE_EVERY"
# `--save-interval`: a rank saves every S seconds (config.checkpoint_from_env).
SAVE_INTERVAL_ENV = "UNDYING_SAVE_INTERVAL"
# `--keep`: checkpoints kept (config.checkpoint_from_env).
KEEP_ENV = "UNDYING_KEEP"
# `--trace-dir`: where a rank's trace records go (config.trace_from_env).
TRACE_DIR_ENV = "UNDYING_TRACE_DIR"
# `--trace-max-file-mb`: a new record file past this size (config.trace_from_env).
TRACE_MAX_FILE_MB_ENV = "UNDYING_TRACE_MAX_FILE_MB"
# `--trace-max-dir-mb`: the trace folder's cap (config.trace_from_env).
TRACE_MAX_DIR_MB_ENV = "UNDYING_TRACE_MAX_DIR_MB"
# A rank's output streams, set by the agent (agent/torchrun_env.py) and read by worker/streams.py:
# `--log-dir`: the rank's log folder;
LOG_DIR_ENV = "UNDYING_LOG_DIR"
# `--redirects`: torchrun's Std number of the streams that go to the folder only (1, 2, 3: both);
REDIRECTS_ENV = "UNDYING_REDIRECTS"
# `--tee`: the Std number of those that go to the folder and the console;
TEE_ENV = "UNDYING_TEE"
# `--local-ranks-filter`: "0" when the console hides this rank.
CONSOLE_ENV = "UNDYING_CONSOLE"
# `undying -v`: "1" when a rank's own log lines at INFO go to its stderr too (set by the launcher,
# cli/run_job.py; read in each rank, config/console.py). Else a rank shows WARNING and above.
VERBOSE_ENV = "UNDYING_VERBOSE"
# "1" when the launcher draws its live progress line on the terminal the ranks share (set by
# cli/progress_show.py): a rank's print on that terminal first erases the line (worker/streams.py),
# which the launcher draws again below it.
LIVE_LINE_ENV = "UNDYING_LIVE_LINE"

# --- the timeouts a rank reads: undying.config.Timeouts' fields, in seconds ---------------------
# Set for every rank from undying run's options (config.JobConfig.timeout_env), read back into the
# rank's Timeouts (config.timeouts_from_env, worker/env.py). Only these: the other timeouts (the
# step's, the recovery's, a spare's take, ...) are judged by the agent or the manager from its own
# config, so none of them is sent to a rank. Each line says which rank's code reads it.
# `--rendezvous-timeout`: a rank's wait for the next generation (worker/job.py, worker/rejoin.py).
TIMEOUT_RENDEZVOUS_ENV = "UNDYING_TIMEOUT_RENDEZVOUS"
# `--connect-timeout`: a rank's building of a process group (worker/rejoin.py).
TIMEOUT_CONNECT_ENV = "UNDYING_TIMEOUT_CONNECT"
# `--collective-timeout`: gloo's own collective timeout, in a rank (worker/rejoin.py).
TIMEOUT_COLLECTIVE_ENV = "UNDYING_TIMEOUT_COLLECTIVE"
# `--heartbeat-timeout`: a rank beats well within it (worker/heartbeat.py), a spare at a quarter of
# it (worker_wire.spare_beat_interval).
TIMEOUT_HEARTBEAT_ENV = "UNDYING_TIMEOUT_HEARTBEAT"
# `--exit-grace`: how long a rank's exit may take once its script returned (worker/boot.py).
TIMEOUT_EXIT_ENV = "UNDYING_TIMEOUT_EXIT"
# Each of them by its field of undying.config.Timeouts: what a rank is sent, and reads.
TIMEOUT_ENVS: Mapping[str, str] = MappingProxyType({
    "rendezvous_timeout": TIMEOUT_RENDEZVOUS_ENV, "connect_timeout": TIMEOUT_CONNECT_ENV,
    "collective_timeout": TIMEOUT_COLLECTIVE_ENV, "heartbeat_timeout": TIMEOUT_HEARTBEAT_ENV,
    "exit_grace": TIMEOUT_EXIT_ENV,
})
# The heartbeat timeout's default, its one place: Timeouts.heartbeat_timeout, a spare's beat when
# the variable is unset (worker_wire.spare_beat_interval), a stored config without it (manager).
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0

# --- who a worker is and where it reaches its agent and manager: set by the agent, each worker ---
# The job's id (worker/env.py).
JOB_ID_ENV = "UNDYING_JOB_ID"
# The job's folder: where a script error is told, the verifier's files (worker/boot.py, verify.py).
JOB_DIR_ENV = "UNDYING_JOB_DIR"
# What a rank's traces name its node by (worker/tracing.py).
NODE_NAME_ENV = "UNDYING_NODE_NAME"
# HOST:PORT of the agent's worker channel (worker/env.py, worker/boot.py for a spare).
AGENT_ADDR_ENV = "UNDYING_AGENT_ADDR"
# The agent that started a process: its parent-death target (worker/boot.py), and the mark by
# which the agent knows a process a rank left behind as its own (agent/children.py, keys.py).
AGENT_PID_ENV = "UNDYING_AGENT_PID"
# HOST:PORT of the manager's control store (worker/env.py).
CONTROL_ADDR_ENV = "UNDYING_CONTROL_ADDR"
# HOST:PORT of the generation's store, which env:// rendezvous opens (protocol/store_client.py).
STORE_ADDR_ENV = "UNDYING_STORE_ADDR"
# The rank's generation (worker/env.py; kept current by worker/group.py for store_client.py).
GENERATION_ENV = "UNDYING_GENERATION"
# "1": a replacement joining a running generation (worker/env.py).
JOINING_ENV = "UNDYING_JOINING"
# gloo or nccl (worker/env.py).
BACKEND_ENV = "UNDYING_BACKEND"
# The manager's number for this process as the rank's holder (worker/env.py).
INCARNATION_ENV = "UNDYING_INCARNATION"
# A checkpoint to start from (worker/env.py).
RESUME_FROM_ENV = "UNDYING_RESUME_FROM"
# The file a rank writes when its script returned (agent/torchrun_env.py; worker/boot.py).
RETURNED_FILE_ENV = "UNDYING_RETURNED_FILE"

# --- secrets and keys (protocol/keys.py keeps the token out of every child's environment) ---------
# The job's token: a launcher's or a command's (manager/auth.py), never a worker's.
TOKEN_ENV = "UNDYING_TOKEN"
# Hex, derived from the token, set by the agent for its workers: the checkpoint manifests' MAC key
# (checkpoint/mac.py).
CHECKPOINT_KEY_ENV = "UNDYING_CHECKPOINT_KEY"
# Hex, derived from the token, set by the agent: the proof to the job's stores (store_wire.py).
STORE_KEY_ENV = "UNDYING_STORE_KEY"
# The key of a worker's channel to its agent (protocol/channel_key.py; agent/agent.py sets it).
AGENT_KEY_ENV = "UNDYING_AGENT_KEY"
# The verifier's own key, set by rank 0 for the verifier it starts (worker/verify_files.py).
VERIFY_KEY_ENV = "UNDYING_VERIFY_KEY"
# The folder the verifier serves; a process with it set is the verifier (worker/verifier.py).
VERIFY_SERVE_DIR_ENV = "UNDYING_VERIFY_SERVE_DIR"

# --- switches a user or a test sets for undying's own processes -----------------------------------
# zygote (the default) or spawn: how the agent starts workers (agent/zygote.py).
WORKER_START_ENV = "UNDYING_WORKER_START"
# The host name an agent reports to its manager (agent/remote.py).
HOST_NAME_ENV = "UNDYING_HOST_NAME"
# "1": a rank's checkpoint_loaded event carries its restored state's digest (worker/shards.py).
RESUME_DIGEST_ENV = "UNDYING_RESUME_DIGEST"
# Set: `undying demo` prints no OK/FAILED verdict line (cli/demo.py).
DEMO_QUIET_ENV = "UNDYING_DEMO_QUIET"
# The folder of the user's Prometheus file_sd target files and scrape credential, or "off"
# (jobfiles/prometheus.py; default ~/.local/state/undying/prometheus).
PROMETHEUS_DIR_ENV = "UNDYING_PROMETHEUS_DIR"
