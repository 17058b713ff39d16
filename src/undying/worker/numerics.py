"""Numeric checks of each step, and the exact replay that tells a transient fault from a
persistent one.

With ``job.steps(state, ..., numerics=True)`` (or a ``Numerics``), every step
is checked before its optimizer step, inside the transaction: the logged loss
and the gradient norm must be finite, and (with ``spike_factor``) the loss
must not exceed ``spike_factor`` times the median of the last ``window``
committed losses, once ``warmup`` of them exist. The check runs in the
optimizer's step pre-hook, where the gradients are reduced and nothing of the
state has changed yet; a step a ``GradScaler`` skips for inf gradients never
calls the optimizer, so it is the scaler's own business and not checked.

A failed check raises ``NumericFault`` out of the step's body. The step is
then *replayed in place*: the same batch (the cursor still holds it), the same
random state (reseeded from the step), the gradients dropped and the buffers
put back as they were before the step. The replay decides:

- it passes: a transient fault. The replayed step commits, its values are the
  fault-free run's, and the incident names the rank whose local gradients'
  fingerprint changed between the two runs;
- it fails the same way, bit for bit, with every rank's fingerprint equal: the
  data or the model is at fault. Policy: ``skip`` (the step commits nothing
  but moves the data on), ``rollback`` (the state goes back to before step
  ``s - N + 1``, or as far as every rank's ``SnapshotRing`` holds: the restore
  planner's ``plan_numerics_rollback`` says where; the batches of steps
  ``s - N + 1 .. s`` are skipped: the rest of the run is a run that never had
  them) or ``stop`` (the step fails with a report naming the step, each
  rank's batch indices and the values);
- it fails differently: non-determinism or hardware; said so, then the same
  policy.

This module holds what a script names: the settings (``Numerics``) and the
fault a failed check raises (``NumericFault``). The checks themselves, the
replay's verdict and the report are one rank's ``NumericsGuard``, in
``worker.numerics_guard``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from undying.errors import UndyingError, UsageError
from undying.inputs import numerics_fields
from undying.protocol.env import NUMERICS_ENV
from undying.worker.snapshots import MAX_SNAPSHOTS
from undying.worker.verify_plan import check_every

__all__ = ["Numerics", "NumericFault"]

_POLICIES = ("skip", "stop", "rollback")
# The bounds on skipped steps (skip and rollback), by default: a job whose data or model is
# broken fails.
MAX_SKIPS_IN_A_ROW = 10
MAX_SKIPPED_SHARE = 0.1


@dataclass(frozen=True)
class Numerics:
    """What ``job.steps(numerics=...)`` checks, and what a fault that replays the same way does.

    ``metric`` is the name the script logs its loss under (``step.log(loss=...)``),
    logged before ``optimizer.step()`` and the same on every rank (all-reduced).
    ``spike_factor`` (None: no spike check) flags a loss above that multiple of
    the median of the last ``window`` committed losses, from ``warmup`` of them on.
    ``on_persistent`` is ``skip``, ``stop`` or ``rollback`` (go back
    ``rollback_steps`` steps, from an in-memory snapshot of each, and skip
    their batches). ``scaler``: the script's ``GradScaler``, whose per-step
    bookkeeping a replay resets.

    Skipping is bounded: the job fails with the reason once more than
    ``max_skips_in_a_row`` steps in a row were skipped, or once more than that
    many were skipped in all and they are more than ``max_skipped_share`` of
    the steps run (the manager judges it: ``manager.numerics.skip_limit``).
    """

    metric: str = "loss"
    spike_factor: float | None = None
    window: int = 50
    warmup: int = 20
    on_persistent: str = "skip"
    scaler: Any = None
    # every K steps one rank's step replayed elsewhere (worker.verify)
    verify_every: int | None = None
    rollback_steps: int = 2
    max_skips_in_a_row: int = MAX_SKIPS_IN_A_ROW
    max_skipped_share: float = MAX_SKIPPED_SHARE

    def __post_init__(self) -> None:
        factor = self.spike_factor
        if factor is not None and not (math.isfinite(factor) and factor > 1):
            raise UsageError(f"Numerics(spike_factor=...) must be a number above 1 (e.g. 10), "
                             f"got {self.spike_factor}")
        if self.window < 1 or self.warmup < 1 or self.warmup > self.window:
            raise UsageError(f"Numerics needs 1 <= warmup <= window, "
                             f"got warmup={self.warmup} window={self.window}")
        if self.verify_every is not None:
            check_every(self.verify_every, "Numerics(verify_every=...)")
        if self.on_persistent not in _POLICIES:
            raise UsageError(f"Numerics(on_persistent=...) must be one of {', '.join(_POLICIES)}, "
                             f"got {self.on_persistent!r}")
        if isinstance(self.rollback_steps, bool) or not isinstance(self.rollback_steps, int) \
                or not 1 <= self.rollback_steps <= MAX_SNAPSHOTS:
            raise UsageError(f"Numerics(rollback_steps=...) must be a whole number "
                             f"from 1 to {MAX_SNAPSHOTS} "
                             f"(each is a copy of the state in memory), "
                             f"got {self.rollback_steps!r}")
        in_a_row = self.max_skips_in_a_row
        if isinstance(in_a_row, bool) or not isinstance(in_a_row, int) or in_a_row < 1:
            raise UsageError(f"Numerics(max_skips_in_a_row=...) must be a whole number of steps "
                             f"from 1 (e.g. 10), "
                             f"got {self.max_skips_in_a_row!r}")
        share = self.max_skipped_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise UsageError(f"Numerics(max_skipped_share=...) must be a share of the steps "
                             f"above 0 and at most 1 "
                             f"(e.g. 0.1), got {share!r}")

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> Numerics | None:
        """What ``undying run --numerics ...`` asked for (NUMERICS_ENV: ``field=value,...``),
        or None."""
        raw = (os.environ if env is None else env).get(NUMERICS_ENV, "").strip()
        # (the launcher checked it so)
        return Numerics(**numerics_fields(raw, NUMERICS_ENV)) if raw else None

    @staticmethod
    def of(value: Numerics | bool | None, env: dict[str, str] | None = None) -> Numerics | None:
        """The checks of ``job.steps(numerics=value)``.

        A ``Numerics`` is taken as it is; False: no checks. None (the default)
        and True take ``undying run --numerics``'s settings (NUMERICS_ENV), so a
        script gets the checks with no change; without them None is no checks
        and True is ``Numerics()``.
        """
        if value is False:
            return None
        if value is None or value is True:
            configured = Numerics.from_env(env)
            return configured if configured is not None or value is None else Numerics()
        if isinstance(value, Numerics):
            return value
        raise UsageError(f"job.steps(numerics=...) takes True, False or an undying Numerics, "
                         f"got {type(value).__name__}")


class NumericFault(UndyingError):
    """A step's check failed (raised out of its body, handled by the step transaction)."""

    def __init__(self, message: str, step: int, reason: str, values: dict[str, float | None],
                 prints: list[int]) -> None:
        super().__init__(message)
        self.step = step
        self.reason = reason
        self.values = values
        self.prints = prints
        self.t = time.time()  # when the check failed: the incident's timeline starts here

