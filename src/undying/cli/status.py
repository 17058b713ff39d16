"""``undying status``: the job's state, ranks and incidents, live or from its log.

``--watch`` follows a running job in the terminal: the same view, redrawn in
place (rich ``Live``) from the manager's API about once a second until the job
ends (exit 0) or Ctrl-C (130). One ``view()`` (``cli/status_view.py``) builds
what both print, so the snapshot, the watch and the facts on the web page stay the same.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live

from undying.cli.client import (
    Api,
    add_job_arguments,
    api_for,
    connect,
    readable_log,
    resolve_job_dir,
)
from undying.cli.restarts import logged_has_steps
from undying.cli.status_view import TERMINAL, render, view
from undying.cli.summary import (
    logged_account,
    logged_verification,
)
from undying.config import WHOLE_GROUP_LINE, JobConfig
from undying.errors import JobNotRunningError, UsageError
from undying.jobfiles.events import LogReader
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.log_rows import Commit

__all__ = ["add_parser", "collect_status", "watch", "step_values", "recent_step_values",
           "write_steps", "STATUS_STEP_ROWS"]

# `status --json` of a job dir carries the step values of the newest steps, at most this many rows
# (rank x step): bounded however long and wide the job; every row is `status --steps`.
STATUS_STEP_ROWS = 512

# Polls in a row a manager may miss (a busy machine) before --watch decides it is gone.
MAX_MISSES = 3
# --watch polls the manager once per interval: bounded both ways, so a typo neither floods it nor
# freezes the view.
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 3600.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show a job's state, ranks and incidents",
        description="Show a job's state, generation, ranks (step, PID) and every incident with its "
        "recovery timeline. Reads the running manager's API, or the job's SQLite log once it "
        "ended. With --watch, follow a running job until it ends (exit 0) or Ctrl-C (exit 130).",
    )
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--watch", action="store_true",
                   help="follow the running job, redrawn about once a second, until it ends")
    p.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="SECONDS",
                   help=f"with --watch: seconds between updates, {MIN_INTERVAL_S:g} to "
                   f"{MAX_INTERVAL_S:g} (default 1)")
    p.add_argument("--steps", action="store_true",
                   help="print the values each rank gave step.log at each step, as CSV (one row "
                   "per rank and step: step, rank, generation, time, then one column per name), "
                   "or with --json as JSON; reads the job dir's event log, running or not")
    p.set_defaults(func=run)


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"--interval must be a number of seconds, got {value!r}") from None
    if not MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S:
        raise UsageError(f"--interval must be between {MIN_INTERVAL_S:g} and {MAX_INTERVAL_S:g} "
                         f"seconds (a poll of the manager each time), got {value}")
    return seconds


def collect_status(job_dir: str | None, manager: str | None,
                   token_file: str | None = None) -> dict[str, Any]:
    """The running job from its manager (with the job's token); a finished one from its log (no
    token).

    Either way with the earlier launches whose logs the job dir keeps (``JobDir.archive_log``).
    """
    try:
        status = _live_status(connect(manager, job_dir, token_file))
        jd: JobDir | None = None
        if manager is None:
            with contextlib.suppress(UsageError):
                jd = resolve_job_dir(job_dir)
    except JobNotRunningError:
        if manager is not None:
            raise
        jd = resolve_job_dir(job_dir)
        status = _logged_status(jd)
    status["earlier_runs"] = [_earlier_run(p) for p in jd.earlier_logs()] if jd is not None else []
    # --verify-every: verified and unverified steps.
    if jd is not None and "verification" not in status:
        with contextlib.suppress(UsageError, LogReader.Error, OSError, ValueError):
            step = int(status.get("step") or 0)
            status["verification"] = logged_verification(jd.events_db, step=step)
    return status


def _earlier_run(log: Path) -> dict[str, Any]:
    """One earlier launch, from its archived log: how it ended, how far it got, how much it
    recorded."""
    try:
        with LogReader(log) as reader:
            job, newest = reader.job(), reader.newest_step()
            incidents, events = reader.incidents(), reader.count_events()
    except (UsageError, LogReader.Error) as e:
        return {"log": log.name, "state": "unreadable", "error": str(e), "step": None,
                "events": None}
    state = job.get("state")
    return {
        "log": log.name,
        # An archived log's launcher is gone by definition: one that never ended was interrupted.
        "state": state if state in TERMINAL else "interrupted",
        "job_id": job.get("job_id"),
        "step": newest,
        "events": events,
        "incidents": len(incidents),
    }


def _live_status(api: Api) -> dict[str, Any]:
    status = dict(api.get("/api/status"))
    status["live"] = True
    return status


def _logged_status(jd: JobDir) -> dict[str, Any]:
    """The job as its SQLite event log last recorded it (the launcher is gone).

    A log that never recorded an end (running, recovering, ...) with no launcher
    alive was interrupted (the launcher killed, the machine lost): said so, with
    how to resume, never "running" forever.
    """
    # (bounded reads: the newest step of each rank, never every commit of a long job)
    with readable_log(jd.events_db), LogReader(jd.events_db) as reader:
        job, ranks, incidents = reader.job(), reader.ranks(), reader.incidents()
        newest = reader.newest_steps()
    state = job.get("state")
    exit_reason = job.get("exit_reason", "")
    info = jd.read_manager()
    # A launcher that has not written its address yet.
    starting = state == "starting" and info is None
    if state not in TERMINAL and not starting:
        exit_reason = (f"interrupted: the log says {state}, but no launcher of this job is alive "
                       "(killed, or its machine lost); run the same `undying run` command again to "
                       "resume from its latest checkpoint")
        state = "interrupted"
    step = min((max(r["step"], newest.get(r["rank"], 0)) for r in ranks), default=0)
    with readable_log(jd.events_db):
        account = logged_account(jd.events_db, step=step)
        with LogReader(jd.events_db) as reader:
            steps = logged_has_steps(reader)
    config = job.get("config") or {}
    max_restarts = config.get("max_restarts", JobConfig.max_restarts)
    return {
        "job_id": job.get("job_id"),
        "state": state,
        "generation": job.get("generation"),
        "world_size": job.get("world_size"),
        "started_at": job.get("started_at"),
        # A rank's row is not rewritten per step (the manager keeps steps in their own table).
        "step": step,
        "progress": account.progress.to_dict(),
        "goodput": account.goodput.to_dict(),
        "rerun_steps": job.get("rerun_steps", []),
        "exit_reason": exit_reason,
        "recovery_mode": "" if config.get("step_api", JobConfig.step_api) else
        WHOLE_GROUP_LINE.format(max_restarts=max_restarts),
        # (a script that never calls job.steps: no step or goodput, its restarts instead)
        "has_steps": steps,
        "max_restarts": max_restarts,
        "preemption": job.get("preemption"),
        "slurm": job.get("slurm"),
        "hosts_out": job.get("hosts") or [],  # drained or quarantined (manager/placement/hosts.py)
        "ranks": ranks,
        "incidents": incidents,
        "live": False,
    }


def run(args: argparse.Namespace) -> int:
    if args.steps:
        if args.watch:
            raise UsageError("--steps prints the values logged so far; it does not mix with "
                             "--watch")
        if args.manager is not None:
            raise UsageError("--steps reads the job's event log: pass --job-dir (the job's "
                             "folder), not --manager")
        jd = resolve_job_dir(args.job_dir)
        try:
            write_steps(jd, sys.stdout, as_json=args.json)
            sys.stdout.flush()
        except BrokenPipeError:
            # `| head`: the reader has what it wanted; no traceback at exit either.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.watch:
        if args.json:
            raise UsageError("--watch redraws a view in the terminal; for JSON, poll `undying "
                             "status --json`")
        return watch(args.job_dir, args.manager, Console(), interval=args.interval,
                     token_file=args.token_file)
    status = collect_status(args.job_dir, args.manager, args.token_file)
    if args.json:
        if args.manager is None:
            with contextlib.suppress(UsageError, JobNotRunningError):
                # (a window: the newest steps' rows; every row is `--steps`)
                window, status["step_values"] = recent_step_values(resolve_job_dir(args.job_dir))
                status["step_values_window"] = window
        sys.stdout.write(json.dumps(status, default=str) + "\n")
        return 0
    render(status, Console())
    return 0


# --- --watch -------------------------------------------------------------------


def watch(job_dir: str | None, manager: str | None, console: Console, *, interval: float = 1.0,
          token_file: str | None = None) -> int:
    """Follow a running job until it ends; 0 once it ended, 1 when its launcher vanished mid-run.

    A job that is not running is refused up front with the usual one-line error
    (``JobNotRunningError``), naming its final state when its log has one.
    """
    jd = None if manager is not None else resolve_job_dir(job_dir)
    api = _running_api(jd, manager, token_file)
    status = _live_status(api)
    with Live(view(status, bar=True), console=console, auto_refresh=False, transient=False) as live:
        code = _follow(live, api, jd, status, interval)
    if not console.is_terminal:
        console.line()  # Live leaves its last frame unterminated on a file or a pipe
    return code


def _follow(live: Live, api: Api, jd: JobDir | None, status: dict[str, Any],
            interval: float) -> int:
    url = api.url
    misses = 0
    while status.get("state") not in TERMINAL:
        time.sleep(interval)
        try:
            status = _live_status(api)
            misses = 0
            live.update(view(status, bar=True), refresh=True)
            continue
        except JobNotRunningError:
            misses += 1
        # With a job dir, the launcher's PID says whether the manager is gone or only slow;
        # with --manager alone, a few missed polls in a row say it.
        retry = not _launcher_gone(jd) if jd is not None else misses < MAX_MISSES
        if retry:
            note = f"the manager at {url} is not answering; retrying"
            live.update(view(status, note=note, bar=True), refresh=True)
            continue
        # The launcher exits right after the job ends, often before a poll sees the final state.
        final = _logged_status(jd) if jd is not None and jd.events_db.exists() else None
        if final is not None and final.get("state") in TERMINAL:
            live.update(view(final, bar=True), refresh=True)
            return 0
        last = final or status
        note = (f"the manager at {url} stopped answering while the job was "
                f"{last.get('state')}: its launcher is gone")
        live.update(view(last, note=note, bar=True), refresh=True)
        return 0 if last.get("state") == "stopping" else 1
    return 0


def _running_api(jd: JobDir | None, manager: str | None, token_file: str | None) -> Api:
    if jd is None:
        return connect(manager, None, token_file)
    try:
        return api_for(jd, token_file)
    except JobNotRunningError:
        if jd.events_db.exists():
            state = _logged_status(jd).get("state")
            raise JobNotRunningError(
                f"the job in {jd.path} is not running (its log says {state}); "
                f"`undying status --job-dir {jd.path}` shows how it ended"
            ) from None
        raise


def _launcher_gone(jd: JobDir) -> bool:
    try:
        jd.running_manager_url()
    except JobNotRunningError:
        return True
    return False


# --- --steps ---------------------------------------------------------------------


def step_values(jd: JobDir) -> list[dict[str, Any]]:
    """What each rank gave ``step.log`` at each step, from the job's log: one row per rank and
    step.

    A step run again after a recovery keeps its newest commit (the one that
    counts; ``runs`` says how many times the rank committed it). Ordered by
    step, then rank.
    """
    with readable_log(jd.events_db), LogReader(jd.events_db) as reader:
        return _value_rows(reader.iter_commits())


def recent_step_values(jd: JobDir, rows: int = STATUS_STEP_ROWS
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``status --json``'s window of ``step_values``: the rows of the newest steps, at most
    ``rows`` of them, however long the job ran (the whole series: ``--steps``)."""
    with readable_log(jd.events_db), LogReader(jd.events_db) as reader:
        world = max(1, int(reader.job().get("world_size") or 1))
        newest = reader.newest_step()
        kept = _value_rows(reader.commits_since(newest - max(1, -(-rows // world)) + 1))[-rows:]
    return {"rows": len(kept), "max_rows": rows,
            "first_step": kept[0]["step"] if kept else None,
            "last_step": kept[-1]["step"] if kept else None,
            "all": f"undying status --steps --job-dir {jd.path}"}, kept


def _value_rows(commits: Iterable[Commit]) -> list[dict[str, Any]]:
    newest: dict[tuple[int, int], dict[str, Any]] = {}
    runs: dict[tuple[int, int], int] = {}
    for c in commits:  # (in time order: the later commit of a step wins)
        key = (c.step, c.rank)
        runs[key] = runs.get(key, 0) + 1
        newest[key] = {"step": c.step, "rank": c.rank, "generation": c.generation, "t": c.t,
                       "values": c.metrics}
    return [dict(newest[k], runs=runs[k]) for k in sorted(newest)]


def write_steps(jd: JobDir, out: TextIO, *, as_json: bool) -> None:
    """``--steps``: the rows of ``step_values`` as CSV (a column per name given to ``step.log``) or
    JSON."""
    rows = step_values(jd)
    if as_json:
        out.write(json.dumps({"job_dir": str(jd.path), "steps": rows}) + "\n")
        return
    names = sorted({name for r in rows for name in r["values"]})
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", "rank", "generation", "time", "runs", *names])
    for r in rows:
        writer.writerow([r["step"], r["rank"], r["generation"], f"{r['t']:.6f}", r["runs"],
                         *(repr(r["values"][n]) if n in r["values"] else "" for n in names)])
