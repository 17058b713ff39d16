"""The job's seed: one number that makes every process's setup the same.

``undying.init()`` seeds torch, Python's ``random`` and NumPy (when it can be
imported) before the script builds its dataset and model. Every rank, and a
replacement started mid-job, then draws the same numbers during setup, so a
replacement builds the same dataset and the same initial model as the rank it
replaces. The seed comes from ``undying.init(seed=...)``, else from
``undying run --seed`` (the ``UNDYING_SEED`` variable), else 0.
"""

from __future__ import annotations

import importlib
import os
import random
from collections.abc import Mapping

import torch

from undying.config import JobConfig
from undying.errors import UsageError
from undying.protocol.env import SEED_ENV

__all__ = ["seed_from_env", "seed_everything"]



def seed_from_env(env: Mapping[str, str] | None = None) -> int:
    """The seed ``undying run --seed`` passed, or 0; a value that is not a whole number >= 0 is
    refused."""
    raw = (os.environ if env is None else env).get(SEED_ENV, "").strip()
    if not raw:
        return JobConfig.seed  # (--seed's default, written on its field only)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"{SEED_ENV}={raw!r} is not a seed: give a whole number >= 0 "
                         "(undying run --seed N)")
    return value


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), Python's ``random`` and NumPy's global generator."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"undying.init(seed={seed!r}): the seed must be a whole number >= 0")
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        numpy = importlib.import_module("numpy")
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)
