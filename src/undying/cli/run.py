"""``undying run``: like torchrun, with faults recovered in place.

Its options (``add_parser``) and their checks; what the command does with them is
``cli/run_job.py``, and what the options make (the ``JobConfig``, the workers' variables) is
``cli/run_config.py``.
"""

from __future__ import annotations

import argparse

from undying.cli.limits import add_connection_arguments
from undying.cli.progress_line import progress_every_arg
from undying.cli.run_help import add_help_options
from undying.cli.run_job import run
from undying.cli.run_slurm import add_slurm_arguments
from undying.cli.settings import add_setting
from undying.cli.torchrun_flags import (
    add_torchrun_arguments,
    nproc_arg,
)
from undying.config import (
    AUTO_STEP_TIMEOUT_FACTOR,
    AUTO_STEP_TIMEOUT_FLOOR_S,
    DEFAULT_MANAGER_PORT,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_BEHIND,
    TRACE_INITIAL,
    TRACKER_NAMES,
    CheckpointConfig,
    JobConfig,
    LaunchConfig,
    Timeouts,
    TraceConfig,
)
from undying.errors import UsageError
from undying.inputs import (
    JOB_ID_RULE,
    check_address,
    finite_arg,
    job_id_arg,
)
from undying.protocol.env import (
    REPLICATE_ENV,
    SEED_ENV,
    TOKEN_ENV,
)

__all__ = ["add_parser"]

# The first paragraph of the help: what `undying run --help` (the short help) says before the
# common options.
_SUMMARY = """\
Run SCRIPT on --nproc-per-node ranks with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, ...) and torchrun's flags:
replace the word `torchrun` with `undying run`. Everything after SCRIPT is the
script's own. When a rank of a script that uses undying's step API dies, the
others keep their state in memory, a new process takes its place, its state
comes from a peer, and only the step in flight is re-run. A script that does
not use it gets torchrun's recovery: the whole group restarts (--max-restarts),
and a script that saves its own snapshot resumes from it."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script on N ranks, recovering from faults (takes torchrun's "
        "flags)",
        allow_abbrev=False,  # an abbreviation is the script's argument, never one of ours
        add_help=False,  # -h is the short help (cli/run_help.py), --help-all this one
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"""\
{_SUMMARY}

The manager runs inside this launcher: its event log is <job dir>/events.db and
its HTTP API address is in <job dir>/manager.json (see `undying status`).

Checkpoints: with --save-every/--save-interval rank 0 writes the state beside
training (the loop stalls only for the copy to CPU) under --checkpoint-dir.
When the job starts and a valid checkpoint is there, every rank resumes from
the newest one (broken ones are skipped, and the log says why).

SIGTERM (a preemption, as Kubernetes sends it): the ranks agree on a stop step,
finish it, rank 0 writes a dying-gasp checkpoint of it within --grace-period,
and everything exits; run the same command to resume with no step lost.

Exit code: 0 succeeded, 1 failed, 2 bad input, 130 stopped by Ctrl-C,
{EXIT_PREEMPTED} preempted by SIGTERM with a checkpoint of the stop step to resume
from, {EXIT_PREEMPTED_BEHIND} preempted with only an older checkpoint (the dying gasp could not
be written: a resume re-runs the steps after it, the last line counts them),
143 SIGTERM with no checkpoint at all.""",
    )
    add_help_options(p, _SUMMARY)
    add_setting(p, JobConfig, "-n", "--nproc-per-node", "--nproc_per_node", type=nproc_arg,
                metavar="N",
                help="worker processes on this node: a number, or auto (one per GPU, else per "
                "CPU), cpu, gpu (default %(default)s)")
    p.add_argument("--job-id", type=job_id_arg, default=None,
                   help=f"the job's name: {JOB_ID_RULE} (default: "
                   "job-<date>-<time>-<random>)")
    p.add_argument("--job-dir", default=None,
                   help="the job's folder (default ./undying-jobs/<job id>)")
    p.add_argument(
        "--max-restarts", "--max_restarts", type=int, default=None,
        help="whole-group restarts before the job fails, torchrun's meaning: every rank started "
        "again (from the latest valid checkpoint, or, for a script that does not use the step "
        f"API, from its start) (default {JobConfig.max_restarts}). This flag used to limit "
        "recoveries at one step: that is --max-step-recoveries now",
    )
    add_setting(p, JobConfig, "--max-step-recoveries", type=int,
                help="recoveries allowed for faults at the same step before the job stops; a "
                "fault that repeats at one step is a bug (default %(default)s)")
    add_setting(p, JobConfig, "--seed", type=int,
                help=f"the job's seed, given to every worker as {SEED_ENV}: undying.init() seeds "
                "torch, random and NumPy from it, so a replacement builds what the rank it "
                "replaces built (default %(default)s)")
    add_setting(p, JobConfig, "--max-retries", type=int,
                help="in-place retries of a communication error at the same step; then the rank "
                "whose collective failed is replaced (default %(default)s)")
    add_setting(p, JobConfig, "--spares", type=int,
                help="hot spares per node: processes with Python and torch already loaded that "
                "replace a dead rank without a cold start; started once the job runs (default "
                "%(default)s, 0 for none)")
    c = p.add_argument_group("checkpoints and preemption")
    add_setting(c, CheckpointConfig, "--checkpoint-dir", metavar="PATH_OR_URL",
                help="where checkpoints go: a folder or an fsspec URL (default <job "
                "dir>/checkpoints)")
    add_setting(c, CheckpointConfig, "--save-every", type=int, metavar="STEPS",
                help="write a checkpoint after every N committed steps (default %(default)s: "
                "never by steps)")
    add_setting(c, CheckpointConfig, "--save-interval", type=finite_arg("--save-interval"),
                metavar="SECONDS",
                help="write a checkpoint when this long passed since the last (default "
                "%(default)g: never by time)")
    add_setting(c, CheckpointConfig, "--keep", type=int,
                help="checkpoints to keep (default %(default)s)")
    add_setting(c, JobConfig, "--start-fresh", action="store_true",
                help="when every checkpoint in the checkpoint folder is rejected (corrupt, "
                "partial, not signed by this job), train from step 1 anyway; the rejected ones "
                "are moved, whole, to <checkpoint dir>/rejected/<time>/ and never touched again "
                "(default: stop and list why each was rejected)")
    add_setting(c, JobConfig, "--force", action="store_true",
                help="train again a job whose job dir says it already succeeded (default: say so "
                "and exit 0)")
    add_setting(c, CheckpointConfig, "--grace-period", type=finite_arg("--grace-period"),
                metavar="SECONDS",
                help="SIGTERM to every process gone: finish the step, write the dying gasp, "
                "exit; ranks still running then are killed (default: sized from the measured "
                "checkpoint size and write speed, x2, at least 5 s, plus two steps; `undying "
                "status` shows it)")
    add_setting(c, CheckpointConfig, "--gasp-reuse-within",
                type=finite_arg("--gasp-reuse-within"), metavar="SECONDS",
                help="a SIGTERM this soon after a dying gasp reuses it instead of writing again, "
                "when no step was trained since (default %(default)g)")
    c.add_argument("--replicate", choices=("off", "ring"), default=None,
                   help="sharded state (FSDP2): ring keeps a copy of each rank's shard in the "
                   "memory of a rank on the next node (the next rank on one node), so losing a "
                   f"rank needs no disk; {CheckpointConfig.replicate} (default): a lost shard "
                   f"rolls the job back to the latest checkpoint (env {REPLICATE_ENV})")
    c.add_argument("--replicate-every", type=int, default=None,
                   metavar="STEPS",
                   help=f"with --replicate ring: copy the shards every N steps (default "
                   f"{CheckpointConfig.replicate_every}: a fault loses no step; N > 1 costs less "
                   "per step and re-runs up to N-1 steps after a fault)")
    tr = p.add_argument_group(
        "tracing (switch it while the job runs: `undying trace on|off [--comm]`)")
    add_setting(tr, TraceConfig, "--trace", choices=TRACE_INITIAL,
                help="markers at start: off (default), on (step, checkpoint, forward and "
                "data-wait markers) or comm (those and every gradient collective)")
    add_setting(tr, TraceConfig, "--trace-dir", metavar="PATH",
                help="where records go, per rank under <dir>/<job id>/<rank>/ (default <job "
                "dir>/traces)")
    add_setting(tr, TraceConfig, "--trace-switch-file", metavar="PATH",
                help="a JSON file watched for the switch, e.g. {\"step\": \"on\", \"comm\": "
                "\"off\"} (the form a mounted Kubernetes ConfigMap takes); a malformed file is "
                "reported and ignored")
    add_setting(tr, TraceConfig, "--trace-max-file-mb",
                type=finite_arg("--trace-max-file-mb"), metavar="MB",
                help="start a new record file when the newest passes this size (default "
                "%(default)g)")
    add_setting(tr, TraceConfig, "--trace-max-dir-mb",
                type=finite_arg("--trace-max-dir-mb"), metavar="MB",
                help="when the trace dir passes this size, its oldest 20%% of trace files are "
                "deleted (default %(default)g)")
    p.add_argument("--port", type=int, default=None,
                   help="one node: the manager's c10d store port (default: a free one, as "
                   "torchrun --standalone, so jobs side by side never collide; pass one to fix "
                   "it); several nodes use the `undying manager`'s (--manager)")
    add_setting(p, JobConfig, "--http-port", type=int,
                help="the manager's HTTP API port on localhost (default: a free one)")
    add_setting(p, JobConfig, "--open-status", action="store_true",
                help="serve the read-only status (GET /, /api/status, /metrics) without the "
                "job's token; inject, stop and trace changes always need it (<job dir>/token)")
    add_setting(p, LaunchConfig, "--progress-every", type=progress_every_arg, metavar="SECONDS",
                help="a live progress line on a terminal; elsewhere (a file, a pipe) a progress "
                "line every SECONDS (default %(default)g); 0: neither")
    add_setting(p, JobConfig, "--trackers", type=_trackers, metavar="NAMES",
                help="send each committed step's step.log values (the mean over the ranks) to "
                f"these trackers, once per step, from the manager: {','.join(TRACKER_NAMES)} "
                "(comma-separated; each needs its library: pip install 'undying[NAME]')")
    add_setting(p, JobConfig, "--backend", choices=("gloo", "nccl"),
                help="torch.distributed backend (default %(default)s)")
    m = p.add_argument_group(
        "multi-node (start `undying manager --job-id J` first, then this on every node)")
    m.add_argument("--nnodes", type=_nnodes, default=(JobConfig.nnodes, JobConfig.nnodes),
                   metavar="N|MIN:MAX",
                   help=f"number of nodes (default {JobConfig.nnodes}: standalone, the manager "
                   "runs here). MIN:MAX makes the job elastic: it starts once MIN nodes joined "
                   "(after --node-wait for the others), and when a node is lost and no host "
                   "replaces it within --node-wait it goes on with the nodes it has, down to "
                   "MIN; a node joining later grows it back, up to MAX. Without MIN:MAX such a "
                   "job saves its survivors' state and restarts from it once the lost node is "
                   "replaced")
    add_setting(m, JobConfig, "--node-rank", "--node_rank", type=int,
                help="this node's rank, 0..MAX-1 (in a Kubernetes indexed Job: "
                "$(JOB_COMPLETION_INDEX))")
    m.add_argument("--manager", type=_manager_address, default=None, metavar="HOST:PORT",
                   help="the `undying manager` to join; needed with --nnodes > 1 (its --port, "
                   f"default {DEFAULT_MANAGER_PORT})")
    m.add_argument("--standby", action="store_true",
                   help="join the job at --manager as a warm standby with no node rank: its "
                   "worker zygote and spares (at least -n) stay warm, and when a node is lost it "
                   "takes that node's rank and its ranks start on those spares instead of "
                   "waiting for a new host (pass the job's other flags)")
    m.add_argument("--token-file", default=None, metavar="PATH",
                   help=f"the job's token (default: env {TOKEN_ENV}, else <job dir>/token as the "
                   "manager wrote it, or a new one there); the start line says which was used")
    t = p.add_argument_group(
        "timeouts (seconds; each > 0; env UNDYING_TIMEOUT_<NAME> overrides in workers)")
    add_setting(t, Timeouts, "--rendezvous-timeout", type=finite_arg("--rendezvous-timeout"),
                help="a worker's wait for the next generation (default %(default).0f)")
    add_setting(t, Timeouts, "--connect-timeout", type=finite_arg("--connect-timeout"),
                help="building a process group: connecting to its store (default "
                "%(default).0f); gloo waits for every member as long as one collective "
                "(--collective-timeout), and a member that gave up tells the manager, which "
                "opens the next generation")
    add_setting(t, Timeouts, "--collective-timeout", type=finite_arg("--collective-timeout"),
                help="one collective making no progress (default %(default).0f); also how long "
                "a stuck survivor that alone holds some state is waited for")
    add_setting(t, Timeouts, "--recovery-timeout", type=finite_arg("--recovery-timeout"),
                help="a recovery's deadline to its first step before the job fails (default "
                "%(default).0f)")
    add_setting(t, Timeouts, "--comm-error-grace", type=finite_arg("--comm-error-grace"),
                help="wait for a process exit before calling a collective error transient "
                "(default %(default)g)")
    add_setting(t, Timeouts, "--heartbeat-timeout", type=finite_arg("--heartbeat-timeout"),
                help="a rank silent this long (stopped, or stuck holding the interpreter) is "
                "hung: killed and replaced (default %(default).0f)")
    add_setting(t, Timeouts, "--step-timeout", type=_step_timeout, metavar="SECONDS|auto",
                help="a rank that keeps beating but makes no progress in a step (enters no "
                "collective, finishes no step) this long is stuck (an endless loop, a deadlock, a "
                "collective its peers wait in): the rank the others wait for is killed and "
                "replaced; when every rank is stuck in the same collective, the link is retried. "
                f"auto (default): {AUTO_STEP_TIMEOUT_FACTOR:g}x the slowest recent step, at least "
                f"{AUTO_STEP_TIMEOUT_FLOOR_S:.0f}")
    add_setting(t, Timeouts, "--init-timeout", type=finite_arg("--init-timeout"),
                help="from starting a rank to its first word, imports included (default "
                "%(default).0f)")
    add_setting(t, Timeouts, "--spare-take-timeout", type=finite_arg("--spare-take-timeout"),
                help="a hot spare given a rank that does not say it took it within this long "
                "(stopped, wedged) is killed, and the rank goes to another spare or a fresh "
                "process (default %(default)g)")
    add_setting(t, Timeouts, "--node-wait", type=finite_arg("--node-wait"),
                help="how long a lost node's ranks wait for a replacement host before the job "
                "goes on without it (resized, or restarted from its survivors' state), and how "
                "long an elastic job waits for more than MIN nodes at start (default "
                "%(default).0f)")
    add_setting(t, Timeouts, "--stop-grace", type=finite_arg("--stop-grace"),
                help="SIGTERM to SIGKILL when stopping workers (default %(default).0f)")
    add_setting(t, Timeouts, "--exit-grace", type=finite_arg("--exit-grace"),
                help="a rank whose script returned and whose process is still there this long "
                "after (stuck in its own exit: a thread that never ends, a deadlock at shutdown) "
                "is killed; its result stands and the stuck exit is noted (default %(default)g)")
    add_connection_arguments(p)
    p.add_argument("--virtual-ranks", type=_virtual_ranks, default=None, metavar="V",
                   help="invariant mode: the job is defined by V data-parallel virtual ranks, "
                        "each rank runs some of them, and the losses are bit-identical on any "
                        "number of ranks <= V, across shrink and grow (the script loops over "
                        "step.virtual_ranks(); see docs/elastic.md). Give it on every node")
    n = p.add_argument_group("silent data corruption and numerics (a script using the step API)")
    n.add_argument("--verify-every", default=None, metavar="K",
                   help="check for silent data corruption without waiting for a NaN: every K "
                        "steps one rank's step (the ranks in turn) is replayed by a verifier "
                        "process from another rank's copy of the pre-step state and the rank's "
                        "batch, and its local gradient fingerprint compared bit for bit; a "
                        "mismatch is an `sdc` incident naming the rank, and the job rolls back to "
                        "the last verified state and re-runs from there. It never blocks a step "
                        "(a verifier that falls behind leaves steps unverified, and the job's "
                        "verify_summary says how many). Turns the numeric checks on "
                        "(job.steps(numerics=...)); the same as Numerics(verify_every=K). A whole "
                        "number of steps from 1; give the same K on every node (see "
                        "docs/numerics.md)")
    n.add_argument("--numerics", choices=("skip", "rollback", "stop"), default=None,
                   metavar="POLICY",
                   help="check every step before it commits (a script using the step API, no "
                   "code change): the loss and gradient norm finite, and with --spike-factor no "
                   "loss spike; a failed step is replayed in place, and one that fails again bit "
                   "for bit is the data's fault: POLICY skip (the batch), rollback (go back "
                   "--rollback-steps steps and skip their batches) or stop (fail with a report). "
                   "Sets job.steps(numerics=...)'s default; a script's own Numerics(...) wins. "
                   "See docs/numerics.md")
    n.add_argument("--spike-factor", type=finite_arg("--spike-factor"), default=None,
                   metavar="F",
                   help="with --numerics: a loss above F x the median of the last 50 committed "
                   "losses is a fault (after 20 of them; F > 1, e.g. 10)")
    n.add_argument("--rollback-steps", type=_rollback_steps, default=None, metavar="N",
                   help="with --numerics rollback: how many steps to go back (1-64, default 2); "
                   "each is a copy of the model and optimizer state held in memory")
    n.add_argument("--max-skips-in-a-row", type=_max_skips, default=None, metavar="N",
                   help="with --numerics skip|rollback: the job fails, with the reason, once "
                   "more than N steps in a row were skipped (the data or the model is broken, "
                   "not a batch; default 10)")
    n.add_argument("--max-skipped-share", type=_skipped_share, default=None, metavar="F",
                   help="with --numerics skip|rollback: the job fails once more than "
                   "--max-skips-in-a-row steps were skipped in all and they are more than F of "
                   "the steps run (0 < F <= 1, default 0.1)")
    add_torchrun_arguments(p)
    add_slurm_arguments(p)
    p.add_argument("script",
                   help="the training script (with -m a module, with --no-python a program)")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script: all its own")
    p.set_defaults(func=run)


def _trackers(raw: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    for name in names:
        if name not in TRACKER_NAMES:
            raise argparse.ArgumentTypeError(f"unknown tracker {name!r}; choose from "
                                             f"{', '.join(TRACKER_NAMES)} (comma-separated)")
    return names


def _manager_address(raw: str) -> str:
    check_address("--manager", raw)
    return raw.strip()


def _step_timeout(raw: str) -> float | None:
    """``--step-timeout``: seconds, or auto (None: derived from the step times where it is
    judged)."""
    if raw == "auto":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"--step-timeout: expected seconds or 'auto', got {raw!r}") from None
    if not 0 < value < float("inf"):  # nan fails this too
        raise UsageError(f"--step-timeout must be > 0 seconds (or 'auto') and finite, "
                         f"got {raw!r}")
    return value


def _virtual_ranks(raw: str) -> int:
    if not raw.strip().isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of virtual ranks: give a "
                                         "whole number >= 1 (the job's data-parallel width)")
    return int(raw)


def _rollback_steps(raw: str) -> int:
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 64:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of steps to roll back: give "
                                         "a whole number from 1 to 64 (each is a copy of the "
                                         "state in memory)")
    return int(raw)


def _max_skips(raw: str) -> int:
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 1_000_000:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number of steps: give a whole "
                                         "number from 1 to 1000000 (e.g. 10)")
    return int(raw)


def _skipped_share(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:  # nan fails this too
        raise argparse.ArgumentTypeError(f"{raw!r} is not a share of the steps: give a number "
                                         "above 0 and at most 1 (e.g. 0.1)")
    return value


def _nnodes(raw: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (as torchrun takes it)."""
    low, sep, high = raw.partition(":")
    try:
        fewest, most = (int(low), int(high)) if sep else (int(raw), int(raw))
    except ValueError:
        raise UsageError(f"--nnodes: expected N or MIN:MAX, e.g. 4 or 2:4, got {raw!r}") from None
    if not 1 <= fewest <= most:
        raise UsageError(f"--nnodes {raw}: needs 1 <= MIN <= MAX")
    return fewest, most
