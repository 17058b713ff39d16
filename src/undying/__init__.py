"""undying: distributed PyTorch training that survives faults without losing work.

In a training script::

    job = undying.init()
    ddp = job.ddp(model)
    state = job.state(model=model, optimizer=opt, loader=loader)
    for step in job.steps(state, epochs=3):
        with step:
            ...

Run it with ``undying run -n 4 train.py``.
"""

from undying.worker import Job, State, Step, init

__version__ = "0.1.0"
__all__ = ["init", "Job", "State", "Step", "__version__"]
