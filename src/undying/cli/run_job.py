"""What ``undying run`` does once its options are parsed: check the inputs, then run the job.

Apart from ``cli/run.py``, which declares the options (the parser is most of the command's
text, and ``undying k8s`` builds it alone to check the agents' command); the ``JobConfig`` the
options make is ``cli/run_config.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from undying.cli.refusal import Ledger
from undying.cli.run_config import config_from_args, numerics_env
from undying.cli.run_slurm import apply_slurm
from undying.config import WHOLE_GROUP_LINE, JobConfig
from undying.errors import UsageError
from undying.inputs import check_environment, check_every
from undying.launch.slurm import SlurmStep
from undying.protocol.env import NUMERICS_ENV, VERBOSE_ENV, VERIFY_EVERY_ENV, VIRTUAL_RANKS_ENV
from undying.user_files import check_folder, open_user_file

__all__ = ["run", "check_script", "refuse_inherited_keys"]


def check_script(args: argparse.Namespace) -> None:
    """The training script is a file this user can read (a FIFO, a folder, a missing path: one
    line).

    Before anything reads it (the step-API check parses it) or anything is created.
    """
    if not (args.module or args.no_python):
        os.close(open_user_file(args.script, "training script", "pass the path of a Python file"))


def run(args: argparse.Namespace) -> int:
    refuse_inherited_keys()
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    # Every UNDYING_ variable a rank or the agent reads, read now: a bad one is one line here, not a
    # traceback in every rank after the job started.
    check_environment()
    slurm = apply_slurm(args)  # `srun undying run`: Slurm's layout, where flags left it open
    config = config_from_args(args)
    if args.virtual_ranks is not None:  # the workers inherit it (worker.virtual reads it)
        most_ranks = args.nproc_per_node * args.nnodes[1]
        if most_ranks > args.virtual_ranks:
            raise UsageError(f"--virtual-ranks {args.virtual_ranks} with up to {most_ranks} "
                             "ranks: each rank runs at least one virtual rank; raise "
                             "--virtual-ranks or run fewer ranks")
        os.environ[VIRTUAL_RANKS_ENV] = str(args.virtual_ranks)
    if getattr(args, "verbose", False):  # `undying -v run`: the ranks show their INFO lines too
        os.environ[VERBOSE_ENV] = "1"  # (config.console reads it in each rank)
    if args.verify_every is not None:  # the workers inherit it (worker.verify reads it)
        os.environ[VERIFY_EVERY_ENV] = str(check_every(args.verify_every))
    # The workers inherit it (worker.numerics reads it).
    if (numerics := numerics_env(args)) is not None:
        os.environ[NUMERICS_ENV] = numerics
    check_script(args)
    for option, folder in (("--job-dir", config.job_dir), ("--log-dir", config.launch.log_dir),
                           ("--trace-dir", config.trace.trace_dir),
                           ("--checkpoint-dir", config.checkpoint.checkpoint_dir)):
        if folder and "://" not in folder:
            check_folder(option, folder)
    # Before this launch makes anything: what a refusal undoes.
    ledger = Ledger.take(config.job_dir)
    try:
        if slurm is not None:
            return _run_slurm_node(args, config, script_args, slurm)
        if args.manager is not None:
            return _run_node(args, config, script_args)
        return _launch(args, config, script_args)
    except UsageError:  # refused before any rank trained: nothing of this launch stays
        ledger.undo()
        raise


def _launch(args: argparse.Namespace, config: JobConfig, script_args: list[str]) -> int:
    """A standalone job: this process holds the job dir and the checkpoint dir, then runs the
    launcher."""
    # A second launcher on a live job dir: refused before torch is imported.
    if os.path.isdir(config.job_dir):
        from undying.checkpoint.lock import hold_job_dir

        # (kept for the job: JobDir.prepare finds it held by this process)
        hold_job_dir(config.job_dir)
    if args.checkpoint_dir:
        # A folder or URL of the user's: refused now, by name, rather than at the first save hours
        # in.
        config.validate()
        from undying.checkpoint.checks import check_writable

        check_writable(args.checkpoint_dir)
        from undying.checkpoint.lock import hold

        # One job per checkpoint dir, refused before anything of this job is made (held for this
        # process's life; the manager takes it over; docs/troubleshooting.md says when a lock is
        # stale).
        hold(args.checkpoint_dir, job_id=config.job_id,
             advice="wait for it to end, or pass another --checkpoint-dir")
    from undying.launch.standalone import (
        launch,  # torch and the manager: only for the command that runs a job
    )

    return launch(config, args.script, script_args, args.token_file)


def _run_node(args: argparse.Namespace, config: JobConfig, script_args: list[str],
              manager_lost_s: float | None = None) -> int:
    """One node of a multi-node job: an agent that joins the manager at --manager."""
    from pathlib import Path

    from undying.agent.remote import parse_manager_address, run_node
    from undying.jobfiles.tokens import find_token_with_source

    parse_manager_address(args.manager)
    config.validate()
    given_dir = Path(config.job_dir) if args.job_dir else None
    token, token_from = find_token_with_source(given_dir, args.token_file)
    if token is None:
        raise UsageError(
            "no token for the manager: pass --token-file PATH or set UNDYING_TOKEN (the manager "
            "wrote it to <its job dir>/token), or pass --job-dir of the manager's job dir on "
            "this host"
        )
    if not (args.module or args.no_python) and not Path(args.script).is_file():
        raise UsageError(f"training script {args.script} does not exist; pass the path of a "
                         "Python file")
    # This node's folder (its workers' files): the job user's alone, as the manager's is.
    if args.job_dir:
        from undying.jobfiles.ownership import private_dir

        try:
            private_dir(Path(config.job_dir))
        except OSError as e:
            raise UsageError(f"job dir {config.job_dir} is not writable ({e.strerror or e}); "
                             "pass --job-dir with a folder you can write") from e
    sys.stderr.write(f"[undying {time.strftime('%H:%M:%S')}] job {config.job_id}: joining the "
                     f"manager at {args.manager}, token from {token_from}\n")
    if not config.step_api:
        sys.stderr.write(f"[undying {time.strftime('%H:%M:%S')}] job {config.job_id}: "
                         f"{WHOLE_GROUP_LINE.format(max_restarts=config.max_restarts)}\n")
    return run_node(config, args.script, script_args, args.manager, token,
                    job_dir_given=bool(args.job_dir), standby=args.standby,
                    manager_lost_s=manager_lost_s)


def _run_slurm_node(args: argparse.Namespace, config: JobConfig, script_args: list[str],
                    step: SlurmStep) -> int:
    """One node of an ``srun undying run`` job: its first node runs the manager too."""
    from undying.agent.remote import parse_manager_address
    from undying.launch.slurm_node import manager_lost_after, run_slurm_node, slurm_line

    _, port = parse_manager_address(args.manager)
    line = slurm_line(step, config.job_id, standby=args.standby)
    sys.stderr.write(f"[undying {time.strftime('%H:%M:%S')}] {line}\n")
    return run_slurm_node(step, config.job_id, config.job_dir, port,
                          verbose=bool(getattr(args, "verbose", False)),
                          # (the first node lost: this node resumes the job elsewhere)
                          join=lambda: _run_node(args, config, script_args,
                                                 manager_lost_after(config.timeouts)),
                          max_requeues=args.max_requeues)


def refuse_inherited_keys() -> None:
    """A launcher derives its keys from the token: derived keys left in the user's environment
    are refused."""
    from undying.protocol.keys import inherited_key_problem

    problem = inherited_key_problem(os.environ)
    if problem is not None:
        raise UsageError(problem)
