"""The HTML diagnosis report: one self-contained file people can open, mail or attach to a ticket.

No external assets: the CSS is inline and the plots are PNGs (matplotlib,
Agg backend, so no display is needed) embedded as base64 data URIs; the file
works offline, from an artifact store, or as an email attachment. matplotlib is
an optional extra (``undying[plots]``): without it the report has every table
and finding, no plots, and says how to get them (``PLOTS_HINT``).

What it shows, in the order someone chasing a slow job reads it:

1. the findings, each in a sentence and with the numbers that convinced the
   detector;
2. the ranks ranked by how far each stands from the others;
3. a rank x step heat map of every phase measured: step time (when the job
   got slow), forward pass, compute, collective wait, data-loader wait and
   checkpoint stall (who made it slow, and in what), the findings' onsets marked;
4. per rank, compute against collective wait (stacked with data and
   checkpoint time): the slow rank computes longest and waits least;
5. data-loader waits and checkpoint stalls over the steps, the outliers marked.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from undying.trace.analyze import TraceTable
from undying.trace.detect import Finding

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["write_report", "render_report", "plots_available", "MAX_HEATMAP_COLUMNS",
           "PLOTS_HINT"]

# What to install for the plots (matplotlib, with numpy and pillow), said where they are missing.
PLOTS_HINT = "pip install 'undying[plots]'"

# A heat map wider than this many steps is drawn from bins of consecutive steps (their median).
MAX_HEATMAP_COLUMNS = 1500

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto;
       max-width: 1100px; color: #1d1d1f; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: .2em; }
h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
.meta { color: #666; }
table { border-collapse: collapse; margin: .6em 0; font-variant-numeric: tabular-nums; }
th, td { padding: .25em .7em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f6f6f6; } td.l, th.l { text-align: left; }
.finding { border-left: 4px solid #d33; background: #fff5f5; padding: .5em .9em; margin: .6em 0; }
.finding p { margin: .2em 0 .4em; font-weight: 600; }
.none { border-left: 4px solid #2a2; background: #f4fbf4; padding: .5em .9em; }
img { max-width: 100%; } .note { color: #666; font-size: .92em; }
tr.top td { background: #fff0f0; }
"""


def _fig_png(fig: Figure) -> str:
    """The figure as a data URI (PNG, base64)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _esc(value: Any) -> str:
    return html.escape(str(value))


# Every phase the markers measure, in the order a reader wants them: the heat maps drawn.
PHASE_PLOTS = (
    ("step", "step time"),
    ("fp", "forward pass"),
    ("compute", "compute (step less data, checkpoint and collective wait)"),
    ("comm", "collective wait"),
    ("data", "data-loader wait"),
    ("ckpt", "checkpoint stall (the training loop's part of a save)"),
)


def _heatmap(
    table: TraceTable, attr: str, title: str, marks: list[int] | None = None
) -> str | None:
    """A rank x step image of one phase (seconds), binned when there are many steps; None when
    never measured.

    ``marks``: steps to draw a dashed line at (where findings say a slowdown began).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    ranks = sorted(r for r, rows in table.steps.items() if rows)
    if not ranks:
        return None
    first = min(table.steps[r][0].step for r in ranks)
    last = max(table.steps[r][-1].step for r in ranks)
    width = last - first + 1
    grid = np.full((len(ranks), width), np.nan)
    for i, r in enumerate(ranks):
        for row in table.steps[r]:
            value = getattr(row.phases, attr)
            if value is not None:
                grid[i, row.step - first] = value
    if np.all(np.isnan(grid)) or not np.any(grid[np.isfinite(grid)] > 0):
        return None  # a phase the job never had (no comm markers, no checkpoint): nothing to show
    per_bin = max(1, math.ceil(width / MAX_HEATMAP_COLUMNS))
    if per_bin > 1:
        cols = math.ceil(width / per_bin)
        padded = np.full((len(ranks), cols * per_bin), np.nan)
        padded[:, :width] = grid
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN bins stay NaN
                grid = np.nanmedian(padded.reshape(len(ranks), cols, per_bin), axis=2)
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.32 * len(ranks)))
    finite = grid[np.isfinite(grid)]
    # One freak step must not wash it out.
    vmax = float(np.percentile(finite, 99)) if finite.size else None
    im = ax.imshow(
        grid * 1000, aspect="auto", interpolation="nearest", cmap="magma",
        extent=(first - 0.5, last + 0.5, len(ranks) - 0.5, -0.5),
        vmin=float(np.min(finite)) * 1000 if finite.size else None,
        vmax=vmax * 1000 if vmax else None,
    )  # fmt: skip
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_ylabel("rank")
    ax.set_xlabel("step" + (f" (bins of {per_bin} steps, median)" if per_bin > 1 else ""))
    ax.set_title(title)
    for step in marks or []:
        ax.axvline(step - 0.5, color="#2aa1ff", linestyle="--", linewidth=1.2)
    fig.colorbar(im, ax=ax, label="ms", pad=0.01)
    uri = _fig_png(fig)
    plt.close(fig)
    return uri


def _stacked(table: TraceTable) -> str | None:
    """Per rank: compute, collective wait, data wait and checkpoint stall per step (robust
    means)."""
    import matplotlib.pyplot as plt

    rows = sorted(table.ranks, key=lambda r: r.rank)
    if not rows:
        return None
    labels = [str(r.rank) for r in rows]
    parts = [
        ("compute", [r.compute for r in rows], "#3b6fb6"),
        ("collective wait", [r.comm or 0.0 for r in rows], "#e8a33d"),
        ("data wait", [r.data for r in rows], "#5aa469"),
        ("checkpoint stall", [r.ckpt for r in rows], "#c0504d"),
    ]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(rows) + 2), 3.6))
    bottom = [0.0] * len(rows)
    for name, values, color in parts:
        ms = [v * 1000 for v in values]
        ax.bar(labels, ms, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, ms, strict=True)]
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per step")
    title = "compute vs collective wait per rank"
    if not table.comm_known:
        title += " (comm markers off: compute includes the wait)"
    ax.set_title(title)
    ax.legend(fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    uri = _fig_png(fig)
    plt.close(fig)
    return uri


def _outlier_plot(table: TraceTable) -> str | None:
    """Data waits and checkpoint stalls over the steps, each rank a colour, outliers ringed."""
    import matplotlib.pyplot as plt

    kinds = [("data", "data-loader wait"), ("ckpt", "checkpoint stall")]
    have = [(k, t) for k, t in kinds
            if any(getattr(s.phases, k) > 0 for rows in table.steps.values() for s in rows)]
    if not have:
        return None
    fig, axes = plt.subplots(len(have), 1, figsize=(10, 2.6 * len(have)), squeeze=False)
    outliers = {r.rank: r.outliers for r in table.ranks}
    for ax, (kind, title) in zip(axes[:, 0], have, strict=True):
        for rank in sorted(table.steps):
            rows = [s for s in table.steps[rank] if getattr(s.phases, kind) > 0]
            if not rows:
                continue
            pts = ax.scatter([s.step for s in rows], [getattr(s.phases, kind) * 1000 for s in rows],
                             s=4, label=f"rank {rank}", alpha=0.6)
            marked = set(outliers.get(rank, {}).get(kind, []))
            hot = [s for s in rows if s.step in marked]
            if hot:
                ax.scatter([s.step for s in hot], [getattr(s.phases, kind) * 1000 for s in hot],
                           s=60, facecolors="none", edgecolors=pts.get_facecolor()[0],
                           linewidths=1.5)
        ax.set_ylabel("ms")
        ax.margins(y=0.15)  # room for the rings at the top
        ax.set_title(title + " per step (ringed: outliers)")
        ax.legend(fontsize=7, ncols=8, loc="upper left")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    uri = _fig_png(fig)
    plt.close(fig)
    return uri


def _finding_html(f: Finding) -> str:
    ev = f.evidence
    rows = [
        ("judged by", ev.get("basis")),
        ("its value, ms per step", _ms(ev.get("value"))),
        ("the others' median, ms", _ms(ev.get("others_median"))),
        ("since step", f.since_step),
        ("excess, ms per step", _ms(f.excess_s)),
        ("its steps over the job's before",
         "-" if f.step_factor is None else f"{f.step_factor:.2f}x"),
        ("bar (threshold x step), ms", _ms(ev.get("bar"))),
        ("step time, ms", _ms(ev.get("step"))),
    ]
    if ev.get("comm") is not None:
        rows += [("its collective wait, ms", _ms(ev.get("comm"))),
                 ("the others' wait, ms", _ms(ev.get("others_comm")))]
    if "longest" in ev:
        rows.append(("longest of all ranks in every slow window",
                     "yes" if ev["longest"] else "no"))
    if "shortest_comm" in ev:
        rows.append(("shortest collective wait in every slow window",
                     "yes" if ev["shortest_comm"] else "no"))
    rows += [("windows", ev.get("windows")), ("evidence (bars)", ev.get("evidence"))]
    if ev.get("per_rank_excess"):
        rows.append(("excess per rank, ms", ", ".join(
            f"{r}: {_ms(x)}" for r, x in ev["per_rank_excess"].items())))
    cells = "".join(f"<tr><td class=l>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in rows)
    return f"<div class=finding><p>{_esc(f.describe())}</p><table>{cells}</table></div>"


def plots_available() -> bool:
    """Whether matplotlib imports here (the ``plots`` extra is installed)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    return True


def render_report(table: TraceTable, findings: list[Finding]) -> str:
    """The report as one HTML string (see the module doc)."""
    plots = plots_available()
    out: list[str] = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>undying diagnosis: {_esc(table.job)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Diagnosis of job {_esc(table.job)}</h1>",
    ]
    steps = sum(len(v) for v in table.steps.values())
    out.append(
        f"<p class=meta>{_esc(table.path)}: {len(table.ranks)} ranks, {steps} rank-steps from "
        f"{table.records} records in {table.files} files; comm markers "
        f"{'on' if table.comm_known else 'off'}; windows of {table.window} steps, bar "
        f"{table.threshold:.0%} of the step time, patience {table.patience}.</p>"
    )
    notes = []
    if table.bad_lines:
        notes.append(f"{table.bad_lines} unreadable lines skipped (a file cut short, or one "
                     "still being written)")
    if table.rerun_steps:
        notes.append(f"{table.rerun_steps} steps were re-run after a recovery; the later run "
                     "counts")
    if table.skipped:
        notes.append("not trace files, skipped: " + ", ".join(table.skipped[:10]))
    if table.other_jobs:
        notes.append("other jobs in the folder, not read: " + ", ".join(table.other_jobs))
    if notes:
        out.append("<p class=note>" + "<br>".join(_esc(n) for n in notes) + "</p>")

    out.append("<h2>Findings</h2>")
    if findings:
        out.extend(_finding_html(f) for f in findings)
    else:
        out.append("<div class=none>No slow rank or node: every rank kept within the bar of "
                   "the others.</div>")

    out.append("<h2>Ranks, slowest first</h2>")
    head = ["rank", "node", "steps", "step ms", "compute ms", "comm wait ms", "data ms",
            "ckpt ms", "score", "worst phase", "data outliers", "ckpt outliers"]  # fmt: skip
    out.append("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>")
    flagged = {r for f in findings for r in f.ranks}
    for r in table.ranks:
        cls = " class=top" if r.rank in flagged else ""
        cells = [r.rank, r.node, r.steps, _ms(r.step), _ms(r.compute), _ms(r.comm), _ms(r.data),
                 _ms(r.ckpt), f"{r.score:+.1%}", r.worst or "-",
                 r.outlier_counts.get("data", 0), r.outlier_counts.get("ckpt", 0)]
        out.append(f"<tr{cls}>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    out.append("</table><p class=note>score: the rank's largest excess over the others' median "
               "in any phase, as a share of the step time (compute counts only when it also "
               "waits least in the collectives).</p>")

    if not plots:
        out.append(f"<p class=note>No plots: matplotlib is not installed here; {_esc(PLOTS_HINT)} "
                   "and run undying diagnose again to draw them.</p>")
    out.extend(_plots(table, findings) if plots else [])
    out.append("<h2>Data-loader and checkpoint outliers</h2>")
    if plots and (uri := _outlier_plot(table)):
        out.append(f"<p><img alt='data and checkpoint outliers' src='{uri}'></p>")
    listed = [(r.rank, k, steps_, r.outlier_counts.get(k, len(steps_)))
              for r in sorted(table.ranks, key=lambda x: x.rank)
              for k, steps_ in r.outliers.items()]  # fmt: skip
    if listed:
        out.append("<table><tr><th>rank</th><th class=l>kind</th><th>count</th>"
                   "<th class=l>steps</th></tr>")
        for rank, kind, steps_, n in listed:
            word = "data-loader wait" if kind == "data" else "checkpoint stall"
            out.append(f"<tr><td>{rank}</td><td class=l>{word}</td><td>{n}</td>"
                       f"<td class=l>{_esc(', '.join(str(s) for s in steps_))}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p>No data-loader wait or checkpoint stall stood far above its rank's "
                   "usual.</p>")
    out.append("</body></html>\n")
    return "\n".join(out)


def _plots(table: TraceTable, findings: list[Finding]) -> list[str]:
    """The heat map of every phase and the compute-vs-wait bars, as HTML (matplotlib needed)."""
    out = ["<h2>Every phase, rank x step</h2>"]
    marks = sorted({f.since_step for f in findings})
    for attr, title in PHASE_PLOTS:
        if attr == "compute" and not table.comm_known:
            title = "compute (comm markers off: it includes the wait for the slowest rank)"
        uri = _heatmap(table, attr, title, marks)
        if uri:
            out.append(f"<p><img alt='{_esc(attr)}: {_esc(title)} heat map' src='{uri}'></p>")
    if marks:
        out.append("<p class=note>Dashed lines: the step each finding says the slowdown began.</p>")
    out.append("<h2>Compute vs collective wait</h2>")
    uri = _stacked(table)
    if uri:
        out.append(f"<p><img alt='compute vs collective wait' src='{uri}'></p>")
    out.append("<p class=note>In a synchronous job the slow rank computes longest and waits least: "
               "the others wait for it inside the collectives.</p>")
    return out


def write_report(table: TraceTable, findings: list[Finding], path: Path) -> Path:
    """Write the report to ``path`` atomically (a reader never sees half a file); returns the
    path."""
    text = render_report(table, findings)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
