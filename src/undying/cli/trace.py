"""``undying trace on|off [--comm]``: switch a running job's markers, no restart.

The step, checkpoint, forward and data-wait markers switch together; the
collective markers switch alone and need the others on. Every rank follows
within a second (manager -> agents -> workers).
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys

from undying.cli.client import add_job_arguments, connect

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace",
        help="switch a running job's tracing on or off",
        description="Switch the lightweight markers of a running job. `on` turns on the step, "
        "checkpoint, forward and data-wait markers; `on --comm` also the collective markers; "
        "`off --comm` turns the collective markers off only; `off` turns everything off (the "
        "collective markers need the others). `show` prints the switch and who set it. Records go "
        "to the job's trace dir (`undying run --trace-dir`), per rank; read them with `undying diagnose`.",
    )
    p.add_argument("action", choices=("on", "off", "show"), help="on, off, or show the current switch")
    p.add_argument("--comm", action="store_true", help="the collective markers (see above)")
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print the manager's answer as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    api = connect(args.manager, args.job_dir, args.token_file)
    if args.action == "show":
        answer = api.get("/api/trace")
    else:
        who = f"cli {getpass.getuser()}@{socket.gethostname()}"
        answer = api.post("/api/trace", {"on": args.action == "on", "comm": args.comm, "by": who})
    if args.json:
        sys.stdout.write(json.dumps(answer) + "\n")
        return 0
    if answer.get("message"):
        print(answer["message"])
    print(f"tracing: step {'on' if answer['step'] else 'off'}, comm {'on' if answer['comm'] else 'off'}"
          + (f" (set by {answer['by']})" if answer.get("by") else ""))
    if answer.get("error"):
        print(f"switch file problem (ignored): {answer['error']}")
    return 0
