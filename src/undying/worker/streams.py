"""Where a worker's stdout and stderr go: torchrun's ``--redirects``, ``--tee`` and ``--local-ranks-filter``.

The agent puts the decision in the rank's environment (``UNDYING_LOG_DIR``,
``UNDYING_REDIRECTS``, ``UNDYING_TEE``: torchrun's Std numbers, 1 stdout,
2 stderr, 3 both; ``UNDYING_CONSOLE=0``: this rank is filtered off the
console), and the worker sets its own file descriptors before the script runs:

- redirected: the stream goes to ``<dir>/stdout.log`` (``stderr.log``) only;
- teed: to the file and the console, through a ``tee`` process that ends when
  the worker's last descriptor on it closes (a killed worker loses nothing it wrote);
- filtered off the console: to the file if one is asked for, else nowhere.
"""

from __future__ import annotations

import os
import subprocess
import sys

from undying.inputs import env_value

__all__ = ["direct_streams"]

_STREAMS = ((1, "stdout", 1), (2, "stderr", 2))  # fd, file name, torchrun's Std bit
_tees: list[subprocess.Popen[bytes]] = []  # (held: the copies outlive nothing of ours but must not be collected)


def direct_streams() -> None:
    """Point fds 1 and 2 where this rank's environment says (nothing to do when it says nothing)."""
    env = os.environ
    console = env.get("UNDYING_CONSOLE", "1") != "0"
    folder = env.get("UNDYING_LOG_DIR", "")
    redirects = int(env_value("UNDYING_REDIRECTS") or 0) if folder else 0  # (undying.inputs: the one reader)
    tee = int(env_value("UNDYING_TEE") or 0) if folder else 0
    if console and not redirects and not tee:
        return
    if folder:
        os.makedirs(folder, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name, bit in _STREAMS:
        path = os.path.join(folder, f"{name}.log") if folder else ""
        if path and (redirects & bit or (tee & bit and not console)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        elif path and tee & bit:
            target = _tee(path, fd)
        elif not console:
            target = os.open(os.devnull, os.O_WRONLY)
        else:
            continue
        os.dup2(target, fd)
        os.close(target)


def _tee(path: str, fd: int) -> int:
    """A pipe whose reader writes to ``path`` and to what ``fd`` is now; returns the pipe's write end."""
    read_end, write_end = os.pipe()
    console = os.dup(fd)
    # Its own session: a signal to the worker's group does not cut the copy short; it ends at EOF.
    _tees.append(subprocess.Popen(["tee", "-a", path], stdin=read_end, stdout=console, stderr=subprocess.DEVNULL,
                                  start_new_session=True, close_fds=True))
    os.close(read_end)
    os.close(console)
    return write_end
