"""``undying status``: the job's state, ranks and incidents, live or from its log.

``--watch`` follows a running job in the terminal: the same view, redrawn in
place (rich ``Live``) from the manager's API about once a second until the job
ends (exit 0) or Ctrl-C (130). One ``view()`` builds what both print, so the
snapshot, the watch and the facts on the web page stay the same.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from undying.cli.client import Api, add_job_arguments, api_for, connect, resolve_job_dir
from undying.config import WHOLE_GROUP_LINE
from undying.errors import JobNotRunningError, UsageError
from undying.manager.events import LogReader, read_job
from undying.manager.jobdir import JobDir

__all__ = ["add_parser", "collect_status", "render", "view", "watch"]

# Job states after which nothing changes any more (JobState.terminal, as strings from the API).
TERMINAL = frozenset({"succeeded", "failed", "stopped", "preempted"})
# Polls in a row a manager may miss (a busy machine) before --watch decides it is gone.
MAX_MISSES = 3
_SPARKS = "▁▂▃▄▅▆▇█"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show a job's state, ranks and incidents",
        description="Show a job's state, generation, ranks (step, PID) and every incident with its "
        "recovery timeline. Reads the running manager's API, or the job's SQLite log once it ended. "
        "With --watch, follow a running job until it ends (exit 0) or Ctrl-C (exit 130).",
    )
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--watch", action="store_true",
                   help="follow the running job, redrawn about once a second, until it ends")
    p.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="SECONDS",
                   help="with --watch: seconds between updates (default 1)")
    p.set_defaults(func=run)


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"--interval must be a number of seconds, got {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise UsageError(f"--interval must be a finite number of seconds above 0, got {value}")
    return seconds


def collect_status(job_dir: str | None, manager: str | None, token_file: str | None = None) -> dict[str, Any]:
    """The running job from its manager (with the job's token); a finished one from its log (no token).

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
    return status


def _earlier_run(log: Path) -> dict[str, Any]:
    """One earlier launch, from its archived log: how it ended, how far it got, how much it recorded."""
    try:
        with LogReader(log) as reader:
            job, commits, incidents, events = reader.job(), reader.commits(), reader.incidents(), reader.count_events()
    except (UsageError, LogReader.Error) as e:
        return {"log": log.name, "state": "unreadable", "error": str(e), "step": None, "events": None}
    state = job.get("state")
    return {
        "log": log.name,
        # An archived log's launcher is gone by definition: one that never ended was interrupted.
        "state": state if state in TERMINAL else "interrupted",
        "job_id": job.get("job_id"),
        "step": max((c.step for c in commits), default=0),
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
    data = read_job(jd.events_db)
    job = data["job"]
    newest: dict[int, int] = {}
    for commit in data["steps"]:
        newest[commit["rank"]] = max(newest.get(commit["rank"], 0), commit["step"])
    state = job.get("state")
    exit_reason = job.get("exit_reason", "")
    info = jd.read_manager()
    starting = state == "starting" and info is None  # a launcher that has not written its address yet
    if state not in TERMINAL and not starting:
        exit_reason = (f"interrupted: the log says {state}, but no launcher of this job is alive (killed, or its "
                       "machine lost); run the same `undying run` command again to resume from its latest "
                       "checkpoint")
        state = "interrupted"
    return {
        "job_id": job.get("job_id"),
        "state": state,
        "generation": job.get("generation"),
        "world_size": job.get("world_size"),
        "started_at": job.get("started_at"),
        # A rank's row is not rewritten per step (the manager keeps steps in their own table).
        "step": min((max(r["step"], newest.get(r["rank"], 0)) for r in data["ranks"]), default=0),
        "rerun_steps": job.get("rerun_steps", []),
        "exit_reason": exit_reason,
        "recovery_mode": "" if (job.get("config") or {}).get("step_api", True) else
        WHOLE_GROUP_LINE.format(max_restarts=(job.get("config") or {}).get("max_restarts", 3)),
        "preemption": job.get("preemption"),
        "ranks": data["ranks"],
        "incidents": data["incidents"],
        "live": False,
    }


def run(args: argparse.Namespace) -> int:
    if args.watch:
        if args.json:
            raise UsageError("--watch redraws a view in the terminal; for JSON, poll `undying status --json`")
        return watch(args.job_dir, args.manager, Console(), interval=args.interval, token_file=args.token_file)
    status = collect_status(args.job_dir, args.manager, args.token_file)
    if args.json:
        sys.stdout.write(json.dumps(status, default=str) + "\n")
        return 0
    render(status, Console())
    return 0


# --- the view ------------------------------------------------------------------


def render(status: dict[str, Any], console: Console) -> None:
    console.print(view(status))


def view(status: dict[str, Any], note: str = "") -> Group:
    """The job as rich renderables: header, trace switch, step time, ranks, incidents.

    Values that come from the job (ids, errors, tracebacks) go in as ``Text``,
    never as console markup, so a traceback holding ``[/]`` prints as itself.
    """
    parts: list[RenderableType] = [_header(status)]
    if note:
        parts.append(Text(note, style="yellow"))
    if status.get("exit_reason"):
        parts.append(Text("  " + str(status["exit_reason"])))
    if status.get("recovery_mode"):
        parts.append(Text("  " + str(status["recovery_mode"])))
    parts.extend(_checkpoint_lines(status))
    if status.get("regroup"):
        parts.append(_regroup_line(status["regroup"]))
    if "trace" in status:
        parts.append(_trace_line(status.get("trace") or {}))
    if status.get("step_times"):
        parts.append(_step_time_line(status["step_times"]))
    parts.append(_ranks_table(status.get("ranks") or []))
    for run in status.get("earlier_runs") or []:
        parts.append(Text(f"  earlier launch in this job dir: {run['log']}: {run['state']}, last step {run['step']}, "
                          f"{run['events']} events, {run.get('incidents', 0)} incident(s)"))
    incidents = status.get("incidents") or []
    if not incidents:
        parts.append(Text("no incidents"))
        return Group(*parts)
    parts.append(_incidents_table(incidents))
    for i in incidents:
        if i.get("traceback"):
            parts.append(Text.assemble(
                (f"incident {i['id']}", "bold"), f" traceback (rank {i['rank']}):\n", str(i["traceback"])
            ))
    return Group(*parts)


def _checkpoint_lines(status: dict[str, Any]) -> list[Text]:
    """Failing saves, and what a resume from the checkpoint that stands re-runs (finding 6 of #14)."""
    lines = []
    health = (status.get("checkpoints") or {}).get("health") or {}
    if health.get("failing"):
        lines.append(Text(f"  checkpoint saves failing since step {health.get('last_failed_step')}: "
                          f"{health.get('last_os_error') or health.get('last_error')}", style="red"))
    reruns = (status.get("preemption") or {}).get("resume_reruns")
    if reruns:
        lines.append(Text(f"  a resume re-runs {reruns} step(s): the checkpoint that stands is older than the stop step",
                          style="yellow"))
    return lines


def _header(status: dict[str, Any]) -> Text:
    started = status.get("started_at")
    live = status.get("live")
    age = f", running {time.time() - started:.0f}s" if started and live and status.get("state") not in TERMINAL else ""
    return Text.assemble(
        (f"job {status.get('job_id')}", "bold"),
        f": {status.get('state')}, generation {status.get('generation')}, "
        f"{status.get('world_size')} ranks, step {status.get('step')}{age}",
        "" if live else " (from the event log; the launcher is not running)",
    )


def _regroup_line(regroup: dict[str, Any]) -> Text:
    """The job moving to another set of nodes: why, and what it waits for."""
    line = Text.assemble(("regrouping", "yellow"), f": {regroup.get('why')}")
    if regroup.get("waiting_for_nodes_since"):
        waited = time.time() - float(regroup["waiting_for_nodes_since"])
        line.append(f"\n  the state is saved in {regroup.get('checkpoint')}; waiting {waited:.0f}s for nodes to join "
                    "(`undying run --node-rank I --manager ...`)")
    else:
        line.append(f"\n  ranks {regroup.get('members')} save their newest step; left so far: {regroup.get('left')}")
    return line


def _trace_line(trace: dict[str, Any]) -> Text:
    def switch(name: str) -> tuple[str, str]:
        return ("on", "green") if trace.get(name) else ("off", "dim")

    line = Text.assemble("trace: step markers ", switch("step"), ", comm markers ", switch("comm"))
    if trace.get("by"):
        when = f" at {time.strftime('%H:%M:%S', time.localtime(trace['t']))}" if trace.get("t") else ""
        line.append(f" (changed by {trace['by']}{when})", style="dim")
    if trace.get("error"):
        line.append(f"\n  switch file ignored: {trace['error']}", style="red")
    return line


def _step_time_line(step_times: Sequence[Sequence[float]], width: int = 40) -> Text:
    """The last step's time, the recent mean and a sparkline of the recent steps."""
    times = [float(t) for _, t in step_times[-width:]]
    last_step, last = step_times[-1]
    low, high = min(times), max(times)
    spread = (high - low) or 1.0
    spark = "".join(_SPARKS[min(len(_SPARKS) - 1, int((t - low) / spread * len(_SPARKS)))] for t in times)
    return Text.assemble(
        f"step time: {last:.3f}s at step {last_step}, mean {sum(times) / len(times):.3f}s "
        f"over the last {len(times)} (min {low:.3f}s, max {high:.3f}s) ",
        (spark, "cyan"),
    )


def _ranks_table(ranks: Sequence[dict[str, Any]]) -> Table:
    # The phase column appears when the manager reports phases, so older output stays as it was.
    keys = ["rank", "node", "state", *(["phase"] if any("phase" in r for r in ranks) else []),
            "step", "generation", "pid", "restarts"]
    table = Table(*keys, title="ranks")
    for r in ranks:
        table.add_row(*(Text(str(r.get(k, "-"))) for k in keys))
    return table


def _incidents_table(incidents: Sequence[dict[str, Any]]) -> Table:
    table = Table("#", "kind", "rank", "step", "action", "status", "mttr s", "timeline (s since fault)",
                  title="incidents")
    for i in incidents:
        timeline = ", ".join(f"{k} {v:.3f}" for k, v in (i.get("phases") or {}).items())
        mttr = "-" if i.get("mttr_s") is None else f"{i['mttr_s']:.3f}"
        cells = (i["id"], i["kind"], i["rank"], i["step"], i["action"], i["status"], mttr, timeline)
        table.add_row(*(Text(str(c)) for c in cells))
    return table


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
    with Live(view(status), console=console, auto_refresh=False, transient=False) as live:
        code = _follow(live, api, jd, status, interval)
    if not console.is_terminal:
        console.line()  # Live leaves its last frame unterminated on a file or a pipe
    return code


def _follow(live: Live, api: Api, jd: JobDir | None, status: dict[str, Any], interval: float) -> int:
    url = api.url
    misses = 0
    while status.get("state") not in TERMINAL:
        time.sleep(interval)
        try:
            status = _live_status(api)
            misses = 0
            live.update(view(status), refresh=True)
            continue
        except JobNotRunningError:
            misses += 1
        # With a job dir, the launcher's PID says whether the manager is gone or only slow;
        # with --manager alone, a few missed polls in a row say it.
        retry = not _launcher_gone(jd) if jd is not None else misses < MAX_MISSES
        if retry:
            live.update(view(status, note=f"the manager at {url} is not answering; retrying"), refresh=True)
            continue
        # The launcher exits right after the job ends, often before a poll sees the final state.
        final = _logged_status(jd) if jd is not None and jd.events_db.exists() else None
        if final is not None and final.get("state") in TERMINAL:
            live.update(view(final), refresh=True)
            return 0
        last = final or status
        live.update(view(last, note=f"the manager at {url} stopped answering while the job was "
                                    f"{last.get('state')}: its launcher is gone"), refresh=True)
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
