"""``undying slurm``: write the Slurm batch script of a job (``sbatch`` it as it is)."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import sys

from undying import __version__
from undying.errors import UsageError
from undying.launch.slurm_node import DEFAULT_MAX_REQUEUES

__all__ = ["add_parser", "batch_script", "run"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TIME = re.compile(r"(\d+-)?\d{1,2}(:\d{2}){0,2}|\d+")
_PARTITION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._,-]{0,127}")
DEFAULT_GRACE_S = 120  # ahead of the time limit; Slurm may send it up to 60 s early
# A periodic checkpoint this often: losing the first node (the manager's) resumes from the newest
# one, so at most this much training runs again (docs/slurm.md, "Losing the first node").
DEFAULT_SAVE_INTERVAL_S = 600


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "slurm",
        help="write the Slurm batch script of a job (sbatch it as it is)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="undying slurm --nodes N -n P [options] -- SCRIPT [ARGS]",
        description=f"""\
Write a batch script that runs SCRIPT on N nodes x P ranks under Slurm, on
stdout or to --out FILE; submit it with `sbatch FILE`. Its lines:

  --ntasks-per-node=1   one `undying run` a node: it starts the P ranks itself;
                        the first node also runs the manager (docs/slurm.md)
  --requeue             a preempted job (exit 75) puts itself back in the
                        queue and resumes from its dying gasp (--max-requeues)
  --signal=B:TERM@G     SIGTERM to the script G s before the time limit; the
                        script passes it on to every process of the job
                        (scancel --signal=TERM), which takes the dying gasp
  --open-mode=append    a requeued job's output goes on in the same file
  --save-interval S     a checkpoint every S s (undying run's): a lost first
                        node requeues the job, which resumes from the newest

undying {__version__}.""")
    p.add_argument("--nodes", type=_count("--nodes", 1, 4096), required=True, metavar="N",
                   help="the job's nodes")
    p.add_argument("-n", "--nproc-per-node", type=_count("-n", 1, 1024), required=True,
                   metavar="P", help="ranks a node")
    p.add_argument("--min-nodes", type=_count("--min-nodes", 1, 4096), default=None,
                   metavar="M", help="an elastic job: it goes on with M..N nodes "
                   "(`undying run --nnodes M:N`)")
    p.add_argument("--spare-nodes", type=_count("--spare-nodes", 0, 4096), default=0,
                   metavar="K", help="K more nodes as warm standbys: a lost node's ranks start "
                   "on one at once (asks Slurm for N+K nodes, with --no-kill)")
    p.add_argument("--job-name", type=_checked("--job-name", _NAME), default="undying",
                   help="Slurm's job name (default %(default)s)")
    p.add_argument("--time", type=_checked("--time", _TIME), default=None,
                   help="the time limit, as sbatch takes it (D-HH:MM:SS, MM, ...)")
    p.add_argument("--partition", type=_checked("--partition", _PARTITION), default=None)
    p.add_argument("--cpus-per-node", type=_count("--cpus-per-node", 1, 4096), default=None,
                   metavar="C", help="CPUs for a node's launcher and its ranks")
    p.add_argument("--gpus-per-node", type=_count("--gpus-per-node", 1, 64), default=None,
                   metavar="G", help="GPUs a node (written, not exercised here)")
    p.add_argument("--grace", type=_count("--grace", 1, 3600), default=DEFAULT_GRACE_S,
                   metavar="S", help="SIGTERM this long before the time limit (default "
                   "%(default)s s; Slurm may send it up to 60 s early)")
    p.add_argument("--max-requeues", type=_count("--max-requeues", 0, 10_000),
                   default=DEFAULT_MAX_REQUEUES, metavar="N",
                   help="requeues after a preemption, at most (default %(default)s)")
    p.add_argument("--save-interval", type=_count("--save-interval", 0, 7 * 86_400),
                   default=DEFAULT_SAVE_INTERVAL_S, metavar="S",
                   help="a checkpoint every S s: losing the first node requeues the job, which "
                   "resumes from the newest (default %(default)s; 0: none, and such a job "
                   "starts over)")
    p.add_argument("--no-requeue", action="store_true",
                   help="leave out --requeue: a preempted job ends (exit 75)")
    p.add_argument("--undying", default=None, metavar="COMMAND",
                   help="the undying command on the nodes (default: this one's path; "
                   "'python3 -m undying' works too)")
    p.add_argument("--out", default=None, metavar="FILE", help="write here, not to stdout")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS]")
    p.set_defaults(func=run)


def _count(option: str, low: int, high: int) -> argparse._ActionType:
    def parse(text: str) -> int:
        if not text.strip().isdigit() or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{option} takes a whole number in [{low}, {high}], "
                                             f"got {text!r:.20}")
        return int(text)
    return parse


def _checked(option: str, rule: re.Pattern[str]) -> argparse._ActionType:
    def parse(text: str) -> str:
        if rule.fullmatch(text) is None:
            raise argparse.ArgumentTypeError(f"{option} {text!r:.40} is not one sbatch takes")
        return text
    return parse


def batch_script(args: argparse.Namespace, command: list[str]) -> str:
    """The batch script's text for ``args`` and the training ``command`` (SCRIPT ARGS...)."""
    undying = shlex.split(args.undying) if args.undying else [shutil.which("undying") or "undying"]
    nnodes = f"{args.min_nodes}:{args.nodes}" if args.min_nodes else None
    run = [*undying, "run", "-n", str(args.nproc_per_node),
           *(["--nnodes", nnodes] if nnodes else []),
           *(["--max-requeues", str(args.max_requeues)] if not args.no_requeue else []),
           *(["--spare-nodes", str(args.spare_nodes)] if args.spare_nodes else []),
           *(["--save-interval", str(args.save_interval)] if args.save_interval else []),
           *command]
    sbatch = [
        ("--job-name", args.job_name, ""),
        ("--nodes", str(args.nodes + args.spare_nodes),
         f"the job's nodes, {args.spare_nodes} of them spare" if args.spare_nodes
         else "the job's nodes"),
        *([("--no-kill", None, "a lost node is the job's to recover, not Slurm's")]
          if args.spare_nodes else []),
        ("--ntasks-per-node", "1", "one undying launcher a node; it starts the ranks"),
        *([("--cpus-per-task", str(args.cpus_per_node), "the launcher's and its ranks' CPUs")]
          if args.cpus_per_node else []),
        *([("--gpus-per-node", str(args.gpus_per_node), "")] if args.gpus_per_node else []),
        *([("--time", args.time, "")] if args.time else []),
        *([("--partition", args.partition, "")] if args.partition else []),
        *([] if args.no_requeue else
          [("--requeue", None, "preempted (exit 75): back in the queue, resumed")]),
        ("--signal", f"B:TERM@{args.grace}", "SIGTERM to this script before the limit"),
        ("--open-mode", "append", "a requeued job's output goes on here"),
        ("--output", f"{args.job_name}-%j.out", ""),
    ]
    lines = ["#!/bin/bash",
             f"# Written by `undying slurm` (undying {__version__}); submit: sbatch THIS_FILE"]
    for option, value, why in sbatch:
        line = f"#SBATCH {option}" + (f"={value}" if value is not None else "")
        lines.append(f"{line:<34}# {why}" if why else line)
    lines += [
        "",
        "# Slurm signals only this shell for --signal=B:... and scancel --batch: pass it on to",
        "# every process of the job's steps, which agree on a stop step and take the dying gasp.",
        "trap 'scancel --signal=TERM \"$SLURM_JOB_ID\"' TERM",
        "",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0{' --no-kill' if args.spare_nodes else ''} "
        f"{shlex.join(run)} &",
        "srun_pid=$!",
        "wait \"$srun_pid\"; code=$?",
        "# (a trapped signal ends `wait` early: wait again until srun itself ends)",
        "while kill -0 \"$srun_pid\" 2>/dev/null; do wait \"$srun_pid\"; code=$?; done",
        "exit \"$code\"",
        "",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("undying slurm needs the training command after --: "
                         "undying slurm --nodes 2 -n 8 -- train.py --epochs 3")
    if args.min_nodes and args.min_nodes > args.nodes:
        raise UsageError(f"--min-nodes {args.min_nodes} is more than --nodes {args.nodes}")
    text = batch_script(args, command)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.out, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise UsageError(f"--out {args.out} exists; remove it or name another file") from None
    except OSError as e:
        raise UsageError(f"--out {args.out}: {e.strerror or e}") from None
    sys.stderr.write(f"wrote {args.out}: submit it with `sbatch {args.out}`\n")
    return 0
