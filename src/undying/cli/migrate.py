"""``undying migrate``, ``undying drain`` and ``undying undrain``: planned moves of a running job.

Each talks to the job's manager over its HTTP API with the job's token, as
``undying inject`` does; the manager checks the request and carries it out
(``undying.manager.placement.migration``). No torch here.
"""

from __future__ import annotations

import argparse
import json
import sys

from undying.cli.client import add_job_arguments, connect
from undying.errors import UsageError

__all__ = ["add_parsers"]


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "migrate",
        help="move a rank of a running job to a warm spare at a step boundary, losing nothing",
        description="Move a rank of a running job to another process at a step boundary while "
        "training goes on: the rank leaves at the start of a step (its last step committed), a "
        "warm spare of its node (or a new process when none is warm) takes the rank and gets the "
        "state from a peer, and every rank runs the next step once. No step is re-run to "
        "completion and the losses are those of the run without the move. The incident log "
        "records it as a planned `migration` with its timeline. Use it to take a rank off a "
        "process before it fails, or to exercise the path.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int, help="the rank to move")
    which.add_argument("--node", type=int,
                       help="the node to move: every rank of it leaves at the same boundary and a "
                       "standby agent (`undying run --standby`) parked on --to takes the node")
    p.add_argument("--to", metavar="HOST", default=None,
                   help="where to: for --rank, its own node's host (the default), where it takes a "
                   "warm spare, or another host with a standby parked there when the rank is its "
                   "node's only one; for --node, the host of a parked standby (default: any "
                   "standby not on a drained host); `undying status` lists each node's host")
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print the manager's answer as JSON")
    p.set_defaults(func=_migrate)

    for name, words in (
        ("drain", "Mark a host drained: it gets no new ranks (a standby parked there is not "
                  "promoted, no rank moves there) until `undying undrain HOST`. Refused, with "
                  "nothing changed, while a rank of the job still runs on it and there is nowhere "
                  "to move it."),
        ("undrain", "Put a drained or quarantined host back: it may get ranks again. This is the "
                    "one way to clear either state; `undying status` lists the hosts that are out "
                    "and why."),
    ):
        q = sub.add_parser(name, help=words.split(":")[0].split(".")[0].lower(),
                           description=words)
        q.add_argument("host", metavar="HOST",
                       help="the host, as `undying status` lists it under nodes")
        if name == "drain":
            q.add_argument("--reason", default="",
                           help="why, for the status and the log (e.g. 'disk swap')")
        add_job_arguments(q)
        q.add_argument("--json", action="store_true", help="print the manager's answer as JSON")
        q.set_defaults(func=_host_command, what=name)


def _migrate(args: argparse.Namespace) -> int:
    for name in ("rank", "node"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0, got {getattr(args, name)}")
    api = connect(args.manager, args.job_dir, args.token_file)
    which = {"rank": args.rank} if args.rank is not None else {"node": args.node}
    answer = api.post("/api/migrate", {**which, "to": args.to})
    if args.json:
        sys.stdout.write(json.dumps(answer) + "\n")
    elif "migrating_node" in answer:
        ranks = ", ".join(map(str, answer["ranks"]))
        print(f"migrating: node {answer['migrating_node']} (ranks {ranks}) leaves "
              f"{answer['from']} after step {answer['boundary_step']} for the standby on "
              f"{answer['to']}")
    else:
        print(f"migrating: rank {answer['migrating']} (pid {answer['pid']}) leaves after step "
              f"{answer['boundary_step']} for a {answer['replacement']} on {answer['to']}; "
              "`undying status` shows the planned incident and its timeline")
    return 0


def _host_command(args: argparse.Namespace) -> int:
    api = connect(args.manager, args.job_dir, args.token_file)
    body = {"host": args.host, **({"reason": args.reason} if args.what == "drain" else {})}
    answer = api.post(f"/api/{args.what}", body)
    if args.json:
        sys.stdout.write(json.dumps(answer) + "\n")
    elif args.what == "drain":
        print(f"host {answer['host']}: {answer['state']} ({answer['reason']}); `undying undrain "
              f"{answer['host']}` puts it back")
        for moved in answer.get("moved", []):
            ranks = ", ".join(map(str, moved["ranks"]))
            print(f"  node {moved['migrating_node']} (ranks {ranks}) moves to the "
                  f"standby on {moved['to']} after step {moved['boundary_step']}")
    else:
        print(f"host {answer['host']}: ok (was {answer['was']})")
    return 0
