"""How often the unchanged DDP tutorial script hangs at its end under ``undying run``, per start mode.

The pattern (``examples/tutorial_plain.py``, pytorch/examples' ``multigpu_torchrun.py``
with gloo): 4 ranks, ``DDP(Linear(20, 1))``, a DistributedSampler, a snapshot
per epoch, ``destroy_process_group()``, then ``main()`` returns, and with it
the last reference to the DDP model: gloo's teardown joins its threads there.
Issue #25 saw it hang forever in 6 of 14 runs with workers forked by the zygote
(a ``pt_gloo_runloop`` thread waiting for the interpreter lock that the joining
thread holds), 0 of 10 with fresh interpreters.

Each run is ``undying run -n 4 examples/tutorial_plain.py 1 1`` (one epoch, its snapshot) in a job dir of
its own, with a deadline (``--deadline``, far past a normal run's few seconds):
a run past it is a hang (its launcher's process group is killed). Modes
alternate run by run, so a load on the machine falls on both alike.

    python bench/teardown.py --runs 30                 # this checkout
    python bench/teardown.py --runs 30 --src ../main/src  # another checkout's undying, same interpreter

Prints one line per run and then, per mode: runs, hangs, other failures,
median seconds of the runs that ended.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "tutorial_plain.py"


def one_run(mode: str, job_dir: Path, deadline: float, src: str) -> tuple[str, float]:
    """``ok``, ``hang`` or ``exit N``, and the seconds it took."""
    env = {**os.environ, "UNDYING_WORKER_START": mode, "OMP_NUM_THREADS": "1"}
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "undying", "run", "-n", "4", "--port", "0", "--job-dir", str(job_dir),
            str(SCRIPT), "1", "1", "--snapshot_path", str(job_dir.parent / f"{job_dir.name}.pt")]
    started = time.monotonic()
    with open(job_dir.parent / f"{job_dir.name}.log", "wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher; its workers die with it
            process.wait()
            return "hang", time.monotonic() - started
    return ("ok" if code == 0 else f"exit {code}"), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per start mode")
    parser.add_argument("--modes", default="zygote,spawn")
    parser.add_argument("--deadline", type=float, default=90.0, help="seconds after which a run is a hang")
    parser.add_argument("--src", default="", help="the undying source folder to run (default: the installed one)")
    parser.add_argument("--keep", action="store_true", help="keep the job dirs and logs")
    args = parser.parse_args()
    modes = args.modes.split(",")
    root = Path(tempfile.mkdtemp(prefix="undying-teardown-"))
    results: dict[str, list[tuple[str, float]]] = {m: [] for m in modes}
    try:
        for i in range(args.runs):
            for mode in modes:
                outcome, took = one_run(mode, root / f"{mode}-{i}", args.deadline, args.src)
                results[mode].append((outcome, took))
                print(f"run {i + 1:3d} {mode:6s} {outcome:8s} {took:6.1f}s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"job dirs and logs: {root}")
    for mode, runs in results.items():
        hangs = sum(1 for o, _ in runs if o == "hang")
        failed = sum(1 for o, _ in runs if o not in ("ok", "hang"))
        ended = [t for o, t in runs if o != "hang"]
        median = f"{statistics.median(ended):.1f}s" if ended else "-"
        print(f"{mode}: {len(runs)} runs, {hangs} hangs, {failed} other failures, median {median} (src: "
              f"{args.src or 'installed'})")


if __name__ == "__main__":
    main()
