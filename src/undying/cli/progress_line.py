"""The launcher's progress line, in words, from the manager's status (``Manager.status()``).

Pure: the figures are the ones the manager already keeps and ``/api/status``
serves (``progress``: step of total, rate, ETA; ``goodput``; the incidents, and
for a script without the step API its whole-group restarts, ``jobfiles.restarts``).
Two forms, each one line of at most ``WIDTH`` columns:

- ``live_line``: on a terminal, rewritten in place (``cli/progress_show.py``):
  step of total, rate, ETA, goodput, incidents so far and the status page's URL;
- ``periodic_line``: when the launcher's stderr is not a terminal, every
  ``--progress-every`` seconds, after the log's ``[undying HH:MM:SS]``.

When the figures do not fit, the least needed go first (the percentage, then
the rate: the ETA is measured from it); the step, the ETA and the incidents stay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from undying.config import check_progress_every
from undying.errors import UsageError
from undying.inputs import quoted
from undying.jobfiles.restarts import rounds

__all__ = ["WIDTH", "live_line", "periodic_line", "progress_every_arg", "fit", "clock"]

WIDTH = 80
_SEPARATOR = ", "
# Figures in the order they are shown; a lower ``drop`` goes first when the line is too wide.
_DROP_PERCENT, _DROP_RATE, _DROP_GOODPUT, _DROP_URL = 1, 2, 3, 4
_KEEP = 99


def progress_every_arg(text: str) -> float:
    """argparse ``type=`` for ``--progress-every``: seconds, 0 (off) to a day, or one line."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--progress-every expects seconds, 0 (off) to a day, got "
                         f"{quoted(text)}") from None
    return check_progress_every(value)


def clock(seconds: float | None) -> str:
    """Seconds as a clock, as tqdm shows them: 0:07, 12:05, 3:04:05 (``-`` for none)."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def fit(fields: Sequence[tuple[int, str]], width: int) -> str:
    """The fields joined, dropping the lowest ``drop`` first until the line fits ``width``; one
    that still does not fit is cut, with ``…``."""
    kept = [(drop, text) for drop, text in fields if text]
    line = _SEPARATOR.join(text for _, text in kept)
    while len(line) > width and any(drop < _KEEP for drop, _ in kept):
        lowest = min(drop for drop, _ in kept)
        kept = [(drop, text) for drop, text in kept if drop != lowest]
        line = _SEPARATOR.join(text for _, text in kept)
    return line if len(line) <= width else line[: max(0, width - 1)] + "…"


def live_line(status: Mapping[str, Any], *, url: str, now: float, width: int = WIDTH) -> str:
    """The terminal's line: where the job is, how fast, how long still, its goodput, its
    incidents, and the status page's URL."""
    return fit([*_figures(status, now=now), (_DROP_URL, _page(url))], width)


def periodic_line(status: Mapping[str, Any], *, now: float, width: int) -> str:
    """The line written every ``--progress-every`` seconds where stderr is no terminal (``width``:
    what the log's prefix leaves); the status page's URL is the banner's."""
    return fit(_figures(status, now=now), width)


def _figures(status: Mapping[str, Any], *, now: float) -> list[tuple[int, str]]:
    state = str(status.get("state") or "")
    incidents = list(status.get("incidents") or [])
    head = [(_KEEP, state)] if state and state != "running" else []
    if not status.get("has_steps", True):
        return [*head, *_no_step_figures(status, incidents, now=now)]
    progress = status.get("progress") or {}
    step = int(progress.get("step") or status.get("step") or 0)
    total = progress.get("total_steps")
    fraction = progress.get("fraction")
    rate = progress.get("steps_per_s")
    ratio = (status.get("goodput") or {}).get("ratio")
    eta = progress.get("eta_s")
    return [
        *head,
        (_KEEP, f"step {step}/{total}" if total is not None else f"step {step}"),
        (_DROP_PERCENT, f"{fraction:.0%}" if fraction is not None and total else ""),
        (_DROP_RATE, _rate(rate)),
        (_KEEP, f"ETA {clock(eta)}" if eta is not None else ""),
        (_DROP_GOODPUT, f"goodput {ratio:.0%}" if ratio is not None and step else ""),
        (_KEEP, _incidents(incidents)),
    ]


def _no_step_figures(status: Mapping[str, Any], incidents: Sequence[Mapping[str, Any]], *,
                     now: float) -> list[tuple[int, str]]:
    """A script without the step API: its time so far and its whole-group restarts, with the
    newest one's cause."""
    started = status.get("started_at")
    elapsed = max(0.0, now - float(started)) if started else None
    found = rounds(incidents)
    restarts = [r for r in found if r.restart is not None]
    said = f"{len(restarts)} restart{'s' if len(restarts) != 1 else ''}"
    if found:
        newest = found[-1]
        causes = ", ".join(_cause(i) for i in newest.incidents)
        said += f" (last: {causes})" if len(found) > 1 else f" ({causes})"
    return [(_KEEP, f"elapsed {clock(elapsed)}"), (_KEEP, said), (_DROP_GOODPUT,
                                                                  _incidents(incidents))]


def _cause(incident: Mapping[str, Any]) -> str:
    rank = incident.get("rank")
    whose = f"rank {rank}" if isinstance(rank, int) and rank >= 0 else "the job"
    return f"{incident.get('kind')} of {whose}"


def _rate(steps_per_s: float | None) -> str:
    """Steps per second, or seconds per step when a step takes longer, as tqdm writes them (it/s,
    s/it)."""
    if not steps_per_s or steps_per_s <= 0:
        return ""
    if steps_per_s >= 1:
        return f"{_figure(steps_per_s)} it/s"
    return f"{_figure(1 / steps_per_s)} s/it"


def _figure(value: float) -> str:
    """Two significant digits below 10 (2.5, 0.31), whole above (12, 1234): a figure to glance
    at."""
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def _incidents(incidents: Sequence[Mapping[str, Any]]) -> str:
    if not incidents:
        return "0 incidents"
    open_ = sum(1 for i in incidents if i.get("status") == "open")
    said = f"{len(incidents)} incident{'s' if len(incidents) != 1 else ''}"
    return said + (f" ({open_} open)" if open_ else "")


def _page(url: str) -> str:
    """The status page's URL (its root: without the trailing slash a browser adds)."""
    return url.rstrip("/")
