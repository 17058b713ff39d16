"""One rank's numeric checks for one ``job.steps`` loop: the hooks, the verdict of a replay,
the report.

``worker.numerics`` says what is checked and what a fault that replays the same
way does (``Numerics``); this module is the ``NumericsGuard`` the step
transaction calls at its seams, kept apart because it is the mechanism
(gradient hooks, the fault path's exchange, the roll-back), not the settings.

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
from undying.protocol.codec import Message
from undying.protocol.worker_wire import Progress
from undying.worker.numerics import NumericFault, Numerics
from undying.worker.snapshots import SnapshotRing

__all__ = ["NumericsGuard"]

# The extra the loss history travels in (with the state: a replacement judges spikes as its
# peers do).
HISTORY_EXTRA = "undying_numerics_losses"
# Each checked model's gradient hooks (weakly: a model that goes away takes its entry with it).
_HOOKS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


@dataclass
class _Attempt:
    step: int
    generation: int
    fault: NumericFault


def _bits(values: dict[str, float | None]) -> tuple[Any, ...]:
    """Values compared bit for bit (NaN equals the same NaN)."""
    return tuple((k, None if v is None else struct.pack("<d", v))
                 for k, v in sorted(values.items()))


# Summed in their own type: the norm needs no dtype argument.
_OWN_SUM_DTYPES = (torch.float32, torch.float64)


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
        # This attempt's local gradient norms, one per gradient computed.
        self._sums: list[torch.Tensor] = []
        self._marked_at = 0  # how many gradients the mark covers: all of them, or it is not trusted
        # Whose gradient's first element carries the verdict.
        self._marked: torch.Tensor | None = None
        self._pending: _Attempt | None = None
        self._buffers: list[torch.Tensor] = []
        model = state.model
        params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
        self._expected = len(params)
        for handle in _HOOKS.pop(model, []) if model is not None else []:
            # A model checked by an earlier job.steps() loop: one guard's hooks at a time.
            handle.remove()
        # Before DDP's reducer copies it.
        handles = [param.register_post_accumulate_grad_hook(self._on_grad) for param in params]
        if model is not None:
            _HOOKS[model] = handles
        # The pre-step states a roll-back goes back to (policy rollback only: a copy of the state
        # a step).
        rolls_back = config.on_persistent == "rollback"
        self.ring = SnapshotRing(config.rollback_steps) if rolls_back else None
        self.history: dict[str, float] = {}
        if config.spike_factor is not None:
            state.extras[HISTORY_EXTRA] = self.history  # moved and saved with the state
            self.history = state.extras[HISTORY_EXTRA]

    # --- seams ------------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        """Each local gradient, as backward accumulates it, before any all-reduce: its norm (the
        fingerprint).

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
        # As few operations as the work allows: each costs a dispatch, about as much as a small
        # gradient's norm.
        # (a gradient with a graph: create_graph=True)
        g = grad.detach() if grad.requires_grad else grad
        sums.append(torch.linalg.vector_norm(g) if g.dtype in _OWN_SUM_DTYPES else
                    torch.linalg.vector_norm(g, dtype=_sum_dtype(g)))
        if len(sums) % self._expected or type(grad) is not torch.Tensor \
                or not grad.is_contiguous() or grad.numel() == 0:
            return
        local = torch.stack(sums)
        # The local norm squared (inf once it overflows) times 0, plus 1: 1 while it is finite,
        # else NaN; the first element times that is itself, bit for bit (-0.0 and a NaN too), or
        # NaN.
        g.view(-1)[:1].mul_(torch.dot(local, local).mul_(0).add_(1))
        self._marked = param
        self._marked_at = len(sums)

    def begin(self, step: Any) -> None:
        """A step (or its replay) starts: forget the last attempt's prints, keep the buffers to
        put back."""
        self._sums = []
        self._marked = None
        self._marked_at = 0
        model = self._state.model
        if model is not None:
            self._buffers = [b.detach().clone() for b in model.buffers()]
        if self.ring is not None:
            self.ring.save(step.index, self._state)

    def check(self, step: Any) -> None:
        """Before the optimizer steps: raise NumericFault if a value fails; on a passing replay,
        report."""
        values = self._measure(step)
        reason = self._judge(step.index, values)
        pending = self._pending
        if reason is None:
            if pending is not None and pending.step == step.index \
                    and pending.generation == step.generation:
                self._pending = None
                self._report_transient(step, pending.fault, self._measure(step, full=True))
            if values["loss"] is not None and self.config.spike_factor is not None:
                self._remember(step.index, values["loss"])
            return
        raise NumericFault(f"step {step.index}: {reason}", step.index, reason, values,
                           self._local_prints())

    def resolve(self, step: Any, fault: NumericFault) -> str:
        """What the transaction does with a failed check: ``replay``, ``skip`` or ``stop``."""
        pending = self._pending
        if pending is None or pending.step != step.index or pending.generation != step.generation:
            self._pending = _Attempt(step.index, step.generation, fault)
            self._rewind()
            return "replay"
        self._pending = None
        first = pending.fault
        ranks = self._gather({"changed": fault.prints != first.prints,
                              "finite": self._local_finite(),
                              "batch": self._batch_indices(step.index),
                              "oldest": self.ring.oldest if self.ring is not None else None})
        changed = [r for r, d in enumerate(ranks) if d["changed"]]
        same_values = _bits(first.values) == _bits(fault.values)
        same = first.reason == fault.reason and same_values and not changed
        verdict = "persistent" if same else "nondeterministic"
        suspects = changed or [r for r, d in enumerate(ranks) if d["finite"] is False]
        policy = self.config.on_persistent
        extra: dict[str, Any] = {"batches": {str(r): d["batch"] for r, d in enumerate(ranks)}}
        outcome = "; the batch is skipped" if policy == "skip" else "; the job stops"
        back_to = step.index
        rollback = None
        if policy == "rollback":
            # The one planner: every rank goes back to the same step, the latest pre-state that
            # every ring holds, N steps back at most, from its own snapshot (or nowhere: the batch
            # is skipped).
            oldest = [d["oldest"] if isinstance(d["oldest"], int) else None for d in ranks]
            rollback = plan_numerics_rollback(step=step.index,
                                              rollback_steps=self.config.rollback_steps,
                                              oldest=oldest)
            assert rollback.step is not None
            back_to = rollback.step + 1
            extra.update(rolled_back=list(range(back_to, step.index)),
                         skipped=list(range(back_to, step.index + 1)),
                         restore_plan=rollback.describe())
            outcome = (f"; rolled back to the state before step {back_to}, "
                       f"the batches of steps {back_to}.."
                       f"{step.index} skipped" if back_to < step.index else
                       f"; no earlier state held (the ring starts at step {step.index}): "
                       f"the batch is skipped")
        summary = (f"step {step.index}: {first.reason}; the replay " +
                   ("failed the same way, bit for bit: the data or the model is at fault"
                    if same else
                    f"failed differently ({fault.reason}): non-determinism or hardware") +
                   (f"; ranks whose gradients changed: {changed}" if changed else "") + outcome)
        self._report(step, verdict, policy, summary, suspects, first, fault.values, extra)
        if policy in ("skip", "rollback"):
            self._rewind()
            from_snapshot = rollback is not None and rollback.source.kind == "snapshot"
            if from_snapshot and self.ring is not None:
                # The skipped steps' batches never trained this state.
                self.ring.restore(back_to, self._state)
            step.metrics.clear()  # nothing trained: no value of this step stands
            return "skip"
        batches = "; ".join(f"rank {r}: {d['batch']}" for r, d in enumerate(ranks))
        fault.args = (f"{summary}; values first {first.values}, replay {fault.values}; "
                      f"batches {batches}",)
        return "stop"

    def prints(self) -> list[int]:
        """This attempt's local gradient fingerprint (``--verify-every`` compares it with a
        replay's)."""
        return self._local_prints()

    # --- the checks -------------------------------------------------------------------

    def _measure(self, step: Any, *, full: bool = False) -> dict[str, float | None]:
        """The loss, and the gradient norm when a value is wrong (or ``full``, or no mark could
        be read)."""
        loss = step.metrics.get(self.config.metric)
        marked = self._marked
        grad = marked.grad if marked is not None else None
        if (not full and grad is not None and self._marked_at == len(self._sums)
                and type(grad) is torch.Tensor
                and grad.numel()
                and math.isfinite(float(grad.view(-1)[0].item()))
                and (loss is None or math.isfinite(loss))):
            # Every rank's gradients finite: the norm is not needed.
            return {"loss": loss, "grad_norm": None}
        model = self._state.model
        grads = ([p.grad for p in model.parameters() if p.grad is not None]
                 if model is not None else [])
        norm = float(torch.nn.utils.get_total_norm(grads).item()) if grads else None
        if norm is not None and math.isfinite(norm) and grad is not None and grad.numel() \
                and not math.isfinite(float(grad.view(-1)[0].item())):
            # A rank's own norm overflowed (its mark says so) though the average did not.
            norm = math.inf
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
            return (f"the loss {loss:.6g} is a spike: above {factor:g} x the median {median:.6g} "
                    f"of the last {len(recent)}")
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
        """Back to the state before the step: no gradients, the buffers as they were, the
        scaler's step undone."""
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
        """Every rank's finding, on every rank (the fault path only: the replay runs on all of
        them)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [mine]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    def _batch_indices(self, index: int) -> Any:
        """Which samples this rank's batch of step ``index`` holds (a DistributedSampler's
        order), or its position."""
        cursor = self._cursor
        if cursor is None or cursor.steps_per_epoch is None:
            return None
        epoch, position = divmod(cursor.position(index) - 1, cursor.steps_per_epoch)
        loader = self._state.loader
        sampler = getattr(loader, "sampler", None)
        size = getattr(loader, "batch_size", None)
        if isinstance(sampler, torch.utils.data.DistributedSampler) and isinstance(size, int):
            # Seeded by (seed, epoch) of its own: no random state is touched.
            order = list(iter(sampler))
            return order[position * size:(position + 1) * size]
        return {"epoch": epoch, "batch": position}

    def _report_transient(self, step: Any, first: NumericFault,
                          values: dict[str, float | None]) -> None:
        ranks = self._gather({"changed": self._local_prints() != first.prints})
        changed = [r for r, d in enumerate(ranks) if d["changed"]]
        who = (f"rank {changed[0]}" if len(changed) == 1 else
               f"ranks {changed}" if changed else "no rank's gradients")
        summary = (f"step {step.index}: {first.reason}; the replay passed: a transient fault, "
                   f"{who} changed")
        self._report(step, "transient", "replayed", summary, changed, first, values, {})

    def _report(self, step: Any, verdict: str, action: str, summary: str, suspects: list[int],
                first: NumericFault, replay: dict[str, float | None],
                extra: dict[str, Any]) -> None:
        if self._rank != 0:
            return
        detail = {
            "verdict": verdict, "action": action, "summary": summary, "suspects": suspects,
            "fault_t": first.t, "reason": first.reason, "first": _plain(first.values),
            "replay": _plain(replay),
            "limits": {"max_skips_in_a_row": self.config.max_skips_in_a_row,
                       "max_skipped_share": self.config.max_skipped_share}, **extra}
        self._send(Progress(self._rank, self._generation(), "numeric_fault", time.time(),
                            step=step.index, detail=detail))


def _plain(values: dict[str, float | None]) -> dict[str, float | str | None]:
    """Values as JSON takes them: a non-finite one as its name ("nan", "inf")."""
    return {k: v if v is None or math.isfinite(v) else str(v) for k, v in values.items()}

