"""The soak's job: the demo job (``undying/demo/train.py``) unchanged, plus a way to make a rank leave early.

Both runs of a soak (with faults and fault-free) run this script, so the
oracle compares the same job. Without ``SOAK_LEAVE_DIR`` in the environment
it is the demo script. With it, at the start of every step, a rank looks in
that folder for an order ``leave-r<RANK>-s<STEP>-<HOW>`` with STEP at or
before the step it is at, and takes it by renaming it (one process only, so a
replacement of the rank never obeys it again). HOW is what a script with a
bug does (issue #25, item 6):

* ``exit``: ``sys.exit(0)`` inside the step's transaction;
* ``return``: the training loop ends early, and the script returns.

A verifier (``--verify-every``) runs this script too; it never leaves.

With ``SOAK_PACE_FILE``, every step lasts at least the seconds that file holds
(read at each step; missing or empty: no pacing), so the multi-node soak
paces its job while it injects faults and lets it run out at full speed
after them. Pacing is a sleep between steps: the losses are the same.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from soak_plan import HOWS, LEAVE_ENV, PACE_ENV

from undying.demo import TRAIN_SCRIPT
from undying.protocol.env import VERIFY_SERVE_DIR_ENV
from undying.worker.job import Job


def _take(folder: Path, rank: int, step: int) -> str | None:
    """The HOW of an order due for ``rank`` at ``step``, taken (renamed away); None when there is none."""
    prefix = f"leave-r{rank}-s"
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if not name.startswith(prefix):
                continue
            at, _, how = name.removeprefix(prefix).partition("-")
            if not at.isdigit() or int(at) > step or how not in HOWS:
                continue
            try:
                os.rename(folder / name, folder / f"{name}.taken-{os.getpid()}")
            except OSError:
                continue  # another process took it first
            return how
    return None


_steps = Job.steps


def _pace(path: str) -> float:
    try:
        return float(Path(path).read_text() or 0)
    except (OSError, ValueError):
        return 0.0


def _soak_steps(self: Job, state: Any, **kwargs: Any) -> Iterator[Any]:
    folder, pace_file = os.environ.get(LEAVE_ENV, ""), os.environ.get(PACE_ENV, "")
    steps: Any = _steps(self, state, **kwargs)  # a generator (closed when the rank leaves)
    if not (folder or pace_file) or os.environ.get(VERIFY_SERVE_DIR_ENV):
        yield from steps
        return
    last = time.monotonic()
    for step in steps:
        if pace_file:
            time.sleep(max(0.0, _pace(pace_file) - (time.monotonic() - last)))
            last = time.monotonic()
        how = _take(Path(folder), self.rank, step.index) if folder else None
        if how == "return":
            print(f"soak: rank {self.rank} leaves before step {step.index}: its loop ends", flush=True)
            steps.close()
            return
        if how == "exit":
            print(f"soak: rank {self.rank} leaves in step {step.index}: sys.exit(0)", flush=True)
            with step:
                sys.exit(0)
        yield step


def main() -> None:
    Job.steps = _soak_steps  # type: ignore[method-assign]
    sys.argv = [str(TRAIN_SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(TRAIN_SCRIPT), run_name="__main__")


if __name__ == "__main__":
    main()
