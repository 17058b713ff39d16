"""Numeric checks of each step, and the exact replay that tells a transient fault from a persistent one.

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
- it fails differently: non-determinism or hardware; said so, then the same policy.

Every rank takes the same decision without a vote: the values checked are
the job's (the loss the script logs, which must be the job-wide one as in the
demo, and the reduced gradients), and the fingerprints are exchanged only on
the fault path. A fingerprint is the list of the rank's own gradient sums,
taken by a hook on each parameter as backward computes its gradient, before
DDP's reducer sees it (any DDP, DDP's own all-reduce untouched). The last
gradient of a backward pass carries the rank's verdict into the all-reduce
(see ``_on_grad``), so the finite check reads one number per step; the norm
is computed only when a value is wrong.
"""

from __future__ import annotations

import math
import os
import statistics
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from undying.checkpoint.planner import plan_numerics_rollback
from undying.errors import UndyingError, UsageError
from undying.inputs import numerics_fields
from undying.protocol.codec import Message
from undying.protocol.env import NUMERICS_ENV
from undying.protocol.worker_wire import Progress
from undying.worker.snapshots import MAX_SNAPSHOTS, SnapshotRing
from undying.worker.verify_plan import check_every

__all__ = ["Numerics", "NumericFault", "NumericsGuard"]

# The extra the loss history travels in (with the state: a replacement judges spikes as its peers do).
HISTORY_EXTRA = "undying_numerics_losses"
# Each checked model's gradient hooks (weakly: a model that goes away takes its entry with it).
_HOOKS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_POLICIES = ("skip", "stop", "rollback")
# The bounds on skipped steps (skip and rollback), by default: a job whose data or model is broken fails.
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
    verify_every: int | None = None  # every K steps one rank's step replayed elsewhere (worker.verify)
    rollback_steps: int = 2
    max_skips_in_a_row: int = MAX_SKIPS_IN_A_ROW
    max_skipped_share: float = MAX_SKIPPED_SHARE

    def __post_init__(self) -> None:
        if self.spike_factor is not None and not (math.isfinite(self.spike_factor) and self.spike_factor > 1):
            raise UsageError(f"Numerics(spike_factor=...) must be a number above 1 (e.g. 10), got {self.spike_factor}")
        if self.window < 1 or self.warmup < 1 or self.warmup > self.window:
            raise UsageError(f"Numerics needs 1 <= warmup <= window, got warmup={self.warmup} window={self.window}")
        if self.verify_every is not None:
            check_every(self.verify_every, "Numerics(verify_every=...)")
        if self.on_persistent not in _POLICIES:
            raise UsageError(f"Numerics(on_persistent=...) must be one of {', '.join(_POLICIES)}, "
                             f"got {self.on_persistent!r}")
        if isinstance(self.rollback_steps, bool) or not isinstance(self.rollback_steps, int) \
                or not 1 <= self.rollback_steps <= MAX_SNAPSHOTS:
            raise UsageError(f"Numerics(rollback_steps=...) must be a whole number from 1 to {MAX_SNAPSHOTS} "
                             f"(each is a copy of the state in memory), got {self.rollback_steps!r}")
        if isinstance(self.max_skips_in_a_row, bool) or not isinstance(self.max_skips_in_a_row, int) \
                or self.max_skips_in_a_row < 1:
            raise UsageError(f"Numerics(max_skips_in_a_row=...) must be a whole number of steps from 1 (e.g. 10), "
                             f"got {self.max_skips_in_a_row!r}")
        share = self.max_skipped_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise UsageError(f"Numerics(max_skipped_share=...) must be a share of the steps above 0 and at most 1 "
                             f"(e.g. 0.1), got {share!r}")

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> Numerics | None:
        """What ``undying run --numerics ...`` asked for (NUMERICS_ENV: ``field=value,...``), or None."""
        raw = (os.environ if env is None else env).get(NUMERICS_ENV, "").strip()
        return Numerics(**numerics_fields(raw, NUMERICS_ENV)) if raw else None  # (the launcher checked it so)

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
        raise UsageError(f"job.steps(numerics=...) takes True, False or an undying Numerics, got {type(value).__name__}")


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


@dataclass
class _Attempt:
    step: int
    generation: int
    fault: NumericFault


def _bits(values: dict[str, float | None]) -> tuple[Any, ...]:
    """Values compared bit for bit (NaN equals the same NaN)."""
    return tuple((k, None if v is None else struct.pack("<d", v)) for k, v in sorted(values.items()))


_OWN_SUM_DTYPES = (torch.float32, torch.float64)  # summed in their own type: the norm needs no dtype argument


def _sum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class NumericsGuard:
    """One rank's checks for one ``job.steps`` loop; the step transaction calls it at its seams."""

    def __init__(self, config: Numerics, state: Any, rank: int, generation: Callable[[], int],
                 send: Callable[[Message], None], cursor: Any = None) -> None:
        self.config = config
        self._state = state
        self._rank = rank
        self._generation = generation
        self._send = send
        self._cursor = cursor
        self._sums: list[torch.Tensor] = []  # this attempt's local gradient norms, one per gradient computed
        self._marked_at = 0  # how many gradients the mark covers: all of them, or it is not trusted
        self._marked: torch.Tensor | None = None  # whose gradient's first element carries the verdict
        self._pending: _Attempt | None = None
        self._buffers: list[torch.Tensor] = []
        model = state.model
        params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        self._expected = len(params)
        for handle in _HOOKS.pop(model, []) if model is not None else []:
            handle.remove()  # a model checked by an earlier job.steps() loop: one guard's hooks at a time
        handles = [param.register_post_accumulate_grad_hook(self._on_grad)  # before DDP's reducer copies it
                   for param in params]
        if model is not None:
            _HOOKS[model] = handles
        # The pre-step states a roll-back goes back to (policy rollback only: a copy of the state a step).
        self.ring = SnapshotRing(config.rollback_steps) if config.on_persistent == "rollback" else None
        self.history: dict[str, float] = {}
        if config.spike_factor is not None:
            state.extras[HISTORY_EXTRA] = self.history  # moved and saved with the state
            self.history = state.extras[HISTORY_EXTRA]

    # --- seams ------------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        """Each local gradient, as backward accumulates it, before any all-reduce: its norm (the fingerprint).

        A hook after accumulation, not on the gradient itself: one that holds
        the incoming gradient stops autograd from reusing its buffer for
        ``.grad`` and costs a copy of every gradient (measured: +1.6 ms a step
        on the bench's model, more than the sums).

        The last one of a backward pass also carries the rank's verdict: if the
        rank's gradient norm squared is not finite (a NaN or inf, or a value
        so large that it overflows, as a flipped exponent bit makes), its first
        element becomes NaN. The all-reduce
        spreads a NaN to every rank, so after it one element tells every rank
        whether any rank's gradients were finite: the check reads one number,
        not every gradient. (The rank's gradients already hold a non-finite
        value then: the mark changes nothing the reduction had not.)
        """
        grad = param.grad
        if grad is None:
            return
        sums = self._sums
        # As few operations as the work allows: each costs a dispatch, about as much as a small gradient's norm.
        g = grad.detach() if grad.requires_grad else grad  # (a gradient with a graph: create_graph=True)
        sums.append(torch.linalg.vector_norm(g) if g.dtype in _OWN_SUM_DTYPES else
                    torch.linalg.vector_norm(g, dtype=_sum_dtype(g)))
        if len(sums) % self._expected or type(grad) is not torch.Tensor or not grad.is_contiguous() \
                or grad.numel() == 0:
            return
        local = torch.stack(sums)
        # The local norm squared (inf once it overflows) times 0, plus 1: 1 while it is finite, else NaN; the
        # first element times that is itself, bit for bit (-0.0 and a NaN too), or NaN.
        g.view(-1)[:1].mul_(torch.dot(local, local).mul_(0).add_(1))
        self._marked = param
        self._marked_at = len(sums)

    def begin(self, step: Any) -> None:
        """A step (or its replay) starts: forget the last attempt's prints, keep the buffers to put back."""
        self._sums = []
        self._marked = None
        self._marked_at = 0
        model = self._state.model
        if model is not None:
            self._buffers = [b.detach().clone() for b in model.buffers()]
        if self.ring is not None:
            self.ring.save(step.index, self._state)

    def check(self, step: Any) -> None:
        """Before the optimizer steps: raise NumericFault if a value fails; on a passing replay, report."""
        values = self._measure(step)
        reason = self._judge(step.index, values)
        pending = self._pending
        if reason is None:
            if pending is not None and pending.step == step.index and pending.generation == step.generation:
                self._pending = None
                self._report_transient(step, pending.fault, self._measure(step, full=True))
            if values["loss"] is not None and self.config.spike_factor is not None:
                self._remember(step.index, values["loss"])
            return
        raise NumericFault(f"step {step.index}: {reason}", step.index, reason, values, self._local_prints())

    def resolve(self, step: Any, fault: NumericFault) -> str:
        """What the transaction does with a failed check: ``replay``, ``skip`` or ``stop``."""
        pending = self._pending
        if pending is None or pending.step != step.index or pending.generation != step.generation:
            self._pending = _Attempt(step.index, step.generation, fault)
            self._rewind()
            return "replay"
        self._pending = None
        first = pending.fault
        ranks = self._gather({"changed": fault.prints != first.prints, "finite": self._local_finite(),
                              "batch": self._batch_indices(step.index),
                              "oldest": self.ring.oldest if self.ring is not None else None})
        changed = [r for r, d in enumerate(ranks) if d["changed"]]
        same = first.reason == fault.reason and _bits(first.values) == _bits(fault.values) and not changed
        verdict = "persistent" if same else "nondeterministic"
        suspects = changed or [r for r, d in enumerate(ranks) if d["finite"] is False]
        policy = self.config.on_persistent
        extra: dict[str, Any] = {"batches": {str(r): d["batch"] for r, d in enumerate(ranks)}}
        outcome = "; the batch is skipped" if policy == "skip" else "; the job stops"
        back_to = step.index
        rollback = None
        if policy == "rollback":
            # The one planner: every rank goes back to the same step, the latest pre-state that every ring holds,
            # N steps back at most, from its own snapshot (or nowhere: the batch is skipped).
            rollback = plan_numerics_rollback(step=step.index, rollback_steps=self.config.rollback_steps,
                                              oldest=[d["oldest"] if isinstance(d["oldest"], int) else None
                                                      for d in ranks])
            assert rollback.step is not None
            back_to = rollback.step + 1
            extra.update(rolled_back=list(range(back_to, step.index)), skipped=list(range(back_to, step.index + 1)),
                         restore_plan=rollback.describe())
            outcome = (f"; rolled back to the state before step {back_to}, the batches of steps {back_to}.."
                       f"{step.index} skipped" if back_to < step.index else
                       f"; no earlier state held (the ring starts at step {step.index}): the batch is skipped")
        summary = (f"step {step.index}: {first.reason}; the replay " +
                   ("failed the same way, bit for bit: the data or the model is at fault" if same else
                    f"failed differently ({fault.reason}): non-determinism or hardware") +
                   (f"; ranks whose gradients changed: {changed}" if changed else "") + outcome)
        self._report(step, verdict, policy, summary, suspects, first, fault.values, extra)
        if policy in ("skip", "rollback"):
            self._rewind()
            if rollback is not None and rollback.source.kind == "snapshot" and self.ring is not None:
                self.ring.restore(back_to, self._state)  # the skipped steps' batches never trained this state
            step.metrics.clear()  # nothing trained: no value of this step stands
            return "skip"
        batches = "; ".join(f"rank {r}: {d['batch']}" for r, d in enumerate(ranks))
        fault.args = (f"{summary}; values first {first.values}, replay {fault.values}; batches {batches}",)
        return "stop"

    def prints(self) -> list[int]:
        """This attempt's local gradient fingerprint (``--verify-every`` compares it with a replay's)."""
        return self._local_prints()

    # --- the checks -------------------------------------------------------------------

    def _measure(self, step: Any, *, full: bool = False) -> dict[str, float | None]:
        """The loss, and the gradient norm when a value is wrong (or ``full``, or no mark could be read)."""
        loss = step.metrics.get(self.config.metric)
        marked = self._marked
        grad = marked.grad if marked is not None else None
        if (not full and grad is not None and self._marked_at == len(self._sums) and type(grad) is torch.Tensor
                and grad.numel()
                and math.isfinite(float(grad.view(-1)[0].item())) and (loss is None or math.isfinite(loss))):
            return {"loss": loss, "grad_norm": None}  # every rank's gradients finite: the norm is not needed
        model = self._state.model
        grads = [p.grad for p in model.parameters() if p.grad is not None] if model is not None else []
        norm = float(torch.nn.utils.get_total_norm(grads).item()) if grads else None
        if norm is not None and math.isfinite(norm) and grad is not None and grad.numel() \
                and not math.isfinite(float(grad.view(-1)[0].item())):
            norm = math.inf  # a rank's own norm overflowed (its mark says so) though the average did not
        return {"loss": loss, "grad_norm": norm}

    def _judge(self, index: int, values: dict[str, float | None]) -> str | None:
        loss, norm = values["loss"], values["grad_norm"]
        if loss is not None and not math.isfinite(loss):
            return f"the loss is {loss}"
        if norm is not None and not math.isfinite(norm):
            return f"the gradient norm is {norm}"
        factor = self.config.spike_factor
        if factor is None or loss is None:
            return None
        recent = [v for k, v in sorted(((int(k), v) for k, v in self.history.items())) if k < index]
        recent = recent[-self.config.window:]
        if len(recent) < self.config.warmup:
            return None
        median = statistics.median(recent)
        if median > 0 and loss > factor * median:
            return f"the loss {loss:.6g} is a spike: above {factor:g} x the median {median:.6g} of the last {len(recent)}"
        return None

    def _remember(self, index: int, loss: float) -> None:
        self.history[str(index)] = loss
        while len(self.history) > self.config.window:
            del self.history[min(self.history, key=int)]

    # --- the fault path ---------------------------------------------------------------

    def _local_prints(self) -> list[int]:
        """This attempt's local gradient norms, as their bits (NaN compared as the same NaN)."""
        if not self._sums:
            return []
        sums = torch.stack(self._sums)
        return sums.view(torch.int64 if sums.dtype == torch.float64 else torch.int32).tolist()

    def _local_finite(self) -> bool | None:
        """Whether this rank's own gradients were finite in this attempt (None: none computed)."""
        if not self._sums:
            return None
        return bool(torch.isfinite(torch.stack(self._sums)).all())

    def _rewind(self) -> None:
        """Back to the state before the step: no gradients, the buffers as they were, the scaler's step undone."""
        self._state.discard_gradients()
        model = self._state.model
        if model is not None:
            with torch.no_grad():
                for live, saved in zip(model.buffers(), self._buffers, strict=False):
                    live.copy_(saved)
        scaler = self.config.scaler
        per_optimizer = getattr(scaler, "_per_optimizer_states", None)
        if per_optimizer is not None:
            per_optimizer.clear()  # unscale_ ran for the failed attempt; the replay unscales again

    def _gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's finding, on every rank (the fault path only: the replay runs on all of them)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [mine]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    def _batch_indices(self, index: int) -> Any:
        """Which samples this rank's batch of step ``index`` holds (a DistributedSampler's order), or its position."""
        cursor = self._cursor
        if cursor is None or cursor.steps_per_epoch is None:
            return None
        epoch, position = divmod(cursor.position(index) - 1, cursor.steps_per_epoch)
        loader = self._state.loader
        sampler = getattr(loader, "sampler", None)
        size = getattr(loader, "batch_size", None)
        if isinstance(sampler, torch.utils.data.DistributedSampler) and isinstance(size, int):
            order = list(iter(sampler))  # seeded by (seed, epoch) of its own: no random state is touched
            return order[position * size:(position + 1) * size]
        return {"epoch": epoch, "batch": position}

    def _report_transient(self, step: Any, first: NumericFault, values: dict[str, float | None]) -> None:
        ranks = self._gather({"changed": self._local_prints() != first.prints})
        changed = [r for r, d in enumerate(ranks) if d["changed"]]
        who = f"rank {changed[0]}" if len(changed) == 1 else f"ranks {changed}" if changed else "no rank's gradients"
        summary = f"step {step.index}: {first.reason}; the replay passed: a transient fault, {who} changed"
        self._report(step, "transient", "replayed", summary, changed, first, values, {})

    def _report(self, step: Any, verdict: str, action: str, summary: str, suspects: list[int],
                first: NumericFault, replay: dict[str, float | None], extra: dict[str, Any]) -> None:
        if self._rank != 0:
            return
        self._send(Progress(self._rank, self._generation(), "numeric_fault", time.time(), step=step.index, detail={
            "verdict": verdict, "action": action, "summary": summary, "suspects": suspects,
            "fault_t": first.t, "reason": first.reason, "first": _plain(first.values), "replay": _plain(replay),
            "limits": {"max_skips_in_a_row": self.config.max_skips_in_a_row,
                       "max_skipped_share": self.config.max_skipped_share}, **extra}))


def _plain(values: dict[str, float | None]) -> dict[str, float | str | None]:
    """Values as JSON takes them: a non-finite one as its name ("nan", "inf")."""
    return {k: v if v is None or math.isfinite(v) else str(v) for k, v in values.items()}

