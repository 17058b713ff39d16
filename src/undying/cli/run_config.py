"""What ``undying run``'s options make: the job's ``JobConfig``, and the variables its workers
inherit.

Each field comes from its option by the rule (``--a-b`` is ``a_b``, ``cli/settings.py``); only the
values derived from several options, or checked across them, are written here. ``cli/run.py``
declares the options and ``cli/run_job.py`` runs the job.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

from undying.cli.limits import connection_limits
from undying.cli.settings import from_args
from undying.cli.step_api import uses_step_api
from undying.cli.torchrun_flags import apply_torchrun_arguments, resolve_nproc
from undying.config import CheckpointConfig, JobConfig, LaunchConfig, Timeouts, TraceConfig
from undying.errors import UsageError
from undying.inputs import check_job_id, env_value
from undying.jobfiles.jobdir import default_job_dir
from undying.manager.trackers import missing_library
from undying.protocol.env import REPLICATE_ENV, REPLICATE_EVERY_ENV

__all__ = ["config_from_args", "numerics_env"]


def numerics_env(args: argparse.Namespace) -> str | None:
    """NUMERICS_ENV's value for ``--numerics`` and its sub-options (None: off), each checked by
    name."""
    if args.numerics is None:
        given = [o for o, v in (("--spike-factor", args.spike_factor),
                                ("--rollback-steps", args.rollback_steps),
                                ("--max-skips-in-a-row", args.max_skips_in_a_row),
                                ("--max-skipped-share", args.max_skipped_share)) if v is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise UsageError(f"{' and '.join(given)} {verb} to the numeric checks: add --numerics "
                             "skip|rollback|stop")
        return None
    if args.rollback_steps is not None and args.numerics != "rollback":
        raise UsageError(f"--rollback-steps applies to --numerics rollback, not --numerics "
                         f"{args.numerics}")
    bounds = [o for o, v in (("--max-skips-in-a-row", args.max_skips_in_a_row),
                             ("--max-skipped-share", args.max_skipped_share)) if v is not None]
    if bounds and args.numerics == "stop":
        raise UsageError(f"{bounds[0]} applies to --numerics skip or rollback (they skip steps), "
                         "not --numerics stop")
    if args.spike_factor is not None and not args.spike_factor > 1:
        raise UsageError(f"--spike-factor must be above 1 (a multiple of the recent median loss, "
                         f"e.g. 10), got {args.spike_factor:g}")
    fields = [f"on_persistent={args.numerics}"]
    if args.spike_factor is not None:
        fields.append(f"spike_factor={args.spike_factor!r}")
    if args.rollback_steps is not None:
        fields.append(f"rollback_steps={args.rollback_steps}")
    if args.max_skips_in_a_row is not None:
        fields.append(f"max_skips_in_a_row={args.max_skips_in_a_row}")
    if args.max_skipped_share is not None:
        fields.append(f"max_skipped_share={args.max_skipped_share!r}")
    return ",".join(fields)


def config_from_args(args: argparse.Namespace) -> JobConfig:
    apply_torchrun_arguments(args)
    fewest, most = args.nnodes
    if args.manager is None and (most != 1 or args.node_rank != 0):
        raise UsageError(
            "--nnodes > 1 needs --manager HOST:PORT (or torchrun's --rdzv-endpoint HOST:PORT): "
            "start `undying manager --job-id J` on one host, then `undying run --nnodes N "
            "--node-rank I --manager HOST:PORT --job-id J ...` on every node"
            + (f" (torchrun's static rendezvous at --master-addr {args.master_addr}: run the "
               "manager there)"
               if args.master_addr else "")
        )
    if args.standby and (args.manager is None or args.node_rank != 0):
        raise UsageError("--standby needs --manager HOST:PORT and takes no --node-rank: the "
                         "manager gives a standby the rank of the node it replaces")
    if args.manager is not None and not args.job_id:
        raise UsageError("--manager needs --job-id: the id the manager was started with "
                         "(torchrun's flags: --rdzv-endpoint needs --rdzv-id)")
    step_api = uses_step_api(args.script, module=args.module, no_python=args.no_python)
    if args.max_restarts is None:
        args.max_restarts = JobConfig.max_restarts
    elif step_api:  # the one flag whose meaning changed: said where it could be read the old way
        sys.stderr.write(f"undying: note: --max-restarts {args.max_restarts} bounds whole-group "
                         f"restarts (torchrun's meaning); recoveries at one step are bounded by "
                         f"--max-step-recoveries ({args.max_step_recoveries})\n")
    for tracker in args.trackers:  # (refused here, in one line, not found missing mid-job)
        if missing := missing_library(tracker):
            raise UsageError(missing)
    job_id = args.job_id or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    check_job_id(job_id)
    # Each field from its option by the rule (--a-b: a_b, cli/settings.py), but the values derived
    # here.
    return from_args(
        JobConfig, args,
        job_id=job_id,
        job_id_given=args.job_id is not None,
        job_dir=str(args.job_dir or default_job_dir(job_id)),
        nproc_per_node=resolve_nproc(args.nproc_per_node),
        nnodes=most,
        min_nodes=fewest if fewest < most else 0,
        step_api=step_api,
        launch=from_args(LaunchConfig, args),
        timeouts=from_args(Timeouts, args),
        checkpoint=from_args(
            CheckpointConfig, args,
            # (env UNDYING_REPLICATE[_EVERY] when the flag is not given: read by its one reader,
            # named if bad)
            replicate=args.replicate or env_value(REPLICATE_ENV) or CheckpointConfig.replicate,
            replicate_every=args.replicate_every if args.replicate_every is not None
            else env_value(REPLICATE_EVERY_ENV) or CheckpointConfig.replicate_every,
        ),
        connections=connection_limits(args),
        trace=from_args(
            TraceConfig, args,
            trace_switch_file=(os.path.abspath(args.trace_switch_file)
                               if args.trace_switch_file else ""),
        ),
    )
