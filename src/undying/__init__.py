"""undying: distributed PyTorch training that survives faults without losing work.

In a training script::

    job = undying.init()
    ddp = job.ddp(model)
    state = job.state(model=model, optimizer=opt, loader=loader)
    for step in job.steps(state, epochs=3):
        with step:
            ...

Run it with ``undying run -n 4 train.py``.

The worker API is imported on first use (PEP 562): ``import undying`` stays
cheap for the command-line tools, which need neither torch nor the worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.worker import Job, Numerics, State, Step, init

__version__ = "0.1.0"
__all__ = ["init", "Job", "State", "Step", "Numerics", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("init", "Job", "State", "Step", "Numerics"):
        import undying.worker

        return getattr(undying.worker, name)
    raise AttributeError(f"module 'undying' has no attribute {name!r}")
