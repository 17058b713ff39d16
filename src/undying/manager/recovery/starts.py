"""What a rank's process raised, as it left it in torchrun's error file, and the processes of a
whole-group attempt whose words the recovery policy weighs.

A start-up error every rank raises the same way twice in a row ends the job
(``policy.certain_start``, a pure rule). With the step API each rank's fault
is an incident of its own; a whole-group restart kills every other rank at the
first exit, so their words are read here, from the files their processes left
(the worker's boot writes torchrun's error file for any exception the script
raises, as torchrun's ``@record`` does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

from undying.config import ERROR_FILE, worker_dir
from undying.jobfiles.records import RankInfo

__all__ = ["Attempts", "error_file"]


def error_file(job_dir: str, rank: int, incarnation: int) -> tuple[str, str]:
    """The error and traceback a rank's process left in torchrun's error file (``@record`` writes
    it), or ("", "").

    torchrun reads the same file back into its failure report; so does the manager. A file
    that is missing, unreadable or not torchrun's JSON says nothing (the exit code speaks).
    """
    path = os.path.join(worker_dir(job_dir, rank, incarnation), ERROR_FILE)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.loads(f.read(1 << 20))
        message = data["message"]
        if isinstance(message, str):
            return message[:2000], ""
        callstack = message.get("extraInfo", {}).get("py_callstack", "")
        return str(message.get("message", ""))[:2000], str(callstack)[:20000]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "", ""


class Attempts:
    """The processes of the whole group's previous attempt, and what each of an attempt raised."""

    def __init__(self, job_dir: str) -> None:
        self.job_dir = job_dir
        self.last: dict[int, int] = {}  # rank -> incarnation, of the attempt a restart ended

    def restarting(self, ranks: Iterable[RankInfo]) -> None:
        """Every rank starts again: the processes that held them are the attempt before."""
        self.last = {info.rank: info.incarnation for info in ranks}

    def raised(self, processes: Mapping[int, int]) -> dict[int, str]:
        """What each process (rank -> incarnation) raised, by rank ("": nothing it left)."""
        return {rank: error_file(self.job_dir, rank, incarnation)[0]
                for rank, incarnation in processes.items()}

    def words(self, ranks: Iterable[RankInfo], *,
              read: bool = True) -> tuple[dict[int, str], dict[int, str]]:
        """(the attempt before, this one so far): what each rank's process raised (nothing unless
        ``read``)."""
        if not read:
            return {}, {}
        return self.raised(self.last), self.raised({i.rank: i.incarnation for i in ranks})
