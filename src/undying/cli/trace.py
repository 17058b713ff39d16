"""``undying trace on|off [--comm]``: switch a running job's markers, no restart; ``export``:
open them in Perfetto.

The step, checkpoint, forward and data-wait markers switch together; the
collective markers switch alone and need the others on. Every rank follows
within a second (manager -> agents -> workers). ``undying trace export
--perfetto OUT.json`` writes a job's records and incidents as Chrome
trace-event JSON (``undying.trace.perfetto``), running or ended, no manager needed.
"""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
from pathlib import Path

from undying.cli.client import add_job_arguments, connect, readable_log, resolve_job_dir
from undying.errors import UsageError

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace",
        help="switch a running job's tracing on or off",
        description="Switch the lightweight markers of a running job. `on` turns on the step, "
        "checkpoint, forward and data-wait markers; `on --comm` also the collective markers; "
        "`off --comm` turns the collective markers off only; `off` turns everything off (the "
        "collective markers need the others). `show` prints the switch and who set it. Records go "
        "to the job's trace dir (`undying run --trace-dir`), per rank; read them with `undying "
        "diagnose`. `export --perfetto OUT.json` writes them, every rank's steps, collectives and "
        "checkpoint saves and the job's incidents, on one time axis as Chrome trace-event JSON: "
        "open it in Perfetto's UI (ui.perfetto.dev, Open trace file) or chrome://tracing.",
    )
    p.add_argument("action", choices=("on", "off", "show", "export"),
                   help="on, off, show the current switch, or export the records (with --perfetto)")
    p.add_argument("--comm", action="store_true", help="the collective markers (see above)")
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print the manager's answer as JSON")
    p.add_argument("--perfetto", metavar="OUT.json",
                   help="export: the file to write (Chrome trace-event JSON, which Perfetto opens)")
    p.add_argument("--traces", metavar="TRACE_DIR",
                   help="export: the trace dir, job folder or rank folder to read (default: <job "
                        "dir>/traces); incidents come from <job dir>/events.db when there is one")
    p.set_defaults(func=run)


def _export(args: argparse.Namespace) -> int:
    from undying.trace.perfetto import chrome_trace, write_chrome_trace

    if not args.perfetto:
        raise UsageError("trace export needs --perfetto OUT.json: the file to write")
    if args.manager:
        raise UsageError("trace export reads files, not a manager: pass --job-dir (or --traces "
                         "TRACE_DIR)")
    incidents: list[dict[str, object]] = []
    if args.traces is None or args.job_dir is not None:
        jd = resolve_job_dir(args.job_dir)
        traces = Path(args.traces) if args.traces else jd.path / "traces"
        events_db = jd.path / "events.db"
        if events_db.is_file():
            from undying.jobfiles.events import read_job

            with readable_log(events_db):
                incidents = read_job(events_db)["incidents"]
    else:
        traces = Path(args.traces)
    trace = chrome_trace(traces, incidents)
    try:
        path = write_chrome_trace(trace, Path(args.perfetto))
    except OSError as e:
        raise UsageError(f"cannot write {args.perfetto} ({e.strerror or e}); pass another "
                         "--perfetto path") from e
    n = sum(1 for e in trace["traceEvents"] if e["ph"] != "M")
    if args.json:
        sys.stdout.write(json.dumps({"path": str(path), "events": n, **trace["otherData"]}) + "\n")
    else:
        about = trace["otherData"]
        print(f"wrote {n} events of job {about['job']} ({len(about['ranks'])} ranks, "
              f"{about['incidents']} incidents) to {path}; open it in Perfetto's UI or "
              "chrome://tracing")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "export":
        return _export(args)
    if args.perfetto or args.traces:
        raise UsageError("--perfetto and --traces go with `undying trace export`")
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
    print(f"tracing: step {'on' if answer['step'] else 'off'}, "
          f"comm {'on' if answer['comm'] else 'off'}"
          + (f" (set by {answer['by']})" if answer.get("by") else ""))
    if answer.get("error"):
        print(f"switch file problem (ignored): {answer['error']}")
    return 0
