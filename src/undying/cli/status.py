"""``undying status``: the job's state, ranks and incidents, live or from its log.

``--watch`` follows a running job in the terminal: the same view, redrawn in
place (rich ``Live``) from the manager's API about once a second until the job
ends (exit 0) or Ctrl-C (130). One ``view()`` builds what both print, so the
snapshot, the watch and the facts on the web page stay the same.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from undying.cli.client import (
    Api,
    add_job_arguments,
    api_for,
    connect,
    readable_log,
    resolve_job_dir,
)
from undying.cli.summary import (
    LOSS_WORDS,
    duration,
    goodput_line,
    logged_account,
    logged_verification,
    verification_line,
)
from undying.config import WHOLE_GROUP_LINE, JobConfig
from undying.errors import JobNotRunningError, UsageError
from undying.jobfiles.events import LogReader, read_job
from undying.jobfiles.jobdir import JobDir

__all__ = ["add_parser", "collect_status", "render", "view", "watch", "slow_finding", "step_values", "write_steps"]

# Job states after which nothing changes any more (JobState.terminal, as strings from the API).
TERMINAL = frozenset({"succeeded", "failed", "stopped", "preempted"})
# Polls in a row a manager may miss (a busy machine) before --watch decides it is gone.
MAX_MISSES = 3
# --watch polls the manager once per interval: bounded both ways, so a typo neither floods it nor freezes the view.
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 3600.0
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
                   help=f"with --watch: seconds between updates, {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} "
                   "(default 1)")
    p.add_argument("--steps", action="store_true",
                   help="print the values each rank gave step.log at each step, as CSV (one row per rank and "
                   "step: step, rank, generation, time, then one column per name), or with --json as JSON; "
                   "reads the job dir's event log, running or not")
    p.set_defaults(func=run)


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"--interval must be a number of seconds, got {value!r}") from None
    if not MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S:
        raise UsageError(f"--interval must be between {MIN_INTERVAL_S:g} and {MAX_INTERVAL_S:g} seconds "
                         f"(a poll of the manager each time), got {value}")
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
    if jd is not None and "verification" not in status:  # --verify-every: verified and unverified steps
        with contextlib.suppress(UsageError, LogReader.Error, OSError, ValueError):
            status["verification"] = logged_verification(jd.events_db, step=int(status.get("step") or 0))
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
    with readable_log(jd.events_db):
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
    step = min((max(r["step"], newest.get(r["rank"], 0)) for r in data["ranks"]), default=0)
    with readable_log(jd.events_db):
        account = logged_account(jd.events_db, step=step)
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
        "recovery_mode": "" if (job.get("config") or {}).get("step_api", JobConfig.step_api) else
        WHOLE_GROUP_LINE.format(max_restarts=(job.get("config") or {}).get("max_restarts", JobConfig.max_restarts)),
        "preemption": job.get("preemption"),
        "hosts_out": job.get("hosts") or [],  # drained or quarantined (manager/placement/hosts.py)
        "ranks": data["ranks"],
        "incidents": data["incidents"],
        "live": False,
    }


def run(args: argparse.Namespace) -> int:
    if args.steps:
        if args.watch:
            raise UsageError("--steps prints the values logged so far; it does not mix with --watch")
        if args.manager is not None:
            raise UsageError("--steps reads the job's event log: pass --job-dir (the job's folder), not --manager")
        jd = resolve_job_dir(args.job_dir)
        try:
            write_steps(jd, sys.stdout, as_json=args.json)
            sys.stdout.flush()
        except BrokenPipeError:  # `| head`: the reader has what it wanted; no traceback at exit either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.watch:
        if args.json:
            raise UsageError("--watch redraws a view in the terminal; for JSON, poll `undying status --json`")
        return watch(args.job_dir, args.manager, Console(), interval=args.interval, token_file=args.token_file)
    status = collect_status(args.job_dir, args.manager, args.token_file)
    if args.json:
        if args.manager is None:
            with contextlib.suppress(UsageError, JobNotRunningError):
                status["step_values"] = step_values(resolve_job_dir(args.job_dir))
        sys.stdout.write(json.dumps(status, default=str) + "\n")
        return 0
    render(status, Console())
    return 0


# --- the view ------------------------------------------------------------------


def render(status: dict[str, Any], console: Console) -> None:
    console.print(view(status))


def view(status: dict[str, Any], note: str = "", *, bar: bool = False) -> Group:
    """The job as rich renderables: header, progress, goodput, trace switch, step time, ranks, incidents.

    Every part reads at 80 columns: lines wrap, and what would make a table
    too wide (an incident's timeline, its error, a slow rank's finding) is on
    lines of its own under the table. ``bar``: a progress bar (``--watch``).
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
    progress = status.get("progress") or {}
    if progress:
        parts.extend(_progress_lines(progress, bar=bar))
    goodput = status.get("goodput") or {}
    if goodput.get("ratio") is not None:
        parts.append(Text(goodput_line(goodput)))
    parts.extend(_checkpoint_lines(status))
    if status.get("verification"):
        parts.append(Text("  " + verification_line(status["verification"])))
    if status.get("regroup"):
        parts.append(_regroup_line(status["regroup"]))
    for mark in status.get("hosts_out") or []:  # no new ranks there until `undying undrain HOST`
        line = f"  host {mark.get('host')}: {mark.get('state')} by {mark.get('by')}: {mark.get('reason')}"
        if mark.get("state") == "quarantined":  # manager.placement.hosts: it requalifies only on verified steps
            line += (f" (requalifying: {mark.get('passes', 0)}/{mark.get('needed', '?')} verified, with "
                     f"--verify-every; or `undying undrain {mark.get('host')}`)")
            if isinstance(under := mark.get("drained"), dict):  # kept under the quarantine: drained once it clears
                line += f"; also drained by {under.get('by')}: {under.get('reason')}"
        parts.append(Text(line))
    for parked in status.get("standbys") or []:  # a lost or moved node goes to one of these
        heard = max(0.0, time.time() - float(parked.get("last_heard") or 0.0))
        parts.append(Text(f"  standby on {parked.get('host')} (agent pid {parked.get('agent_pid')}): "
                          f"{parked.get('spares_ready', 0)} warm spare(s), last heard {heard:.0f}s ago"))
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
        parts.extend(_incident_details(i, goodput))
    for i in incidents:
        if i.get("traceback"):
            parts.append(Text.assemble(
                (f"incident {i['id']}", "bold"), f" traceback (rank {i['rank']}):\n", str(i["traceback"])
            ))
    return Group(*parts)


def _progress_lines(progress: dict[str, Any], *, bar: bool) -> list[RenderableType]:
    """Step of total, epoch, rate and ETA; the last values given to ``step.log``; with ``bar``, a bar."""
    total = progress.get("total_steps")
    step = progress.get("step") or 0
    words = [f"step {step}" + (f" of {total}" if total is not None else "")
             + (f" ({progress['fraction']:.0%})" if progress.get("fraction") is not None else "")]
    if progress.get("epoch") is not None:
        words.append(f"epoch {progress['epoch'] + 1}" + (f" of {progress['epochs']}" if progress.get("epochs") else ""))
    if progress.get("steps_per_s"):
        words.append(f"{progress['steps_per_s']:.3g} steps/s")
    if progress.get("samples_per_s"):
        words.append(f"{progress['samples_per_s']:.4g} samples/s")
    if progress.get("eta_s") is not None:
        words.append(f"ETA {duration(progress['eta_s'])}")
    lines: list[RenderableType] = [Text("progress: " + ", ".join(words))]
    if bar and total:
        grid = Table.grid(padding=(0, 1))  # (a bar alone leaves its line open: the next line would run on)
        grid.add_row(ProgressBar(total=float(total), completed=float(min(step, total)), width=40),
                     Text(f"{min(step, total)}/{total}"))
        lines.append(grid)
    values = progress.get("values") or {}
    if values:
        shown = ", ".join(f"{k} {v:.6g}" for k, v in sorted(values.items()))
        lines.append(Text(f"  last values (step {progress.get('values_step')}, mean over ranks): {shown}"))
    return lines


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
    headers = {"generation": "gen", "restarts": "restarts"}
    table = Table(title="ranks")
    for k in keys:
        table.add_column(headers.get(k, k), overflow="fold")
    for r in ranks:
        table.add_row(*(Text(str(r.get(k, "-"))) for k in keys))
    return table


def _incidents_table(incidents: Sequence[dict[str, Any]]) -> Table:
    """One row per incident, short cells only; its timeline and findings follow on lines of their own."""
    table = Table(title="incidents")
    for header in ("#", "kind", "rank", "step", "action", "status", "MTTR s"):
        table.add_column(header, overflow="fold")
    for i in incidents:
        mttr = "-" if i.get("mttr_s") is None else f"{i['mttr_s']:.3f}"
        cells = (i["id"], i["kind"], i["rank"], i["step"], i.get("action") or "-", i["status"], mttr)
        table.add_row(*(Text(str(c)) for c in cells))
    return table


def _incident_details(incident: dict[str, Any], goodput: dict[str, Any]) -> list[Text]:
    """An incident's lines under the table: its finding (a slow rank's), error, timeline and what it cost."""
    lines = []
    head = f"  #{incident['id']} "
    finding = slow_finding(incident)
    if finding:
        lines.append(Text(head + finding))
    if incident.get("error") and not finding:  # (a finding's error is its sentence: said above in short)
        lines.append(Text(head + "error: " + str(incident["error"]).strip().splitlines()[-1]))
    phases = incident.get("phases") or {}
    if phases:
        timeline = ", ".join(f"{k} {float(v):.3f}" for k, v in phases.items())
        lines.append(Text(head + f"timeline (s since fault): {timeline}"))
    spent = next((g for g in goodput.get("incidents") or [] if g.get("id") == incident.get("id")), None)
    if spent:
        cost = ", ".join(f"{LOSS_WORDS.get(k[:-2], k[:-2])} {duration(v)}" for k, v in spent.items()
                         if k.endswith("_s") and v >= 0.005)
        if cost:
            lines.append(Text(head + f"cost in wall time: {cost}"))
    return lines


def slow_finding(incident: dict[str, Any]) -> str:
    """A slow rank's or node's finding in words: which rank, since which step, by how much, in which phase."""
    if incident.get("kind") not in ("slow_rank", "slow_node"):
        return ""
    detail = incident.get("detail") or {}
    who = (f"node {detail['node']} (ranks {', '.join(map(str, detail.get('ranks') or []))})"
           if incident["kind"] == "slow_node" and "node" in detail else f"rank {detail.get('rank', incident['rank'])}")
    since = detail.get("since_step", incident.get("step"))
    words = f"{who} slower since step {since}"
    if detail.get("excess_s") is not None:
        words += f", +{float(detail['excess_s']) * 1000:.1f} ms a step"
    if detail.get("factor"):
        words += f" (x{float(detail['factor']):.2f})"
    if detail.get("phase"):
        words += f" in {detail['phase']}"
    return words


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


def _follow(live: Live, api: Api, jd: JobDir | None, status: dict[str, Any], interval: float) -> int:
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
            live.update(view(status, note=f"the manager at {url} is not answering; retrying", bar=True),
                        refresh=True)
            continue
        # The launcher exits right after the job ends, often before a poll sees the final state.
        final = _logged_status(jd) if jd is not None and jd.events_db.exists() else None
        if final is not None and final.get("state") in TERMINAL:
            live.update(view(final, bar=True), refresh=True)
            return 0
        last = final or status
        live.update(view(last, note=f"the manager at {url} stopped answering while the job was "
                                    f"{last.get('state')}: its launcher is gone", bar=True), refresh=True)
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
    """What each rank gave ``step.log`` at each step, from the job's log: one row per rank and step.

    A step run again after a recovery keeps its newest commit (the one that
    counts; ``runs`` says how many times the rank committed it). Ordered by
    step, then rank.
    """
    with readable_log(jd.events_db), LogReader(jd.events_db) as reader:
        commits = reader.commits()
    newest: dict[tuple[int, int], dict[str, Any]] = {}
    runs: dict[tuple[int, int], int] = {}
    for c in commits:  # (in time order: the later commit of a step wins)
        key = (c.step, c.rank)
        runs[key] = runs.get(key, 0) + 1
        newest[key] = {"step": c.step, "rank": c.rank, "generation": c.generation, "t": c.t, "values": c.metrics}
    return [dict(newest[k], runs=runs[k]) for k in sorted(newest)]


def write_steps(jd: JobDir, out: TextIO, *, as_json: bool) -> None:
    """``--steps``: the rows of ``step_values`` as CSV (a column per name given to ``step.log``) or JSON."""
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
