"""The job dir and what it holds, shared by every role and every command.

What belongs here: the job dir's layout and its lock (``jobdir``: the folder, ``manager.json``
that says where the running manager listens, the logs), who owns its files and their modes
(``ownership``: 0700 and 0600 whatever the umask, a stranger's file refused), the token's file
and where a caller finds it (``tokens``), the user's Prometheus folder beside them
(``prometheus``: each job's file_sd target file and the scrape credential), the SQLite event
log, its writer (``events``, with ``held_writes`` beneath it) and its readers (``log_reader``):
the only modules that speak SQL; its rows as Python reads them (``log_rows``; a node's commits
of a step packed in one row, ``step_rows``), and the records the log stores (``records``: the
job's and the ranks' states, incidents, the job's state machine), and the pure computations over
them that the manager and the command line both make (``progress``, ``goodput``, ``reruns``, and
``restarts``: a script without steps in its own terms).

What does not: anything that decides (the manager's policy, recovery,
regroups), anything that serves (the manager's HTTP API and its check of a
caller's token, ``undying.manager.http.access``), anything a process sends another
(``undying.protocol``). The package imports only the contract floor and the
libraries beside it (``undying.checkpoint.lock``), never a role: the manager,
the agent, the launcher, the command line and the demo all read the same job
dir through it.

Names are imported on first use (PEP 562): a command that only reads the
token need not open SQLite.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.jobfiles.events import EventLog, LogReader, read_job
    from undying.jobfiles.jobdir import JobDir
    from undying.jobfiles.records import Incident, IncidentKind, JobState, RankState
    from undying.jobfiles.tokens import ensure_token, find_token

__all__ = ["JobDir", "EventLog", "LogReader", "read_job", "JobState", "RankState", "Incident",
           "IncidentKind", "ensure_token", "find_token"]

_WHERE = {
    "JobDir": "jobdir", "EventLog": "events", "LogReader": "events", "read_job": "events",
    "JobState": "records", "RankState": "records", "Incident": "records",
    "IncidentKind": "records", "ensure_token": "tokens", "find_token": "tokens",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"undying.jobfiles.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'undying.jobfiles' has no attribute {name!r}")
