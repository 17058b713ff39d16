"""The first code a worker process runs: tie its life to the agent, then run the script.

``python -m undying.worker.boot SCRIPT ARGS...`` behaves like ``python SCRIPT
ARGS...`` except that the process dies with its agent (Linux parent-death
signal), so a killed launcher never leaves orphans.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent(expected_parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the agent channel closing still ends us
        return
    if os.getppid() != expected_parent:  # the agent died before the signal was armed
        os._exit(1)


def main() -> None:
    if len(sys.argv) < 2:
        sys.stderr.write("usage: python -m undying.worker.boot SCRIPT [ARGS...]\n")
        sys.exit(2)
    parent = int(os.environ.get("UNDYING_AGENT_PID", os.getppid()))
    _die_with_parent(parent)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
