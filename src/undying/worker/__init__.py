"""The worker library: imported by the user's training script."""

from undying.worker.job import Job, Step, init
from undying.worker.state import State

__all__ = ["init", "Job", "Step", "State"]
