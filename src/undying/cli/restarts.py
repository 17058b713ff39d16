"""The account of a job whose script has no steps, in words: wall time, whole-group restarts, why.

``undying run``'s end summary and ``undying status`` print these lines for a
script that never calls ``job.steps`` (``jobfiles.restarts``): no step, goodput
or re-run line, which would read "step 0" and "0.0%". Each line fits 80
columns; a path that cannot break stands alone on its own line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from undying.cli.words import duration
from undying.config import wrap
from undying.jobfiles.events import LogReader
from undying.jobfiles.progress import PLAN_EVENT
from undying.jobfiles.restarts import Round, has_steps, recovered, rounds

__all__ = ["WIDTH", "NO_STEPS", "incidents_line", "restart_lines", "no_step_summary", "wrapped",
           "logged_has_steps"]

WIDTH = 80
# An error longer than this is cut in the restart's line (the whole of it is in `undying status`).
_ERROR_CHARS = 120
NO_STEPS = "no steps to count: the script never calls job.steps (undying's step API)"


def wrapped(text: str, indent: str = "", more: str = "") -> list[str]:
    """``text`` in lines of at most ``WIDTH`` columns (``more``: the indent of the lines after the
    first); a word that cannot break (a path) stands alone on its line."""
    return wrap(text, WIDTH, indent, more)  # (nor between a number and its unit: config.console)


def logged_has_steps(reader: LogReader) -> bool:
    """Whether the job whose log ``reader`` reads has steps to count (``jobfiles.restarts``)."""
    config = reader.job().get("config") or {}
    return has_steps(step_api=bool(config.get("step_api", True)),
                     planned=bool(reader.events(PLAN_EVENT)), committed=reader.newest_step() > 0)


def incidents_line(incidents: Sequence[Mapping[str, Any]]) -> str:
    """``incidents: N, M recovered, mean MTTR ...``: the count every summary gives, by the one
    meaning of recovered (``jobfiles.restarts.recovered``); the MTTR only of those that have one."""
    if not incidents:
        return "incidents: none"
    done = recovered(incidents)
    mttrs = [float(i["mttr_s"]) for i in done if i.get("mttr_s") is not None]
    mean = f", mean MTTR {duration(sum(mttrs) / len(mttrs))}" if mttrs else ""
    return f"incidents: {len(incidents)}, {len(done)} recovered{mean}"


def _cause(incident: Mapping[str, Any]) -> str:
    error = str(incident.get("error") or "").strip().splitlines()
    said = error[0] if error else ""
    if len(said) > _ERROR_CHARS:
        said = said[: _ERROR_CHARS - 1] + "…"
    rank = incident.get("rank")
    whose = f"rank {rank}" if isinstance(rank, int) and rank >= 0 else "the job"
    return f"{incident.get('kind')} of {whose}" + (f" ({said})" if said else "")


def _outcome(found: Round, *, world_size: int, restarts: int, max_restarts: int | None) -> str:
    status = found.status
    if status == "recovered" and found.restart is not None:
        who = "the rank" if world_size == 1 else f"all {world_size} ranks"
        later = f" {duration(found.after_s)} later" if found.after_s is not None else ""
        return f"{who} started again{later} (restart {found.restart})"
    if status == "failed":
        if max_restarts == 0:
            return "not restarted: the job failed (--max-restarts 0)"
        used_up = max_restarts is not None and restarts >= max_restarts
        return "not restarted: the job failed" + (
            f" (--max-restarts {max_restarts} used up)" if used_up else "")
    if status == "open":
        return "being handled"
    return status


def restart_lines(incidents: Sequence[Mapping[str, Any]], *, started_at: float, world_size: int,
                  max_restarts: int | None) -> list[str]:
    """``whole-group restarts: N``, then one entry per recovery round: when, its faults, and what
    became of them (every rank started again, or the job failed)."""
    found = rounds(incidents)
    restarts = sum(1 for r in found if r.restart is not None)
    bound = f" (at most {max_restarts}: --max-restarts)" if max_restarts is not None else ""
    lines = [f"  whole-group restarts: {restarts}{bound}"]
    for r in found:
        ids = ", ".join(f"#{i.get('id')}" for i in r.incidents)
        causes = ", ".join(_cause(i) for i in r.incidents)
        at = duration(max(0.0, r.t - started_at)) if started_at else "?"
        outcome = _outcome(r, world_size=world_size, restarts=restarts, max_restarts=max_restarts)
        lines.extend(wrapped(f"{ids} at {at}: {causes}; {outcome}", "    ", "      "))
    return lines


def no_step_summary(job: Mapping[str, Any], incidents: Sequence[Mapping[str, Any]], *,
                    wall_s: float | None, job_dir: str | Path) -> list[str]:
    """The end summary of a job whose script has no steps: state and wall time, the no-steps note,
    the restarts with their causes, the incident count, and where the details are."""
    config = job.get("config") or {}
    max_restarts = config.get("max_restarts")
    head = f"undying: job {job.get('job_id')} {job.get('state', '?')}: wall time {duration(wall_s)}"
    lines = wrapped(head, "", "  ")
    lines.extend(wrapped(NO_STEPS, "  ", "    "))
    lines.extend(restart_lines(incidents, started_at=float(job.get("started_at") or 0.0),
                               world_size=int(job.get("world_size") or 1),
                               max_restarts=int(max_restarts) if max_restarts is not None
                               else None))
    lines.append("  " + incidents_line(incidents))
    for other in (i for i in incidents if not int(i.get("recovery") or 0)):  # (of no round)
        lines.extend(wrapped(f"#{other.get('id')} {_cause(other)}: {other.get('action') or '-'}, "
                             f"{other.get('status')}", "    ", "      "))
    lines.extend(wrapped(f"details: undying status --job-dir {job_dir}", "  ", "    "))
    return lines
