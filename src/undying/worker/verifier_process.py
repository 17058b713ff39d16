"""The verifier's process as rank 0 starts and watches it (``--verify-every``, ``worker.verify``).

The verifier is the job's own script run again outside the job's process
group: a world of one on loopback, with the job's seed and K and none of the
job's own keys or addresses (``spawn_verifier``). Rank 0 watches it: whether
it is stopped (``stopped``) and, when it exits, how it ended (``how_it_ended``),
for the reason it gives when it restarts or gives up on it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from undying.procfs import process_state
from undying.protocol.env import (
    AGENT_PID_ENV,
    ENV_PREFIX,
    SEED_ENV,
    VERIFY_EVERY_ENV,
    VERIFY_KEY_ENV,
    VERIFY_SERVE_DIR_ENV,
)

__all__ = ["spawn_verifier", "stopped", "how_it_ended"]

# The verifier's environment keeps the job's seed and K, and none of the job's own (its keys, its
# addresses). (the agent's mark: a verifier whose rank 0 is gone is an orphan the agent ends, and it
# never outlives the job's agent: agent/children.py)
_KEPT = (SEED_ENV, VERIFY_EVERY_ENV, AGENT_PID_ENV)
_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
             "GROUP_WORLD_SIZE")


def spawn_verifier(folder: Path, every: int, seed: int, key: bytes) -> subprocess.Popen[bytes]:
    """The job's script again, as the verifier: a world of one on loopback, none of the job's
    keys."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(ENV_PREFIX) or k in _KEPT) and k not in _TORCHRUN}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update({VERIFY_SERVE_DIR_ENV: str(folder), VERIFY_EVERY_ENV: str(every),
                SEED_ENV: str(seed),
                # its only key: to seal its verdicts and check the ranks' files
                VERIFY_KEY_ENV: key.hex(),
                "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    command = [sys.executable, "-m", spec.name] if spec is not None and spec.name else \
        [sys.executable, sys.argv[0]]
    logfile = (folder / "verifier.log").open("ab")
    try:
        return subprocess.Popen([*command, *sys.argv[1:]], env=env, stdin=subprocess.DEVNULL,
                                stdout=logfile, stderr=subprocess.STDOUT, cwd=os.getcwd())
    finally:
        logfile.close()


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): Linux's /proc says; elsewhere,
    never."""
    return process_state(pid) in ("T", "t")


def how_it_ended(code: int) -> str:
    if code < 0 and -code in signal.valid_signals():
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"
