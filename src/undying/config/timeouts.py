"""The job's timeouts: one field each, positive and bounded, and the ones a rank reads from its
environment.

Each field is its option of ``undying run`` by the package's rule (``--exit-grace`` is
``exit_grace``, ``flag`` says it). Workers receive the timeouts they read through their
environment (``JobConfig.timeout_env``), so that a replacement process sees exactly what
the first one saw; ``timeouts_from_env`` reads them back; no other is sent.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from undying.errors import UsageError
from undying.protocol.env import DEFAULT_HEARTBEAT_TIMEOUT_S, TIMEOUT_ENVS

__all__ = ["MAX_TIMEOUT_S", "flag", "Timeouts", "AUTO_STEP_TIMEOUT_FLOOR_S",
           "AUTO_STEP_TIMEOUT_FACTOR", "timeouts_from_env", "planned_leave_grace"]

MAX_TIMEOUT_S = 24 * 3600.0


def flag(field_name: str) -> str:
    """The option of a field, by the rule: ``exit_grace`` is ``--exit-grace``."""
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class Timeouts:
    """Seconds. Each must be > 0 and <= one day; the step timeout may be None (auto).

    Each field is its option of ``undying run`` (``--exit-grace`` is ``exit_grace``). A rank is
    sent, and reads, only those of ``protocol.env.TIMEOUT_ENVS``; the agent and the manager judge
    the others from their own config.
    """

    # A worker waits this long for the manager to open the next generation.
    rendezvous_timeout: float = 300.0
    # Building a process group (connecting every pair of ranks).
    connect_timeout: float = 120.0
    # A collective that makes no progress (gloo's own timeout).
    collective_timeout: float = 600.0
    # A recovery that has not completed its first step by then escalates.
    recovery_timeout: float = 600.0
    # A collective error with every process alive waits this long for a
    # process exit before it is treated as a transient communication error.
    comm_error_grace: float = 1.0
    # Graceful stop: SIGTERM, then SIGKILL after this.
    stop_grace: float = 10.0
    # A started rank that sends no heartbeat for this long is hung (stopped,
    # or stuck with the interpreter locked): it is killed and replaced.
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    # From spawning a rank to its first word (the script's imports run meanwhile),
    # and from then to its first completed step.
    init_timeout: float = 600.0
    # A lost node's ranks wait this long for a replacement host. Then the job goes on without
    # it: on fewer nodes when --nnodes MIN:MAX allows, else from a checkpoint of the survivors'
    # state once enough nodes have joined. Also how long a job of MIN:MAX nodes waits, once
    # MIN have joined, for the others before it starts.
    node_wait: float = 60.0
    # A rank that beats but makes no progress in a step (enters no collective,
    # completes no step) for this long is stuck. None: auto, derived where it is judged from the
    # observed step times (agent/liveness.py step_timeout: AUTO_STEP_TIMEOUT_FACTOR x the slowest
    # recent step, at least AUTO_STEP_TIMEOUT_FLOOR_S).
    step_timeout: float | None = None
    # A warm spare given a rank must say it took it within this long (it only has to read
    # one line and answer): one stopped or wedged is killed and the rank goes to another
    # spare or a fresh process, instead of the recovery waiting out ``init_timeout``.
    spare_take_timeout: float = 2.0
    # A rank whose script returned but whose process has not exited this long after (stuck in its
    # own exit: a thread that never ends, a deadlocked atexit handler) is killed; the job's result
    # stands, with the stuck exit noted. Never the init timeout: the script's work is done.
    exit_grace: float = 10.0

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "step_timeout":
                continue  # auto
            if not (0 < value <= MAX_TIMEOUT_S):  # nan and inf fail this too
                raise UsageError(
                    f"{flag(f.name)} must be > 0 and <= {MAX_TIMEOUT_S:.0f} seconds, got {value}"
                )


# With --step-timeout auto: the slowest recent step times this, but never
# less than the floor (a step that needs a minute now and then is not a hang).
AUTO_STEP_TIMEOUT_FLOOR_S = 30.0
AUTO_STEP_TIMEOUT_FACTOR = 10.0



def timeouts_from_env(env: os._Environ[str] | dict[str, str] | None = None) -> Timeouts:
    """A worker's timeouts: those it reads (``TIMEOUT_ENVS``) from its environment, the rest their
    defaults."""
    env = os.environ if env is None else env
    kwargs: dict[str, Any] = {}
    for field_name, name in TIMEOUT_ENVS.items():
        raw = env.get(name)
        if raw is None:
            continue
        try:
            kwargs[field_name] = float(raw)
        except ValueError as e:
            raise UsageError(f"{name}={raw!r} is not a number of seconds") from e
    timeouts = Timeouts(**kwargs)
    timeouts.validate()
    return timeouts


def planned_leave_grace(heartbeat_timeout_s: float, slowest_step_s: float) -> float:
    """How long a planned leave (``worker_wire.Abort.at_step_start``) may wait for a step's start:
    three of the slowest recent steps, at least the heartbeat timeout. The worker waits this long
    before it leaves at once; the manager judges the member only after it."""
    return max(heartbeat_timeout_s, 3 * slowest_step_s)
