"""``srun undying run``: Slurm's environment fills in the multi-node flags a user did not give.

What Slurm says (``launch/slurm.py``) becomes ``--nnodes``, ``--node-rank``, ``--manager``
(the step's first node, at a port derived from the job id), ``--job-id`` (``slurm-<id>``) and
``--job-dir`` (``<submit dir>/undying-jobs/slurm-<id>``); a flag the user gave wins over it.
Nodes past the job's (``--spare-nodes K``, or ``--nnodes`` below the step's node count) join as
warm standbys (``--standby``): a lost node's ranks start on one of them at once.
``--standalone``, ``--manager`` or ``--rdzv-endpoint`` mean the user chose the layout: Slurm
is then not read at all (so torchrun's spellings under ``srun`` work as before).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from undying.config import JobConfig
from undying.errors import UsageError
from undying.launch.slurm import SlurmStep, manager_port, read_slurm
from undying.launch.slurm_node import DEFAULT_MAX_REQUEUES

__all__ = ["add_slurm_arguments", "apply_slurm"]


def add_slurm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "Slurm (under srun the layout comes from the step: docs/slurm.md)")
    g.add_argument("--max-requeues", type=_requeues, default=DEFAULT_MAX_REQUEUES, metavar="N",
                   help="a preempted job (exit 75) puts itself back in Slurm's queue (scontrol "
                   "requeue, where sbatch --requeue allows it) until it was requeued N times "
                   "(default %(default)s; 0: never)")
    g.add_argument("--spare-nodes", type=_spares, default=0, metavar="K",
                   help="the step's last K nodes are warm standbys: a lost node's ranks start "
                   "on one at once (the job trains on N-K nodes; default %(default)s)")


def _requeues(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 10_000:
        raise argparse.ArgumentTypeError(f"{text!r:.20} is not a count in [0, 10000]")
    return int(text)


def _spares(text: str) -> int:
    if not text.strip().isdigit() or int(text) > 4096:
        raise argparse.ArgumentTypeError(f"{text!r:.20} is not a count in [0, 4096]")
    return int(text)


def _layout_chosen(args: argparse.Namespace) -> bool:
    return bool(args.standalone or args.manager or getattr(args, "rdzv_endpoint", ""))


def apply_slurm(args: argparse.Namespace,
                environ: Mapping[str, str] = os.environ) -> SlurmStep | None:
    """The Slurm step this launcher runs in, with ``args`` filled from it; None outside Slurm
    (or when the user chose the layout with flags). UsageError where Slurm's layout cannot
    run."""
    if _layout_chosen(args):
        return None
    step = read_slurm(environ)
    if step is None:
        return None
    training = step.nnodes - args.spare_nodes
    if training < 1:
        raise UsageError(f"--spare-nodes {args.spare_nodes} leaves no node to train on: the step "
                         f"has {step.nnodes} node(s); ask Slurm for more (sbatch --nodes) or "
                         "pass fewer spare nodes")
    if args.nnodes == (JobConfig.nnodes, JobConfig.nnodes):
        args.nnodes = (training, training)
    elif args.spare_nodes and args.nnodes[1] != training:
        raise UsageError(f"--nnodes {args.nnodes[1]} and --spare-nodes {args.spare_nodes} "
                         f"disagree: the step has {step.nnodes} nodes; pass one of them")
    if step.node_rank >= args.nnodes[1]:
        args.standby = True  # a node past the job's: a warm standby, given a rank when one is lost
    elif args.node_rank == JobConfig.node_rank:
        args.node_rank = step.node_rank
    if args.job_id is None:
        args.job_id = step.undying_job_id
    if args.job_dir is None:
        args.job_dir = step.job_dir
    port = args.port if args.port else manager_port(step.job_id)
    args.manager = f"{step.nodes[0]}:{port}"
    return step
