"""``undying diagnose TRACE_DIR``: which rank or node slowed the job, from its trace files.

Reads the job's per-rank trace files (any rank folder, job folder or trace dir),
prints the findings in words and the ranks ranked by how far each stands from
the others, and writes a self-contained HTML report with plots. The method is
the manager's own (``undying.trace.detect``), run over the recorded steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from undying.errors import UsageError

if TYPE_CHECKING:
    from undying.trace.analyze import TraceTable

__all__ = ["add_parser", "run"]

_DESCRIPTION = """\
Diagnose a job from its trace files: find the slow rank or node and say which
phase is slow (compute, data loading or checkpoint stalls), by how much (ms per
step, and as a factor of the others' phase and of the step before) and since
which step: the manager's method over windows of steps, then the start and the
size found to the step from every step's phases.

TRACE_DIR is the job's trace dir (by default <job dir>/traces; the newest job in
it is read), one job's folder in it (<trace dir>/<job id>), or a rank folder.
The ranks of a synchronous job all take as long per step as the slowest, so the
ranks are compared phase by phase: the slow rank computes longest and waits
least in the collectives (comm markers show that: undying trace on --comm).

Prints the findings and a table of the ranks, slowest first, and writes an HTML
report (one file, plots embedded) to --html; the plots need the plots extra
(pip install 'undying[plots]': matplotlib), and without it the report has the
tables and findings and says so. Exit 0 whether or not something is slow; 2
for a path that holds no traces.
"""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--threshold must be a number such as 0.08, got {text!r}") from None
    if not 0 < value < 1:
        raise UsageError(f"--threshold is a fraction of the step time, between 0 and 1 (e.g. "
                         f"0.08), got {value}")
    return value


def _positive(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{name} must be a whole number, got {text!r}") from None
        if value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
        return value

    return parse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diagnose",
        help="find slow ranks and nodes in a job's trace files; write an HTML report",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace_dir", metavar="TRACE_DIR", help="trace dir, job folder or rank folder")
    p.add_argument("--html", metavar="PATH",
                   help="where to write the HTML report (default: TRACE_DIR/report.html)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (findings, ranks, what was read) instead of the "
                   "tables")
    p.add_argument("--threshold", type=_fraction, default=0.08, metavar="F",
                   help="the bar, as a fraction of the median step time: a rank slower than the "
                        "others by more than this in a phase, window after window, is reported "
                        "(default 0.08)")
    p.add_argument("--window", type=_positive("--window"), default=10, metavar="N",
                   help="steps per window compared across ranks (default 10, as online)")
    p.add_argument("--patience", type=_positive("--patience"), default=2, metavar="N",
                   help="windows at twice the bar before a finding; more at less (default 2)")
    p.set_defaults(func=run)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _wrapped(console: Console, text: str, first: str = "", rest: str = "  ") -> None:
    """``text`` wrapped at words to the console's width (80 when piped), never cut."""
    width = max(40, console.width)
    for line in textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest,
                              break_on_hyphens=False, break_long_words=False):
        console.print(Text(line), soft_wrap=True)


def _path_line(console: Console, label: str, path: Path | str) -> None:
    """``label`` and ``path`` on one line when they fit, else the path alone on its own line
    (a path broken in two cannot be copied)."""
    if len(label) + len(str(path)) <= console.width:
        console.print(Text(f"{label}{path}"), soft_wrap=True)
    else:
        if label:
            console.print(Text(label.rstrip()))
        console.print(Text(str(path)), soft_wrap=True)


def _ranks_table(table: TraceTable) -> Table:
    """The ranks, slowest first, in ms per step: ten short columns, 80 columns wide at most."""
    t = Table(title="ranks, slowest first (ms per step)", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("rank", "node", "steps", "step", "compute", "comm", "data", "ckpt", "score",
                "worst"):  # fmt: skip
        left = col in ("node", "worst")
        t.add_column(col, justify="left" if left else "right", no_wrap=not left,
                     overflow="fold")
    flagged = {r for f in table.findings for r in f.ranks}
    for r in table.ranks:
        t.add_row(
            str(r.rank), r.node or "-", str(r.steps), _ms(r.step), _ms(r.compute), _ms(r.comm),
            _ms(r.data), _ms(r.ckpt), f"{r.score:+.1%}", r.worst or "-",
            style="red" if r.rank in flagged else None,
        )  # fmt: skip
    return t


def run(args: argparse.Namespace) -> int:
    from undying.trace.analyze import load_trace  # matplotlib and friends only when diagnosing
    from undying.trace.report import PLOTS_HINT, plots_available, write_report

    trace_dir = Path(args.trace_dir)
    table = load_trace(trace_dir, window=args.window, threshold=args.threshold,
                       patience=args.patience)
    beside = trace_dir if trace_dir.is_dir() else table.path
    html_path = Path(args.html) if args.html else beside / "report.html"
    try:
        write_report(table, table.findings, html_path)
    except OSError as e:
        raise UsageError(f"cannot write the report to {html_path} ({e.strerror or e}); pass "
                         "--html PATH") from e
    if args.json:
        sys.stdout.write(json.dumps(table.to_dict() | {"html": str(html_path),
                                                        "plots": plots_available()}) + "\n")
        return 0
    console = Console(file=sys.stdout, highlight=False)
    steps = sum(len(v) for v in table.steps.values())
    console.print(
        f"[bold]job {table.job}[/bold]: {len(table.ranks)} ranks, {steps} rank-steps, "
        f"{table.records} records in {table.files} files; comm markers "
        f"{'on' if table.comm_known else 'off'}"
    )
    _path_line(console, "read from ", table.path)
    if table.other_jobs:
        _wrapped(console, "other jobs here, not read (pass one's folder): "
                 f"{', '.join(table.other_jobs)}")
    if table.bad_lines:
        console.print(f"{table.bad_lines} unreadable lines skipped (a file cut short or still "
                      "being written)")
    if table.skipped:
        _wrapped(console, f"skipped, not trace files: {', '.join(table.skipped[:5])}"
                 + (f" and {len(table.skipped) - 5} more" if len(table.skipped) > 5 else ""))
    if table.findings:
        console.print("[bold red]findings[/bold red]")
        for f in table.findings:
            _wrapped(console, f.describe(), "  - ", "    ")
    else:
        console.print("[green]no slow rank or node[/green]: every rank kept within "
                      f"{table.threshold:.0%} of the step time of the others")
    console.print(_ranks_table(table))
    outliers = [f"rank {r.rank}: " + ", ".join(f"{k} {n}"
                                               for k, n in sorted(r.outlier_counts.items()))
                for r in table.ranks if r.outlier_counts]
    if outliers:
        _wrapped(console, "outliers (steps far above the rank's usual wait or stall): "
                 + "; ".join(outliers))
    _path_line(console, "HTML report: ", html_path)
    if not plots_available():
        _wrapped(console, f"no plots in it: matplotlib is not installed ({PLOTS_HINT})")
    return 0
