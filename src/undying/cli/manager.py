"""``undying manager``: the manager of a multi-node job, on its own."""

from __future__ import annotations

import argparse

from undying.cli.limits import add_connection_arguments, connection_limits
from undying.cli.progress_line import progress_every_arg
from undying.cli.refusal import Ledger
from undying.cli.settings import add_setting, from_args
from undying.config import ManagerOptions
from undying.errors import UsageError
from undying.inputs import JOB_ID_RULE, check_host_name, check_job_id, job_id_arg
from undying.jobfiles.jobdir import default_job_dir

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "manager",
        help="run the manager of a multi-node job on its own; agents join it with `undying run "
        "--manager`",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Run the manager of job --job-id on its own (a process, or a pod). Each node
then runs `undying run --nnodes N --node-rank I --manager HOST:PORT -n P
--job-id J SCRIPT ...`, all with the same flags: the first agent's flags make
the job, a later agent whose flags differ is refused and told which ones.
Generation 0 starts once all N nodes joined.

Ports: --port is where agents join (HOST:PORT for --manager); the c10d control
store is on --port + 1, the HTTP API on --http-port (default --port + 2).

Access: every agent and every `undying` command must present the job's token:
env UNDYING_TOKEN if set, else <job dir>/token (created mode 0600). Agents on
other hosts take it with --token-file or UNDYING_TOKEN.

A node whose agent's connection closes, or that stays silent past the
heartbeat timeout, is lost: its ranks are recovered as crashed ones, and
their replacements start on the next agent that joins with that --node-rank.
A lost node that comes back is fenced (its workers are killed) and may join
again as a new member.

Restart: if this manager dies, start it again with the same --job-id and
--job-dir. It carries the job on from its SQLite log; the agents reconnect and
training never stopped. SIGTERM preempts the whole job (dying gasp); Ctrl-C
stops it. Exit code as `undying run`'s.""",
    )
    # (each option is a field of ManagerOptions by the rule, --a-b: a_b, its default the field's:
    # cli/settings.py)
    p.add_argument("--job-id", type=job_id_arg, required=True,
                   help=f"the job's name: {JOB_ID_RULE}; every agent passes the same --job-id")
    p.add_argument("--job-dir", default=None,
                   help="the job's folder: event log, token (default ./undying-jobs/<job id>)")
    add_setting(p, ManagerOptions, "--host",
                help="the address to listen on (default %(default)s: this host only); 0.0.0.0 "
                "listens on every interface, which other hosts need")
    add_setting(p, ManagerOptions, "--port", type=int,
                help="where agents join (default %(default)s); the control store is on the next "
                "port")
    p.add_argument("--http-port", type=int, default=None,
                   help="the HTTP API's port (default --port + 2; 0 picks one)")
    add_setting(p, ManagerOptions, "--open-status", action="store_true",
                help="serve the read-only status (GET /, /api/status, /metrics) without the token")
    add_setting(p, ManagerOptions, "--progress-every", type=progress_every_arg, metavar="SECONDS",
                help="a live progress line on a terminal; elsewhere (a file, a pipe) a progress "
                "line every SECONDS (default %(default)g); 0: neither")
    add_connection_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from undying.cli.run_job import refuse_inherited_keys

    refuse_inherited_keys()
    job_id = args.job_id
    check_job_id(job_id)
    if not 0 < args.port < 65534:
        raise UsageError(f"--port must be in [1, 65533] (the control store takes the next one), "
                         f"got {args.port}")
    http_port = args.port + 2 if args.http_port is None else args.http_port
    if not 0 <= http_port < 65536:
        raise UsageError(f"--http-port must be in [0, 65535], got {http_port}")
    from undying.launch.manager_service import serve_manager  # heavy: only for this command

    check_host_name(args.host, "--host")
    options = from_args(ManagerOptions, args, job_id=job_id,
                        job_dir=str(args.job_dir or default_job_dir(job_id)),
                        http_port=http_port, connections=connection_limits(args))
    ledger = Ledger.take(options.job_dir)
    try:
        return serve_manager(options)
    except UsageError:
        # Refused before any agent joined (a port in use): what it created goes (cli.refusal).
        ledger.undo()
        raise
