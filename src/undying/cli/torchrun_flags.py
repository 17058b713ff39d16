"""torchrun's flags on ``undying run``: the same spellings (dashes and underscores), mapped onto
undying's.

A user replaces the word ``torchrun`` with ``undying run`` and nothing else.
Each flag means here what it means to torchrun; where undying's design makes a
value meaningless (an ``--rdzv-conf`` key of torchrun's own rendezvous, say),
one ``undying: note:`` line says so and the job runs; where honouring it is
impossible (an etcd rendezvous), one error line says what to pass instead.

The rendezvous maps onto undying's manager: ``--rdzv-endpoint HOST[:PORT]`` is
the manager to join on several nodes (``--manager``; port 29400 by default, as
torchrun's), ``--rdzv-id`` is the job id, ``--standalone`` runs the manager
here on a free port.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from undying.cli.settings import add_setting
from undying.config import DEFAULT_MANAGER_PORT, JobConfig, LaunchConfig
from undying.errors import UsageError
from undying.inputs import check_address, check_job_id, finite_arg

__all__ = ["add_torchrun_arguments", "apply_torchrun_arguments", "nproc_arg", "resolve_nproc",
           "std_arg"]

NPROC_WORDS = ("auto", "cpu", "gpu")
# --rdzv-backend values whose rendezvous undying's manager is (torchrun's default is static; c10d is
# what --standalone and most multi-node scripts use).
_BACKENDS_HERE = ("static", "c10d")
# torchrun's --rdzv-conf keys: what each becomes here ("" when it has no meaning).
_RDZV_CONF = {"join_timeout": "node_wait", "timeout": "node_wait"}
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "")


def nproc_arg(raw: str) -> int | str:
    """``--nproc-per-node``: a number >= 1, or torchrun's auto, cpu or gpu (resolved when the job
    starts)."""
    if raw in NPROC_WORDS:
        return raw
    try:
        value = int(raw)
    except ValueError:  # (argparse's own refusal: one line, exit 2, as for any option's type)
        raise argparse.ArgumentTypeError(f"expected a number or one of {', '.join(NPROC_WORDS)}, "
                                         f"got {raw!r:.40}") from None
    if value < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {value}; "
                         "pass the number of worker processes to start on this node")
    return value


def resolve_nproc(raw: int | str) -> int:
    """torchrun's meaning: cpu = the CPU count, gpu = the CUDA devices, auto = gpu if any, else
    cpu."""
    if isinstance(raw, int):
        return raw
    if raw == "cpu":
        return os.cpu_count() or 1
    import torch  # (only for gpu/auto: the count of devices)

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if raw == "gpu" and devices == 0:
        raise UsageError("--nproc-per-node gpu: no CUDA device is visible here; pass a number or "
                         "cpu")
    return devices or os.cpu_count() or 1


def std_arg(option: str) -> Callable[[str], dict[int, int]]:
    """argparse ``type=`` for ``--redirects``/``--tee``: ``N`` or ``LOCAL_RANK:N,...``, N in 0-3
    (torchrun's Std)."""

    def parse(raw: str) -> dict[int, int]:
        table: dict[int, int] = {}
        try:
            if ":" not in raw:
                table[-1] = int(raw)
            else:
                for part in raw.split(","):
                    who, _, value = part.partition(":")
                    table[int(who)] = int(value)
        except ValueError:
            raise UsageError(f"{option}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or "
                             f"LOCAL_RANK:N,... e.g. 0:3,1:0, got {raw!r:.40}") from None
        for local, std in table.items():
            if not 0 <= std <= 3 or local < -1:
                raise UsageError(f"{option}: each value must be 0-3 for a local rank >= 0, "
                                 f"got {raw!r:.40}")
        return table

    parse.__name__ = "streams"
    return parse


def _ranks_filter(raw: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(part) for part in raw.split(",") if part.strip()}))
    except ValueError:
        raise UsageError(f"--local-ranks-filter: expected local ranks separated by commas, "
                         f"e.g. 0,1, got {raw!r:.40}") from None
    if any(r < 0 for r in ranks):
        raise UsageError(f"--local-ranks-filter: local ranks are >= 0, got {raw!r:.40}")
    return ranks


def _positive(option: str) -> Callable[[str], float]:
    number = finite_arg(option)

    def parse(raw: str) -> float:
        value = number(raw)
        if value <= 0:
            raise UsageError(f"{option} must be > 0 seconds, got {raw!r:.40}")
        return value

    parse.__name__ = "seconds"
    return parse


def add_torchrun_arguments(p: argparse.ArgumentParser) -> None:
    """torchrun's flags that ``undying run`` did not have under the same name (the others are in
    run.py)."""
    g = p.add_argument_group(
        "torchrun's flags (same spellings: `undying run` takes a torchrun command line)")
    g.add_argument("--standalone", action="store_true",
                   help="one node, the manager in this launcher with its store on a free port (as "
                   "torchrun's --standalone); without it one node runs the same way (on --port "
                   "when given)")
    g.add_argument("--rdzv-backend", "--rdzv_backend", default="static", metavar="BACKEND",
                   help="static or c10d: undying's manager is the rendezvous either way; etcd is "
                   "refused")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="", metavar="HOST[:PORT]",
                   help="several nodes: the `undying manager` to join (--manager; port "
                   f"{DEFAULT_MANAGER_PORT} by default, as torchrun's); one node: the port the "
                   "manager's store listens on")
    g.add_argument("--rdzv-id", "--rdzv_id", default="", metavar="ID",
                   help="the job id (--job-id); it must fit the job-id alphabet")
    g.add_argument("--rdzv-conf", "--rdzv_conf", default="", metavar="KEY=VALUE,...",
                   help="join_timeout (or timeout) is --node-wait; torchrun's other keys have no "
                   "meaning here (a note says which)")
    g.add_argument("--monitor-interval", "--monitor_interval",
                   type=_positive("--monitor-interval"), default=0.1,
                   metavar="SECONDS",
                   help="accepted for torchrun's sake: undying sees a worker's exit the moment it "
                   "happens")
    g.add_argument("--start-method", "--start_method", choices=("spawn", "fork", "forkserver"),
                   default="spawn",
                   help="accepted for torchrun's sake: workers are forked from a process that "
                   "imported torch once (UNDYING_WORKER_START=spawn starts fresh interpreters)")
    add_setting(g, LaunchConfig, "--role", help="ROLE_NAME of every worker (default '%(default)s')")
    add_setting(g, LaunchConfig, "-m", "--module", action="store_true",
                help="SCRIPT is a module, run as `python -m SCRIPT`")
    add_setting(g, LaunchConfig, "--no-python", "--no_python", action="store_true",
                help="SCRIPT is a program run as it is, not by Python (no step API, whole-group "
                "restart)")
    g.add_argument("--run-path", "--run_path", action="store_true",
                   help="accepted for torchrun's sake: the script always runs with runpy.run_path")
    add_setting(g, LaunchConfig, "--log-dir", "--log_dir", metavar="DIR",
                help="with --redirects/--tee: each rank's streams go to "
                "DIR/<job id>/attempt_<restart>/<local rank>/{stdout,stderr}.log")
    add_setting(g, LaunchConfig, "-r", "--redirects", type=std_arg("--redirects"), metavar="STD",
                help="streams written to the log files only: 0 none, 1 stdout, 2 stderr, 3 both, "
                "or per local rank, e.g. 0:3,1:0")
    add_setting(g, LaunchConfig, "-t", "--tee", type=std_arg("--tee"), metavar="STD",
                help="streams written to the log files and the console (as --redirects)")
    add_setting(g, LaunchConfig, "--local-ranks-filter", "--local_ranks_filter",
                type=_ranks_filter, metavar="RANKS",
                help="only these local ranks' output reaches the console, e.g. 0 (the log files "
                "get every rank's)")
    add_setting(g, LaunchConfig, "--master-addr", "--master_addr", metavar="HOST",
                help="MASTER_ADDR for a script that hosts its own store on rank 0 (default "
                "127.0.0.1 on one node, the manager's host on several)")
    add_setting(g, LaunchConfig, "--master-port", "--master_port", type=int, metavar="PORT",
                help="MASTER_PORT for it (default: a free port on one node, 29500 on several)")
    g.add_argument("--local-addr", "--local_addr", default="", metavar="HOST",
                   help="accepted for torchrun's sake: an agent reaches its manager from the "
                   "address its route gives")


def _note(text: str) -> None:
    sys.stderr.write(f"undying: note: {text}\n")


def apply_torchrun_arguments(args: argparse.Namespace) -> None:
    """Map torchrun's flags onto undying's in ``args`` (job id, manager, port, node wait); refuse
    what cannot be."""
    backend = args.rdzv_backend
    if backend not in _BACKENDS_HERE:
        raise UsageError(f"--rdzv-backend {backend!r:.40}: undying's manager is the rendezvous; "
                         "pass static or c10d (on several nodes start `undying manager` where "
                         "--rdzv-endpoint points)")
    if args.rdzv_id:
        rdzv_id = check_job_id(args.rdzv_id, "--rdzv-id")
        if args.job_id and args.job_id != rdzv_id:
            raise UsageError(f"--rdzv-id {rdzv_id} and --job-id {args.job_id} name different "
                             "jobs; pass one")
        args.job_id = rdzv_id
    _apply_rdzv_conf(args)
    fewest, most = args.nnodes
    if args.standalone:
        if most != 1 or args.manager or args.rdzv_endpoint:
            raise UsageError("--standalone runs one node with the manager here: drop --nnodes > 1, "
                             "--rdzv-endpoint and --manager, or drop --standalone")
        if args.port is None:
            args.port = 0
    if args.rdzv_endpoint:
        text = args.rdzv_endpoint.strip()
        # HOST alone (an IPv6 in brackets): torchrun's default port.
        if ":" not in text or text.endswith("]"):
            text = f"{text}:{DEFAULT_MANAGER_PORT}"
        host, port = check_address("--rdzv-endpoint", text, f"10.0.0.1:{DEFAULT_MANAGER_PORT}",
                                   lowest=1 if most > 1 else 0)
        host = f"[{host}]" if ":" in host else host
        if most > 1:
            endpoint = f"{host}:{port}"
            if args.manager and args.manager != endpoint:
                raise UsageError(f"--rdzv-endpoint {endpoint} and --manager {args.manager} "
                                 "differ; pass one")
            args.manager = endpoint
        else:
            if host.strip("[]") not in _LOCAL_HOSTS:
                _note(f"--rdzv-endpoint {host}: one node runs its manager here, on 127.0.0.1 "
                      "(loopback)")
            if args.port is None:
                args.port = port
    if args.port is None:
        args.port = JobConfig.port
    if args.module and args.no_python:
        raise UsageError("-m/--module and --no-python exclude each other: a module is run by "
                         "Python")
    if args.local_addr:
        _note(f"--local-addr {args.local_addr}: an agent reaches its manager from the address "
              "its route gives; ignored")


def _apply_rdzv_conf(args: argparse.Namespace) -> None:
    if not args.rdzv_conf:
        return
    ignored = []
    for part in args.rdzv_conf.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--rdzv-conf: expected KEY=VALUE,..., got {args.rdzv_conf!r:.80}")
        target = _RDZV_CONF.get(key, "")
        if not target:
            ignored.append(key)
            continue
        seconds = _positive(f"--rdzv-conf {key}")(value)
        setattr(args, target, seconds)
    if ignored:
        _note(f"--rdzv-conf {', '.join(ignored)}: no meaning here (undying's manager is the "
          "rendezvous); ignored")
