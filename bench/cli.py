"""How fast the operator's commands answer: each `undying` command that neither trains nor reads
tensors, against a bare interpreter and against an interpreter that imports torch.

Method: every command runs in a fresh process, as a user runs it (``python -m undying ...``),
``--repeats`` times; the commands and the two baselines are interleaved within each repetition, so
a busy moment of a shared machine touches them alike. Reported: the median and the range of the
wall time of each, and its ratio to the torch-importing baseline. issue #17's target: under 0.3 s on
an idle machine. (tests/unit/test_cli_light.py asserts the behaviour behind it: none of these
imports torch.) A benchmark reports numbers; it asserts nothing.

Run it from the repository root::

    python bench/cli.py              # 5 repetitions
    python bench/cli.py --repeats 9 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BASELINES = {"python -c pass": [sys.executable, "-c", "pass"],
             "python -c 'import torch'": [sys.executable, "-c", "import torch"]}


def commands(job_dir: Path) -> dict[str, list[str]]:
    undying = [sys.executable, "-m", "undying"]
    return {
        "undying --help": [*undying, "--help"],
        "undying status (no job)": [*undying, "status", "--job-dir", str(job_dir)],
        "undying inject --help": [*undying, "inject", "--help"],
        "undying trace --help": [*undying, "trace", "--help"],
        "undying checkpoints (empty root)": [*undying, "checkpoints", "--root", str(job_dir / "none")],
        "undying k8s --help": [*undying, "k8s", "--help"],
    }


def timed(argv: list[str]) -> float:
    """One command's wall time, to its exit.

    Waited on by a blocking ``wait`` with a timer to kill it at 120 s: ``subprocess.run(timeout=...)``
    polls the child with sleeps of up to 50 ms, which rounded every time up to the next 50 ms tick.
    """
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    timer = threading.Timer(120, process.kill)
    timer.start()
    try:
        process.wait()
    finally:
        timer.cancel()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {**BASELINES, **commands(Path(tmp) / "job")}
        (Path(tmp) / "job").mkdir()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, argv in runs.items():
                times[name].append(timed(argv))
    torch_s = statistics.median(times["python -c 'import torch'"])
    report = {name: {"median_s": round(statistics.median(t), 3), "min_s": round(min(t), 3),
                     "max_s": round(max(t), 3), "vs_import_torch": round(statistics.median(t) / torch_s, 3)}
              for name, t in times.items()}
    out = sys.stderr if args.json else sys.stdout
    print(f"{'command':40} {'median s':>9} {'range s':>15} {'x import torch':>15}", file=out)
    for name, r in report.items():
        print(f"{name:40} {r['median_s']:9.3f} {r['min_s']:7.3f}-{r['max_s']:<7.3f} {r['vs_import_torch']:15.3f}",
              file=out)
    if args.json:
        print(json.dumps({"repeats": args.repeats, "commands": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
