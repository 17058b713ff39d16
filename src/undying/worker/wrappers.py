"""What frameworks wrap around the optimizer and the loader, as ``undying.State`` takes them.

accelerate (``accelerator.prepare``) and Lightning (``self.optimizers()``)
hand the script a wrapper around the torch optimizer it built. The wrapper
holds no state of its own (its ``state_dict`` is the inner optimizer's), but
it is no complete ``torch.optim.Optimizer`` either (accelerate's never calls
the base class's ``__init__``, so it has no step hooks): the state declares
the optimizer inside it. A wrapper whose state no single rank can restore
faithfully is refused, in one line that says why and what to pass: torch's
``ZeroRedundancyOptimizer`` keeps each rank's part of the optimizer state
only on that rank (its ``state_dict`` needs a collective first), and so do
DeepSpeed's ZeRO optimizers.

A loader prepared by accelerate synchronises the ranks' random states with a
collective when its iterator starts; a replacement replaying the epoch alone
would wait in it for ranks that never come. undying resets the loader's
generators per epoch from their seeds and the random state per step (see
``data`` and ``rng``), identically on every rank and in a replay, so the
synchronisation is redundant there and is switched off (``rng_types``). A loader
that sends every batch from rank 0 (accelerate's ``dispatch_batches``) cannot
be replayed on one rank at all and is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from undying.errors import StateError

__all__ = ["loader_for_state", "optimizer_for_state", "watch_optimizer_steps"]

log = logging.getLogger(__name__)

# (module prefix, class name) -> the attribute that holds the wrapped optimizer
_UNWRAP = {
    ("accelerate", "AcceleratedOptimizer"): "optimizer",
    ("lightning", "LightningOptimizer"): "_optimizer",
    ("pytorch_lightning", "LightningOptimizer"): "_optimizer",
}

_PARTITIONED = "keeps each rank's part of the optimizer state on that rank only"
# (module prefix, class name prefix) -> why it is refused
_REFUSED = {
    ("torch.distributed.optim", "ZeroRedundancyOptimizer"):
        f"{_PARTITIONED} (its state_dict() needs consolidate_state_dict() on every rank first)",
    ("deepspeed", "DeepSpeedZeroOptimizer"): _PARTITIONED,
    ("deepspeed", "DeepSpeedOptimizer"): _PARTITIONED,
}


def _is(obj: Any, module: str, name: str, *, prefix: bool = False) -> bool:
    for cls in type(obj).__mro__:
        if (cls.__module__ == module or cls.__module__.startswith(module + ".")) \
                and (cls.__name__.startswith(name) if prefix else cls.__name__ == name):
            return True
    return False


def optimizer_for_state(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer ``State(optimizer=...)`` holds: framework wrappers unwrapped (nested
    ones too), wrappers that cannot be restored faithfully refused, anything else checked."""
    for _ in range(8):  # a wrapper of a wrapper, and never a loop
        if optimizer is None:
            return None
        for (module, name), why in _REFUSED.items():
            if _is(optimizer, module, name, prefix=True):
                raise StateError(
                    f"State(optimizer=...) got a {type(optimizer).__name__}, which {why}: a "
                    "replacement could not be given its state by one peer; pass a plain torch "
                    "optimizer (torch.optim.AdamW ...) and shard with FSDP2 fully_shard if memory "
                    "is short")
        inner = next((getattr(optimizer, attr, None) for (module, name), attr in _UNWRAP.items()
                      if _is(optimizer, module, name)), None)
        if inner is None:
            break
        optimizer = inner
    hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or not isinstance(hooks, dict):
        raise StateError(
            f"State(optimizer=...) got a {type(optimizer).__name__}, which is not a working "
            "torch.optim.Optimizer (undying needs its state_dict() and its step hooks); pass the "
            "torch optimizer it wraps")
    return optimizer


def loader_for_state(loader: Any) -> Any:
    """The loader as undying replays it: one that cannot be replayed on one rank refused, and a
    collective its iterator would run (accelerate's random-state synchronisation) switched off."""
    if loader is None:
        return None
    if _is(loader, "accelerate", "DataLoaderDispatcher"):
        raise StateError(
            "State(loader=...) got accelerate's DataLoaderDispatcher, which sends every batch from "
            "rank 0 with a collective: a replacement replaying its epoch alone would wait for "
            "ranks that never come; prepare the loader with "
            "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))")
    if _is(loader, "accelerate", "DataLoaderShard") and getattr(loader, "rng_types", None):
        log.info("the loader's random-state synchronisation across ranks (accelerate's rng_types "
                 "%s) is switched off: undying resets its generators per epoch and the random "
                 "state per step on every rank, and a replacement replays the loader alone",
                 loader.rng_types)
        loader.rng_types = None
    return loader


def watch_optimizer_steps(optimizer: torch.optim.Optimizer, hook: Callable[..., None]) -> None:
    """``hook`` before each of the optimizer's steps; one that cannot take it is the script's
    state, not a fault: a ``StateError`` that fails the job at once."""
    try:
        optimizer.register_step_pre_hook(hook)
    except Exception as e:
        raise StateError(
            f"undying cannot watch the steps of the optimizer given to job.state "
            f"({type(optimizer).__name__}: {type(e).__name__}: {e}); pass the "
            "torch.optim.Optimizer it wraps") from e
