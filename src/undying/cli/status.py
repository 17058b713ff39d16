"""``undying status``: the job's state, ranks and incidents, live or from its log."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from undying.cli.client import add_job_arguments, api_get, manager_url, resolve_job_dir
from undying.errors import JobNotRunningError
from undying.manager.events import read_job

__all__ = ["add_parser", "collect_status"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="show a job's state, ranks and incidents",
        description="Show a job's state, generation, ranks (step, PID) and every incident with its "
        "recovery timeline. Reads the running manager's API, or the job's SQLite log once it ended.",
    )
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def collect_status(job_dir: str | None, manager: str | None) -> dict[str, Any]:
    try:
        url = manager_url(manager, job_dir)
        status = api_get(url, "/api/status")
        status["live"] = True
        return dict(status)
    except JobNotRunningError:
        if manager is not None:
            raise
    jd = resolve_job_dir(job_dir)
    data = read_job(jd.events_db)
    job = data["job"]
    return {
        "job_id": job.get("job_id"),
        "state": job.get("state"),
        "generation": job.get("generation"),
        "world_size": job.get("world_size"),
        "started_at": job.get("started_at"),
        "step": min((r["step"] for r in data["ranks"]), default=0),
        "rerun_steps": job.get("rerun_steps", []),
        "exit_reason": job.get("exit_reason", ""),
        "ranks": data["ranks"],
        "incidents": data["incidents"],
        "live": False,
    }


def run(args: argparse.Namespace) -> int:
    status = collect_status(args.job_dir, args.manager)
    if args.json:
        sys.stdout.write(json.dumps(status, default=str) + "\n")
        return 0
    render(status, Console())
    return 0


def render(status: dict[str, Any], console: Console) -> None:
    started = status.get("started_at")
    age = f", running {time.time() - started:.0f}s" if started and status.get("live") else ""
    console.print(
        f"[bold]job {status['job_id']}[/bold]: {status['state']}, generation {status['generation']}, "
        f"{status['world_size']} ranks, step {status['step']}{age}"
        + ("" if status.get("live") else " (from the event log; the launcher is not running)")
    )
    if status.get("exit_reason"):
        console.print(f"  {status['exit_reason']}")
    ranks = Table("rank", "node", "state", "step", "generation", "pid", "restarts", title="ranks")
    for r in status["ranks"]:
        ranks.add_row(*(str(r[k]) for k in ("rank", "node", "state", "step", "generation", "pid", "restarts")))
    console.print(ranks)
    incidents = status["incidents"]
    if not incidents:
        console.print("no incidents")
        return
    table = Table("#", "kind", "rank", "step", "action", "status", "mttr s", "timeline (s since fault)", title="incidents")
    for i in incidents:
        timeline = ", ".join(f"{k} {v:.3f}" for k, v in i["phases"].items())
        mttr = "-" if i["mttr_s"] is None else f"{i['mttr_s']:.3f}"
        table.add_row(str(i["id"]), i["kind"], str(i["rank"]), str(i["step"]), i["action"], i["status"], mttr, timeline)
    console.print(table)
    for i in incidents:
        if i.get("traceback"):
            console.print(f"[bold]incident {i['id']}[/bold] traceback (rank {i['rank']}):\n{i['traceback']}")
