"""The job manager: state machine, recovery policy, incidents, event log, HTTP API."""

from undying.manager.events import EventLog, read_job
from undying.manager.manager import Manager
from undying.manager.policy import Action, Decision, PolicyContext, decide
from undying.manager.state import Incident, JobState, RankState

__all__ = [
    "Manager", "EventLog", "read_job", "Action", "Decision", "PolicyContext", "decide",
    "Incident", "JobState", "RankState",
]
