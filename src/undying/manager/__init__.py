"""The job manager: state machine, recovery policy, incidents, event log, HTTP API.

Names are imported on first use (PEP 562): the command-line clients import
``undying.manager.auth`` and must not pay for the manager (and torch) with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.manager.events import EventLog, read_job
    from undying.manager.manager import Manager
    from undying.manager.policy import Action, Decision, PolicyContext, decide
    from undying.manager.state import Incident, JobState, RankState

__all__ = [
    "Manager", "EventLog", "read_job", "Action", "Decision", "PolicyContext", "decide",
    "Incident", "JobState", "RankState",
]

_WHERE = {
    "Manager": "manager", "EventLog": "events", "read_job": "events", "Action": "policy", "Decision": "policy",
    "PolicyContext": "policy", "decide": "policy", "Incident": "state", "JobState": "state", "RankState": "state",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"undying.manager.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'undying.manager' has no attribute {name!r}")
