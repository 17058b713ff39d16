"""In-place recovery for a LightningModule: ``Trainer(strategy=UndyingStrategy())``.

Lightning's Trainer owns the loop, but its Strategy owns what a step needs:
the process group, the DDP wrapper, and the optimizer step, inside which the
automatic optimization runs the whole step (``training_step``, ``backward``
with its all-reduce, the update) as a closure. So the step transaction wraps
``Strategy.optimizer_step``: a peer's fault aborts it, undying recovers in
place (the survivors keep their processes and state, the replacement gets
the state from a peer), and the closure runs again on the same batch. A
Callback could not do this: its hooks run around the step, never around the
closure, and an exception in the closure leaves the loop.

A replacement runs the script from its first line; its Trainer starts at the
loop's beginning. Until it reaches the step the survivors re-run, it passes
the batches without training on them (no ``training_step``, no collective, no
checkpoint written), so the loop's own counters, the sampler's epoch and the
LR schedulers' steps come out as in the run without the fault; at that step it
loads the state its peer sent and trains. A launch resumed from undying's
checkpoint (``undying run --resume``) does the same on every rank.

Lightning is imported here, never by ``import undying``: this module is for
scripts that use it (``pip install lightning``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy

from undying.errors import UsageError
from undying.protocol.env import JOB_ID_ENV
from undying.worker.ddp import GenerationalDDP
from undying.worker.job import Job, init
from undying.worker.state import State
from undying.worker.step import Step

__all__ = ["UndyingStrategy"]


class UndyingStrategy(DDPStrategy):
    """Lightning's DDP, with each optimizer step an undying step transaction.

    ``Trainer(accelerator=..., devices=<ranks per node>, strategy=UndyingStrategy())``
    and run the script with ``undying run``. Keyword arguments are DDPStrategy's
    (``find_unused_parameters=...``). Supported: automatic optimization, one
    optimizer, ``accumulate_grad_batches=1``, a run of known length
    (``max_epochs`` or ``max_steps``); anything else is refused as ``fit`` starts.
    """

    strategy_name = "undying"

    def __init__(self, **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        self._job: Job | None = None
        self._steps: Iterator[Step] | None = None
        self._resume_at = 0  # the step a replacement's (or a resumed launch's) state waits at
        self._entered = 0  # optimizer steps the loop entered (each is one step of the job)
        self._in_loop = False

    # --- joining the job ----------------------------------------------------

    def setup_environment(self) -> None:
        """Join the job (``undying.init()``): under ``undying run`` before Lightning looks for a
        process group (it finds the job's); under plain ``python`` or ``torchrun`` after Lightning
        made one (the job is then unmanaged: it trains without fault tolerance)."""
        if os.environ.get(JOB_ID_ENV):
            self._job = init()
            super().setup_environment()
        else:
            super().setup_environment()
            self._job = init()
        self._resume_at = self._job.ctx.waiting_step

    def _setup_model(self, model: torch.nn.Module) -> Any:
        """undying's DDP, rebuilt on every new process-group generation (``job.ddp``)."""
        return self._live().ddp(model, device_ids=self.determine_ddp_device_ids(),
                                **self._ddp_kwargs)

    def on_train_start(self) -> None:
        module = self.lightning_module
        if module is None:
            raise UsageError("UndyingStrategy started training without a LightningModule: "
                             "call trainer.fit(model)")
        trainer = module.trainer
        _check_supported(trainer)
        state = State(model=module, optimizer=trainer.optimizers[0])
        self._steps = iter(self._live().steps(state, total=int(trainer.estimated_stepping_batches)))
        self._in_loop = True
        super().on_train_start()

    def on_train_end(self) -> None:
        """The job's end: undying's last barrier and report (the step loop runs to its end)."""
        self._in_loop = False
        steps, self._steps = self._steps, None
        if steps is not None:
            extra = next(steps, None)
            if extra is not None:
                close = getattr(steps, "close", None)
                if close is not None:
                    close()
                raise UsageError(f"the Trainer stopped at step {extra.index - 1} of a run "
                                 "undying planned longer: with UndyingStrategy, end the run by "
                                 "max_epochs or max_steps (not early stopping or max_time)")
        super().on_train_end()

    def teardown(self) -> None:
        # Lightning's DDP teardown reads the live DDP's statistics; undying's wrapper may have none
        # (no step ran, or between generations): unwrap as it would.
        if isinstance(self.model, GenerationalDDP):
            self.model = self.lightning_module
        super().teardown()

    # --- the step transaction -------------------------------------------------

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        self._entered += 1
        if self._catching_up():
            closure()  # our training_step returns None: Lightning counts the batch, nothing trains
            return None
        steps = self._steps
        if steps is None:
            raise UsageError("UndyingStrategy's optimizer step ran outside Trainer.fit: "
                             "undying recovers training steps only (use trainer.fit)")
        while True:
            # The learning rate and the other hyperparameters are the loop's (its schedulers', its
            # hooks'), set for this step: a state loaded now carries those of its own moment.
            loops = [{k: v for k, v in group.items() if k != "params"}
                     for group in optimizer.param_groups]
            step = next(steps)  # (a replacement: the state its peer sent is loaded now)
            for group, values in zip(optimizer.param_groups, loops, strict=False):
                group.update(values)
            if step.index != self._entered:
                raise UsageError(f"undying is at step {step.index} but Lightning's loop at step "
                                 f"{self._entered}: the loop cannot be moved in place; run the "
                                 "job again to resume from its latest checkpoint")
            with step:
                # The closure (training_step, backward and its all-reduce) first: the optimizer's
                # step then only updates, and a fault in the closure leaves the state untouched.
                loss = closure()
                out = super().optimizer_step(optimizer, functools.partial(_given, loss), model,
                                             **kwargs)
                if self.global_rank == 0 and isinstance(out, torch.Tensor) and out.numel() == 1:
                    step.log(loss=out)
            if step.committed:
                return out

    # --- a replacement catching up with the loop --------------------------------

    def _catching_up(self) -> bool:
        """Before the step the job is at: this process passes the loop's batches untrained."""
        return self._resume_at > 0 and self._entered <= self._resume_at

    @property
    def world_size(self) -> int:
        # Lightning's loop broadcasts a flag before each batch when it sees more than one rank:
        # the peers sent theirs for these batches long ago.
        if self._in_loop and self._catching_up():
            return 1
        return int(super().world_size)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._catching_up():
            return None
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._catching_up():
            return None
        return super().validation_step(*args, **kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._catching_up():
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._catching_up() else super().broadcast(obj, src)

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor if self._catching_up() else super().reduce(tensor, *args, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        if not self._catching_up():  # its model is not the job's yet
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        if not self._catching_up():
            super().remove_checkpoint(filepath)

    def _live(self) -> Job:
        if self._job is None:
            raise UsageError("UndyingStrategy is used before Lightning set up its environment: "
                             "pass it to Trainer(strategy=...) and call trainer.fit")
        return self._job


def _given(value: Any) -> Any:
    """The closure the optimizer calls: the loss of the closure already run."""
    return value


def _check_supported(trainer: Any) -> None:
    """What the transaction covers, checked once as ``fit`` starts: one line each, by name."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise UsageError("UndyingStrategy needs automatic optimization: manual optimization "
                         "(self.automatic_optimization = False) steps outside the transaction")
    if len(trainer.optimizers) != 1:
        raise UsageError(f"UndyingStrategy takes one optimizer, configure_optimizers gave "
                         f"{len(trainer.optimizers)}")
    if isinstance(trainer.optimizers[0], torch.optim.LBFGS):
        raise UsageError("UndyingStrategy runs the closure once per step, before the optimizer's "
                         "step; LBFGS evaluates it several times: use another optimizer")
    if trainer.accumulate_grad_batches != 1:
        raise UsageError(f"UndyingStrategy needs accumulate_grad_batches=1 (got "
                         f"{trainer.accumulate_grad_batches}): the batches accumulated before a "
                         "fault would be lost")
    total = trainer.estimated_stepping_batches
    if total == float("inf") or total < 1:
        raise UsageError(f"UndyingStrategy needs a run of known length (max_epochs or max_steps); "
                         f"the Trainer plans {total} steps")
