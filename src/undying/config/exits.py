"""How a worker process's end is told: its exit codes, and the files it leaves in the job dir.

The agent, the manager and the launcher read what a worker wrote or how it
exited; these names are where they agree.
"""

from __future__ import annotations

import os

__all__ = ["EXIT_PREEMPTED", "EXIT_PREEMPTED_BEHIND", "EXIT_FENCED", "EXIT_REGROUPED",
           "EXIT_SCRIPT_ERROR", "EXIT_MIGRATED", "SCRIPT_ERROR_FILE", "WORKERS_DIR", "ERROR_FILE",
           "HANGUP_LOG", "RETURNED_FILE", "worker_dir"]

# The launcher's (and a worker's) exit code after a preemption (SIGTERM) whose dying-gasp checkpoint
# of the stop step stands (or one holding every committed step): run the same command again to
# resume, no step lost. 75 is EX_TEMPFAIL ("try again later"); 143 stays a plain SIGTERM stop.
EXIT_PREEMPTED = 75
# Preempted, and the dying gasp of the stop step was not written (a full disk, the grace period ran
# out): an older checkpoint stands and a resume re-runs the steps after it (the exit reason counts
# them). Not 75, which promises nothing is lost. 74 is EX_IOERR: the state did not reach storage.
EXIT_PREEMPTED_BEHIND = 74
# A worker whose rank was given to a newer process (its host was declared lost) exits with this.
EXIT_FENCED = 76
# A worker that saved or handed on its state in a regroup generation and left: the job starts
# again from that checkpoint on its new set of nodes.
EXIT_REGROUPED = 77
# A worker whose script could not run: a SyntaxError or ImportError (printed by the worker in a few
# lines). No fault to recover from: the job fails at once. 78 is EX_CONFIG.
EXIT_SCRIPT_ERROR = 78
# A worker whose rank an operator moved to another process (`undying migrate`): it leaves at a step
# boundary, its replacement takes the state from a peer; the manager expects this exit.
EXIT_MIGRATED = 79
# Where the first rank whose script could not run leaves the error, in the job dir, for the manager.
SCRIPT_ERROR_FILE = "script-error.txt"
# Each worker process's own folder in the job dir: <job dir>/workers/<rank>-<incarnation>/, holding
# torchrun's error file (error.json, TORCHELASTIC_ERROR_FILE) and the mark that its script returned.
WORKERS_DIR = "workers"
ERROR_FILE = "error.json"
# In the job dir: what the launcher, an agent and their ranks wrote to a terminal after it hung up
# (agent.hangup).
HANGUP_LOG = "launcher.log"
RETURNED_FILE = "returned"


def worker_dir(job_dir: str, rank: int, incarnation: int) -> str:
    """The folder of the process that holds ``rank`` as ``incarnation`` (the agent and the manager
    agree on it)."""
    return os.path.join(os.path.abspath(job_dir), WORKERS_DIR, f"{rank}-{incarnation}")
