"""``undying diagnose`` as a user runs it: a real process, its exit code, its text, the report it writes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_trace_summary import synth_job, write_trace


def diagnose(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "undying", "diagnose", *argv], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("diag") / "traces"
    write_trace(root, synth_job(ranks=4, steps=120, seed=31, nodes=list("aabb"), slow={2: ("compute", 41, 0.2)}))
    (root / "J" / "README.txt").write_text("a user's file\n")
    return root


def test_prints_findings_and_the_ranked_table_and_writes_the_report(traces: Path) -> None:
    p = diagnose(str(traces))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert re.search(r"rank 2 is compute-slow: 1\.\d\dx the others' compute since step \d+ \(.*comm wait", out)
    assert "ranks, slowest first" in out and "skipped, not trace files: README.txt" in out
    rows = [line for line in out.splitlines() if re.match(r"^\W*\d+\W+[ab]\W+120\W", line)]
    assert [int(re.findall(r"\d+", r)[0]) for r in rows][0] == 2 and len(rows) == 4  # rank 2 first
    report = traces / "report.html"
    assert f"HTML report: {report}" in out
    html = report.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    # a heat map of every phase measured (the forward pass too; this job saves no checkpoint,
    # so none of checkpoint stalls), the stacked bars, the outliers
    assert html.count("<img ") == 7 and html.count("data:image/png;base64,") == 7
    assert "<img alt='fp: forward pass heat map'" in html and "<img alt='ckpt: " not in html


def test_json_and_a_chosen_report_path(traces: Path, tmp_path: Path) -> None:
    p = diagnose(str(traces / "J" / "0"), "--json", "--html", str(tmp_path / "r.html"), "--threshold", "0.1")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["html"] == str(tmp_path / "r.html") and (tmp_path / "r.html").is_file()
    assert data["threshold"] == 0.1 and data["job"] == "J"
    assert [(f["kind"], f["rank"], f["phase"]) for f in data["findings"]] == [("slow_rank", 2, "compute")]
    assert data["ranks"][0]["rank"] == 2 and data["skipped_files"] == ["README.txt"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/missing"], "missing does not exist: pass the trace dir"),
        (["{tmp}"], "no trace files under"),
        (["{tmp}", "--threshold", "8"], "--threshold is a fraction of the step time"),
        (["{tmp}", "--window", "0"], "--window must be at least 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, argv: list[str], message: str) -> None:
    p = diagnose(*(a.format(tmp=tmp_path) for a in argv))
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("undying: error: ") and message in lines[0]


def test_help_says_what_trace_dir_is() -> None:
    p = diagnose("--help")
    assert p.returncode == 0
    assert "TRACE_DIR is the job's trace dir" in p.stdout and "--threshold" in p.stdout


# A sitecustomize that makes `import matplotlib` fail, as on a base install without the plots extra.
NO_MATPLOTLIB = '''\
import sys


class _NoPlots:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoPlots())
'''


def test_without_matplotlib_the_text_report_and_an_html_without_plots_say_how_to_get_them(
        traces: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_MATPLOTLIB)
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": f"{blocker}{os.pathsep}{src}"}
    blocked = subprocess.run([sys.executable, "-c", "import matplotlib"], capture_output=True, text=True,
                             timeout=60, env=env)
    assert blocked.returncode == 1 and "No module named 'matplotlib'" in blocked.stderr
    html = tmp_path / "r.html"
    p = subprocess.run([sys.executable, "-m", "undying", "diagnose", str(traces), "--html", str(html)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert re.search(r"rank 2 is compute-slow", p.stdout) and "ranks, slowest first" in p.stdout
    assert p.stdout.splitlines()[-1] == "no plots in it: matplotlib is not installed (pip install 'undying[plots]')"
    text = html.read_text()
    assert "<img " not in text and "pip install &#x27;undying[plots]&#x27;" in text
    assert "rank 2 is compute-slow" in text and "<h2>Ranks, slowest first</h2>" in text
    p = subprocess.run([sys.executable, "-m", "undying", "diagnose", str(traces), "--html", str(html), "--json"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and json.loads(p.stdout)["plots"] is False


def test_at_80_columns_the_table_is_whole_and_no_line_is_wider(traces: Path, tmp_path: Path) -> None:
    """Piped at COLUMNS=80 (a terminal of 80 columns): every header whole, no cell cut to "…"."""
    deep = tmp_path / ("a-folder-with-a-long-name-" * 3) / "and-deeper-still" / "report.html"
    p = subprocess.run([sys.executable, "-m", "undying", "diagnose", str(traces), "--html", str(deep)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line for line in lines if len(line) > 80 and line != str(deep)] == []
    assert "…" not in p.stdout
    header = next(line for line in lines if line.lstrip().startswith("rank "))
    assert header.split() == ["rank", "node", "steps", "step", "compute", "comm", "data", "ckpt", "score", "worst"]
    assert lines[-2:] == ["HTML report:", str(deep)]  # a path too long to share a line stands alone
    assert re.search(r"^outliers \(steps far above", p.stdout, re.M)
    assert json.loads(diagnose(str(traces), "--json").stdout)["plots"] is True
