"""Random state derived from (seed, rank, purpose, number).

Each step's random state is a pure function of the job's seed, the rank and
the step, reset at the start of the step. So the state of *any* rank at
*any* step can be rebuilt without shipping it anywhere: a replacement rank
continues the exact random stream of the rank it replaces, and a survivor that
rolls back to re-run a step draws the same numbers again. This is what makes
the losses with faults equal to the losses without, bit for bit.
"""

from __future__ import annotations

import hashlib
import random
import sys

import torch

__all__ = ["derived_seed", "reseed"]


def derived_seed(seed: int, rank: int, purpose: str, number: int) -> int:
    digest = hashlib.blake2b(
        f"{seed}/{rank}/{purpose}/{number}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def reseed(seed: int, rank: int, purpose: str, number: int) -> None:
    """Seed torch (CPU, and CUDA once in use), Python's ``random`` and NumPy if it is loaded.

    Not ``torch.manual_seed``: before CUDA is initialized it queues a lazy call
    and captures a stack trace every time, a few percent of a small step.
    """
    value = derived_seed(seed, rank, purpose, number)
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value & 0xFFFFFFFF)
