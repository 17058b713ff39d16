"""The environment contract: the prefix of every variable undying sets for the processes it starts.

The torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) keep
their names; undying's own all start with ``UNDYING_``, so a script's
environment shows at a glance which are ours, and the agent can pass them on
or drop them as a whole.
"""

from __future__ import annotations

__all__ = ["ENV_PREFIX", "SEED_ENV", "VIRTUAL_RANKS_ENV"]

ENV_PREFIX = "UNDYING_"
# The job's seed (`undying run --seed`), which undying.init() seeds torch, random and NumPy from.
SEED_ENV = f"{ENV_PREFIX}SEED"
# undying run --virtual-ranks V, for the workers (undying.worker.virtual): invariant mode.
VIRTUAL_RANKS_ENV = f"{ENV_PREFIX}VIRTUAL_RANKS"
