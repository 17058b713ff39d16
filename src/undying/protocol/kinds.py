"""The closed sets of names the job's processes, its CLI and its API share.

Each is a ``Choice`` (a ``StrEnum``): a member is its plain string on the wire
and in the job's log, and ``"crash" in InjectKind`` answers for plain strings.
"""

from __future__ import annotations

from undying.protocol.codec import Choice

__all__ = [
    "InjectKind", "HangHow", "InjectPhase", "SlowPhase", "WorkerPhase", "RecoveryPhase",
    "NumericHow",
]


class InjectKind(Choice):
    """What ``/api/inject`` and ``undying inject`` accept."""

    CRASH = "crash"
    HANG = "hang"
    COMM_ERROR = "comm-error"
    SLOW = "slow"
    NAN = "nan"
    BITFLIP = "bitflip"
    # The rank's script exits 0 there (sys.exit(0)), as a script that stops early does
    LEAVE = "leave"


class HangHow(Choice):
    """How an injected hang hangs: SIGSTOP, an endless loop, or a block, the last two at a step."""

    STOP = "stop"
    SPIN = "spin"
    BLOCK = "block"


class InjectPhase(Choice):
    """Where a worker can be made to fault.

    At the start of a step (between steps), in the forward pass, in backward's
    gradient all-reduce, in the optimizer step, when it starts a recovery, when
    it has left the old generation and is about to join the next (``join``:
    while the others form it), for the rank's next replacement process once it
    joined and received its state (``rejoin``), or in a regroup generation once
    the state is restored, before it is saved (``regroup``, see worker.job).
    """

    STEP = "step"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    RECOVERY = "recovery"
    JOIN = "join"
    REJOIN = "rejoin"
    REGROUP = "regroup"


class SlowPhase(Choice):
    """Where an injected slowdown spends its extra time: compute, the wait for a batch, the
    checkpoint stall."""

    COMPUTE = "compute"
    DATA = "data"
    CKPT = "ckpt"


class WorkerPhase(Choice):
    """What a worker is doing, as its heartbeats say: starting up, running steps, rejoining,
    finished."""

    INIT = "init"
    STEP = "step"
    RECOVERY = "recovery"
    DONE = "done"


class RecoveryPhase(Choice):
    """The timeline of an incident, in order (docs/architecture.md)."""

    DETECTED = "detected"
    DECIDED = "decided"
    REPLACEMENT_READY = "replacement_ready"
    GROUP_REBUILT = "group_rebuilt"
    STATE_RESTORED = "state_restored"
    FIRST_STEP_DONE = "first_step_done"


class NumericHow(Choice):
    """How an injected numeric fault strikes (``how`` of ``/api/inject``).

    For nan: ``once`` (the first run of the step only: a replay passes) or
    ``persistent`` (every run of that step: as a bad batch would). For bitflip:
    the tensor whose bit flips, ``grad`` (the rank's local gradient, before the
    all-reduce) or ``param`` (a weight of the rank's model, which stays wrong).
    """

    ONCE = "once"
    PERSISTENT = "persistent"
    GRAD = "grad"
    PARAM = "param"
    # The top mantissa bit of the largest local gradient value: stays finite
    GRAD_FINITE = "grad-finite"
