"""The view of a job that ``undying status`` prints and ``--watch`` redraws: one ``view()`` for
both.

Header, progress, goodput, checkpoints, trace switch, step time, ranks and
incidents, as rich renderables, from the status dict the manager's API (or the
job's log) gives; the web page shows the same facts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from undying.cli.restarts import NO_STEPS, restart_lines, wrapped
from undying.cli.summary import LOSS_WORDS, duration, goodput_line, verification_line

__all__ = ["TERMINAL", "render", "view", "slow_finding"]

# Job states after which nothing changes any more (JobState.terminal, as strings from the API).
TERMINAL = frozenset({"succeeded", "failed", "stopped", "preempted"})

_SPARKS = "▁▂▃▄▅▆▇█"



def render(status: dict[str, Any], console: Console) -> None:
    console.print(view(status))


def view(status: dict[str, Any], note: str = "", *, bar: bool = False) -> Group:
    """The job as rich renderables: header, progress, goodput, trace switch, step time, ranks,
    incidents.

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
    goodput = status.get("goodput") or {}
    steps = status.get("has_steps", True)
    if not steps:  # (a torchrun script: its time and restarts, never "step 0" or "0.0%")
        parts.extend(Text(line) for line in _no_step_lines(status, goodput))
    if progress and steps:
        parts.extend(_progress_lines(progress, bar=bar))
    if goodput.get("ratio") is not None and steps:
        parts.append(Text(goodput_line(goodput)))
    parts.extend(_checkpoint_lines(status))
    if status.get("verification"):
        parts.append(Text("  " + verification_line(status["verification"])))
    if status.get("regroup"):
        parts.append(_regroup_line(status["regroup"]))
    for mark in status.get("hosts_out") or []:  # no new ranks there until `undying undrain HOST`
        line = (f"  host {mark.get('host')}: {mark.get('state')} by {mark.get('by')}: "
                f"{mark.get('reason')}")
        # manager.placement.hosts: it requalifies only on verified steps.
        if mark.get("state") == "quarantined":
            line += (f" (requalifying: {mark.get('passes', 0)}/{mark.get('needed', '?')} verified, "
                     f"with --verify-every; or `undying undrain {mark.get('host')}`)")
            # Kept under the quarantine: drained once it clears.
            if isinstance(under := mark.get("drained"), dict):
                line += f"; also drained by {under.get('by')}: {under.get('reason')}"
        parts.append(Text(line))
    for parked in status.get("standbys") or []:  # a lost or moved node goes to one of these
        heard = max(0.0, time.time() - float(parked.get("last_heard") or 0.0))
        parts.append(Text(f"  standby on {parked.get('host')} (agent pid "
                          f"{parked.get('agent_pid')}): {parked.get('spares_ready', 0)} warm "
                          f"spare(s), last heard {heard:.0f}s ago"))
    if "trace" in status:
        parts.append(_trace_line(status.get("trace") or {}))
    if status.get("step_times"):
        parts.append(_step_time_line(status["step_times"]))
    parts.append(_ranks_table(status.get("ranks") or [], steps=steps))
    for run in status.get("earlier_runs") or []:
        parts.append(Text(f"  earlier launch in this job dir: {run['log']}: {run['state']}, "
                          f"last step {run['step']}, {run['events']} events, "
                          f"{run.get('incidents', 0)} incident(s)"))
    incidents = status.get("incidents") or []
    if not incidents:
        parts.append(Text("no incidents"))
        return Group(*parts)
    parts.append(_incidents_table(incidents, steps=steps))
    for i in incidents:
        parts.extend(_incident_details(i, goodput))
    for i in incidents:
        if i.get("traceback"):
            parts.append(Text.assemble(
                (f"incident {i['id']}", "bold"), f" traceback (rank {i['rank']}):\n",
                str(i["traceback"]),
            ))
    return Group(*parts)


def _progress_lines(progress: dict[str, Any], *, bar: bool) -> list[RenderableType]:
    """Step of total, epoch, rate and ETA; the last values given to ``step.log``; with ``bar``, a
    bar."""
    total = progress.get("total_steps")
    step = progress.get("step") or 0
    words = [f"step {step}" + (f" of {total}" if total is not None else "")
             + (f" ({progress['fraction']:.0%})" if progress.get("fraction") is not None else "")]
    if progress.get("epoch") is not None:
        of = f" of {progress['epochs']}" if progress.get("epochs") else ""
        words.append(f"epoch {progress['epoch'] + 1}" + of)
    if progress.get("steps_per_s"):
        words.append(f"{progress['steps_per_s']:.3g} steps/s")
    if progress.get("samples_per_s"):
        words.append(f"{progress['samples_per_s']:.4g} samples/s")
    if progress.get("eta_s") is not None:
        words.append(f"ETA {duration(progress['eta_s'])}")
    lines: list[RenderableType] = [Text("progress: " + ", ".join(words))]
    if bar and total:
        # (a bar alone leaves its line open: the next line would run on)
        grid = Table.grid(padding=(0, 1))
        grid.add_row(ProgressBar(total=float(total), completed=float(min(step, total)), width=40),
                     Text(f"{min(step, total)}/{total}"))
        lines.append(grid)
    values = progress.get("values") or {}
    if values:
        shown = ", ".join(f"{k} {v:.6g}" for k, v in sorted(values.items()))
        lines.append(Text(f"  last values (step {progress.get('values_step')}, mean over ranks): "
                          f"{shown}"))
    return lines


def _checkpoint_lines(status: dict[str, Any]) -> list[Text]:
    """Failing saves, and what a resume from the checkpoint that stands re-runs (finding 6 of
    #14)."""
    lines = []
    health = (status.get("checkpoints") or {}).get("health") or {}
    if health.get("failing"):
        lines.append(Text(f"  checkpoint saves failing since step "
                          f"{health.get('last_failed_step')}: "
                          f"{health.get('last_os_error') or health.get('last_error')}",
                          style="red"))
    reruns = (status.get("preemption") or {}).get("resume_reruns")
    if reruns:
        lines.append(Text(f"  a resume re-runs {reruns} step(s): the checkpoint that stands is "
                          "older than the stop step", style="yellow"))
    return lines


def _no_step_lines(status: dict[str, Any], goodput: dict[str, Any]) -> list[str]:
    """A script with no steps: its time so far (or in all) and its whole-group restarts, why."""
    running = status.get("live") and status.get("state") not in TERMINAL
    time_words = f"{'running for' if running else 'wall time'} {duration(goodput.get('wall_s'))}"
    lines = wrapped(f"{time_words}; {NO_STEPS}", "  ", "    ")
    max_restarts = status.get("max_restarts")
    return lines + restart_lines(status.get("incidents") or [],
                                 started_at=float(status.get("started_at") or 0.0),
                                 world_size=int(status.get("world_size") or 1),
                                 max_restarts=int(max_restarts) if max_restarts is not None
                                 else None)


def _header(status: dict[str, Any]) -> Text:
    started = status.get("started_at")
    live = status.get("live")
    running = live and status.get("state") not in TERMINAL
    age = f", running {time.time() - started:.0f}s" if started and running else ""
    slurm = status.get("slurm") if isinstance(status.get("slurm"), dict) else None
    # (the launch's Slurm job, and how many times Slurm requeued it: SLURM_RESTART_COUNT)
    under = "" if slurm is None else f", Slurm job {slurm.get('job_id')}" + (
        f" requeued {slurm.get('restarts')}x" if slurm.get("restarts") else "")
    step = f", step {status.get('step')}" if status.get("has_steps", True) else ""
    return Text.assemble(
        (f"job {status.get('job_id')}", "bold"),
        f": {status.get('state')}, generation {status.get('generation')}, "
        f"{status.get('world_size')} ranks{step}{age}{under}",
        "" if live else " (from the event log; the launcher is not running)",
    )


def _regroup_line(regroup: dict[str, Any]) -> Text:
    """The job moving to another set of nodes: why, and what it waits for."""
    line = Text.assemble(("regrouping", "yellow"), f": {regroup.get('why')}")
    if regroup.get("waiting_for_nodes_since"):
        waited = time.time() - float(regroup["waiting_for_nodes_since"])
        line.append(f"\n  the state is saved in {regroup.get('checkpoint')}; waiting "
                    f"{waited:.0f}s for nodes to join (`undying run --node-rank I --manager ...`)")
    else:
        line.append(f"\n  ranks {regroup.get('members')} save their newest step; left so far: "
                    f"{regroup.get('left')}")
    return line


def _trace_line(trace: dict[str, Any]) -> Text:
    def switch(name: str) -> tuple[str, str]:
        return ("on", "green") if trace.get(name) else ("off", "dim")

    line = Text.assemble("trace: step markers ", switch("step"), ", comm markers ", switch("comm"))
    if trace.get("by"):
        when = (f" at {time.strftime('%H:%M:%S', time.localtime(trace['t']))}"
                if trace.get("t") else "")
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
    spark = "".join(_SPARKS[min(len(_SPARKS) - 1, int((t - low) / spread * len(_SPARKS)))]
                    for t in times)
    return Text.assemble(
        f"step time: {last:.3f}s at step {last_step}, mean {sum(times) / len(times):.3f}s "
        f"over the last {len(times)} (min {low:.3f}s, max {high:.3f}s) ",
        (spark, "cyan"),
    )


def _ranks_table(ranks: Sequence[dict[str, Any]], *, steps: bool = True) -> Table:
    # The phase column appears when the manager reports phases, so older output stays as it was.
    keys = ["rank", "node", "state", *(["phase"] if any("phase" in r for r in ranks) else []),
            *(["step"] if steps else []), "generation", "pid", "restarts"]
    headers = {"generation": "gen", "restarts": "restarts"}
    table = Table(title="ranks")
    for k in keys:
        table.add_column(headers.get(k, k), overflow="fold")
    for r in ranks:
        table.add_row(*(Text(str(r.get(k, "-"))) for k in keys))
    return table


def _incidents_table(incidents: Sequence[dict[str, Any]], *, steps: bool = True) -> Table:
    """One row per incident, short cells only; its timeline and findings follow on lines of their
    own. ``steps`` False: the script has none, and the step cell says so ("-")."""
    table = Table(title="incidents")
    for header in ("#", "kind", "rank", "step", "action", "status", "MTTR s"):
        table.add_column(header, overflow="fold")
    for i in incidents:
        mttr = "-" if i.get("mttr_s") is None else f"{i['mttr_s']:.3f}"
        cells = (i["id"], i["kind"], i["rank"], i["step"] if steps else "-",
                 i.get("action") or "-", i["status"], mttr)
        table.add_row(*(Text(str(c)) for c in cells))
    return table


def _incident_details(incident: dict[str, Any], goodput: dict[str, Any]) -> list[Text]:
    """An incident's lines under the table: its finding (a slow rank's), error, timeline and what
    it cost."""
    lines = []
    head = f"  #{incident['id']} "
    finding = slow_finding(incident)
    if finding:
        lines.append(Text(head + finding))
    # (a finding's error is its sentence: said above in short)
    if incident.get("error") and not finding:
        lines.append(Text(head + "error: " + str(incident["error"]).strip().splitlines()[-1]))
    phases = incident.get("phases") or {}
    if phases:
        timeline = ", ".join(f"{k} {float(v):.3f}" for k, v in phases.items())
        lines.append(Text(head + f"timeline (s since fault): {timeline}"))
    spent = next((g for g in goodput.get("incidents") or [] if g.get("id") == incident.get("id")),
                 None)
    if spent:
        cost = ", ".join(f"{LOSS_WORDS.get(k[:-2], k[:-2])} {duration(v)}"
                         for k, v in spent.items() if k.endswith("_s") and v >= 0.005)
        if cost:
            lines.append(Text(head + f"cost in wall time: {cost}"))
    return lines


def slow_finding(incident: dict[str, Any]) -> str:
    """A slow rank's or node's finding in words: which rank, since which step, by how much, in
    which phase."""
    if incident.get("kind") not in ("slow_rank", "slow_node"):
        return ""
    detail = incident.get("detail") or {}
    who = (f"node {detail['node']} (ranks {', '.join(map(str, detail.get('ranks') or []))})"
           if incident["kind"] == "slow_node" and "node" in detail
           else f"rank {detail.get('rank', incident['rank'])}")
    since = detail.get("since_step", incident.get("step"))
    words = f"{who} slower since step {since}"
    if detail.get("excess_s") is not None:
        words += f", +{float(detail['excess_s']) * 1000:.1f} ms a step"
    if detail.get("factor"):
        words += f" (x{float(detail['factor']):.2f})"
    if detail.get("phase"):
        words += f" in {detail['phase']}"
    return words
