"""One exception tree for every part of undying.

User-facing errors say what was wrong and what to do; the CLI prints them as a
single line and exits with code 2 (bad input) or 1 (the job failed).
"""

from __future__ import annotations

__all__ = [
    "UndyingError",
    "UsageError",
    "StateError",
    "JobNotRunningError",
    "ConflictError",
    "RecoveryError",
    "NoStateSourceError",
    "GenerationSupersededError",
    "FencedError",
    "ControlStoreLostError",
    "JobFailedError",
]


class UndyingError(Exception):
    """Base of every error undying raises on purpose."""


class UsageError(UndyingError):
    """Bad input from the user: a flag, a path, a port. Exit code 2."""


class StateError(UsageError):
    """The training state a script declares (``undying.State``) cannot be kept or restored as
    given: every process of the script would raise it again, so the job fails at once with it,
    never as lost state."""


class JobNotRunningError(UsageError):
    """A command needed a running job and found none."""


class ConflictError(UsageError):
    """A well-formed request the job's state refuses (a drill for a step already passed, past the
    job's end, or at a step of a script that has none). Exit code 2; HTTP 409."""


class RecoveryError(UndyingError):
    """A worker could not rejoin the job after a fault."""


class NoStateSourceError(RecoveryError):
    """No surviving rank holds a complete state to restore from."""


class GenerationSupersededError(RecoveryError):
    """The generation a worker was joining was replaced by a newer one."""


class FencedError(RecoveryError):
    """This process no longer holds its rank: the manager gave it to a newer process (its host
    was lost)."""


class ControlStoreLostError(RecoveryError):
    """The connection to the manager's control store broke (the manager restarted): connect
    again."""


class JobFailedError(UndyingError):
    """The job stopped for good: the recovery policy gave up."""
