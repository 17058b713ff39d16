"""One training step as a transaction: ``with step:`` around its body.

The step loop (``worker.job``) makes a ``Step`` for each step it runs and
hands it to the script; the step's end (``__exit__``) decides its outcome:
committed, aborted by a peer's fault (the loop recovers and runs it again),
or failed by the script's own error. Code after the block runs for every
attempt, so the step says whether this one counted (``step.committed``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from undying.errors import UsageError
from undying.worker.fingerprint import batch_fingerprint

__all__ = ["Step", "Outcome", "StepHooks"]


class Outcome(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    ABORTED = "aborted"
    FAILED = "failed"
    REPLAY = "replay"  # a failed numeric check: the same step again (worker.numerics)


@dataclass(frozen=True)
class StepHooks:
    """What a step asks of its job at its edges (the job's transaction machinery)."""

    before_commit: Callable[[Step], bool]  # False: the step aborts (a replication failed)
    commit: Callable[[Step], None]
    is_fault: Callable[[BaseException], bool]  # a peer's fault (recovered), not the script's bug
    aborted: Callable[[BaseException], None]
    failed: Callable[[int, BaseException], None]
    began: Callable[[Step, str], None]  # the step's batch fingerprint, reported
    # A failed numeric check's verdict (worker.numerics): "replay", "skip", or None (the step
    # fails).
    numeric: Callable[[Step, BaseException], str | None]


class Step:
    """One training step as a transaction: ``with step:`` around its body.

    ``index`` is the step's number (from 1), ``epoch`` its pass over the
    loader, ``batch`` its batch when ``job.steps`` has a loader, ``generation``
    the process group it runs in. After the block, ``committed`` says whether
    this attempt counted: an attempt a peer's fault aborted is run again.
    """

    def __init__(self, hooks: StepHooks, index: int, epoch: int, batch: Any, generation: int,
                 virtual: Callable[[Step], Iterator[Any]] | None = None) -> None:
        self.index = index
        self.epoch = epoch
        self.batch = batch
        self.generation = generation
        self.metrics: dict[str, float] = {}
        self.outcome = Outcome.PENDING
        self.optimizer_stepped = False
        self.fingerprint = ""
        self._hooks = hooks
        self._inside = False
        self._virtual = virtual  # invariant mode's micro-steps (worker.virtual), None otherwise
        if batch is not None:
            self._report(batch_fingerprint(batch))

    @property
    def committed(self) -> bool:
        """Whether this attempt of the step committed (False while it runs, and for an aborted
        attempt)."""
        return self.outcome is Outcome.COMMITTED

    def uses(self, *batch: Any) -> None:
        """Tell the step which batch it trains on, when the script draws its own
        (``x, y = get_batch()``).

        Call it inside the step, with the tensors the step trains on: undying
        fingerprints them, so that a rank re-running this step after a fault
        is checked to train on the same batch (a mismatch is a ``diverged``
        incident, not a silent difference). ``step.batch``, when the loop has a
        loader, is fingerprinted without it.
        """
        if self.outcome is not Outcome.PENDING:
            raise UsageError(f"step.uses(...) for step {self.index} after the step ended "
                             f"({self.outcome.value}): call it inside `with step:`, with the "
                             "batch the step trains on")
        # the step began with its first batch, reported then; the rest are micro-batches
        if self.fingerprint:
            self.fingerprint = batch_fingerprint(self.fingerprint, *batch)
            return
        self._report(batch_fingerprint(*batch))

    def virtual_ranks(self) -> Iterator[Any]:
        """Invariant mode (``--virtual-ranks V``): this rank's virtual ranks, one micro-step each
        (see worker.virtual)."""
        if self._virtual is None:
            raise UsageError("step.virtual_ranks() needs invariant mode: undying run "
                             "--virtual-ranks V, or job.steps(..., virtual_ranks=V)")
        return self._virtual(self)

    def log(self, **metrics: float | torch.Tensor) -> None:
        """Record values of this step (e.g. ``loss=loss``); committed with the step, dropped with
        an aborted attempt.

        Only inside ``with step:``: after the block the step has committed
        (or was abandoned), and a value logged then would belong to no step.
        """
        if not self._inside:
            where = "before its `with step:` block" if self.outcome is Outcome.PENDING else \
                f"after its `with step:` block ended ({self.outcome.value})"
            raise UsageError(f"step.log({', '.join(metrics)}) for step {self.index} {where}: call "
                             "step.log inside the block; the values are committed with the step")
        for name, value in metrics.items():
            self.metrics[name] = _number(name, value)

    def _report(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self._hooks.began(self, fingerprint)

    def __enter__(self) -> Step:
        if self.outcome is not Outcome.PENDING:
            raise UsageError(f"step {self.index} was entered twice: use `with step:` once per step")
        self._inside = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._inside = False
        hooks = self._hooks
        if exc is None:
            if hooks.before_commit(self):
                self.outcome = Outcome.COMMITTED
                hooks.commit(self)
            return False
        if hooks.is_fault(exc):
            self.outcome = Outcome.ABORTED
            hooks.aborted(exc)
            return True
        verdict = hooks.numeric(self, exc)
        # replayed in place, or skipped: the step commits nothing, the data moves on
        if verdict is not None:
            self.outcome = Outcome.REPLAY if verdict == "replay" else Outcome.COMMITTED
            if verdict == "skip":
                hooks.commit(self)
            return True
        self.outcome = Outcome.FAILED
        if isinstance(exc, Exception):
            hooks.failed(self.index, exc)
        return False

    def __repr__(self) -> str:
        return f"Step(index={self.index}, epoch={self.epoch}, generation={self.generation})"


def _number(name: str, value: Any) -> float:
    """A logged value as a float: a number, or a one-element tensor (``loss``,
    ``loss.detach()``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UsageError(f"step.log({name}=...) got a tensor of shape {tuple(value.shape)}; "
                             f"log one number (e.g. {name}=t.mean())")
        return float(value.item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UsageError(f"step.log({name}=...) got a {type(value).__name__}; log a number or a "
                         "one-element tensor") from None
