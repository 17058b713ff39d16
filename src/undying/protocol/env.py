"""The environment contract: the prefix of every variable undying sets for the processes it starts.

The torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) keep
their names; undying's own all start with ``UNDYING_``, so a script's
environment shows at a glance which are ours, and the agent can pass them on
or drop them as a whole.
"""

from __future__ import annotations

__all__ = ["ENV_PREFIX", "SEED_ENV", "VIRTUAL_RANKS_ENV", "NUMERICS_ENV", "AGENT_PID_ENV"]

ENV_PREFIX = "UNDYING_"
# The job's seed (`undying run --seed`), which undying.init() seeds torch, random and NumPy from.
SEED_ENV = f"{ENV_PREFIX}SEED"
# undying run --virtual-ranks V, for the workers (undying.worker.virtual): invariant mode.
VIRTUAL_RANKS_ENV = f"{ENV_PREFIX}VIRTUAL_RANKS"
# undying run --numerics POLICY [--spike-factor F] [--rollback-steps N], for the workers
# (undying.worker.numerics): the default of job.steps(numerics=...), as comma-separated field=value
# pairs of undying.Numerics (on_persistent, spike_factor, window, warmup, rollback_steps).
NUMERICS_ENV = f"{ENV_PREFIX}NUMERICS"
# The agent that started a worker: its parent-death target, and the mark by which the agent knows a
# process a rank left behind as its own to end (agent/children.py).
AGENT_PID_ENV = f"{ENV_PREFIX}AGENT_PID"
