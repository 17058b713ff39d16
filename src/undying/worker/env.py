"""What the agent tells a worker through its environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from undying.config import (
    CheckpointConfig,
    JobConfig,
    Timeouts,
    TraceConfig,
    checkpoint_from_env,
    timeouts_from_env,
    trace_from_env,
)
from undying.errors import UsageError
from undying.inputs import env_value
from undying.protocol.env import (
    AGENT_ADDR_ENV,
    BACKEND_ENV,
    CONTROL_ADDR_ENV,
    GENERATION_ENV,
    INCARNATION_ENV,
    JOB_ID_ENV,
    JOINING_ENV,
    RESUME_FROM_ENV,
    STORE_KEY_ENV,
)
from undying.protocol.store_wire import key_from_environ

__all__ = ["WorkerEnv"]


@dataclass(frozen=True)
class WorkerEnv:
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    control_host: str
    control_port: int
    agent_host: str
    agent_port: int
    generation: int
    joining: bool
    backend: str
    timeouts: Timeouts
    checkpoint: CheckpointConfig
    # A checkpoint to start from (a fresh start of a job that has one, or a whole-job restart).
    resume_from: str = ""
    trace: TraceConfig = TraceConfig()
    # The manager's number for this process as the holder of its rank (0: not fenced).
    incarnation: int = 0
    # What proves to the manager's stores that this process is the job's (see
    # undying.protocol.store_wire).
    store_key: bytes = b""

    @classmethod
    def from_environ(cls) -> WorkerEnv | None:
        """None when this process was not started by ``undying run``."""
        env = os.environ
        if CONTROL_ADDR_ENV not in env:
            return None
        control_host, control_port = env[CONTROL_ADDR_ENV].rsplit(":", 1)
        agent_host, agent_port = env[AGENT_ADDR_ENV].rsplit(":", 1)
        return cls(
            job_id=env[JOB_ID_ENV],
            rank=int(env["RANK"]),
            local_rank=int(env["LOCAL_RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            control_host=control_host,
            control_port=int(control_port),
            agent_host=agent_host,
            agent_port=int(agent_port),
            generation=int(env[GENERATION_ENV]),
            joining=env.get(JOINING_ENV, "0") == "1",
            backend=env.get(BACKEND_ENV, JobConfig.backend),
            timeouts=timeouts_from_env(env),
            checkpoint=checkpoint_from_env(env),
            resume_from=env.get(RESUME_FROM_ENV, ""),
            trace=trace_from_env(env),
            incarnation=int(env_value(INCARNATION_ENV, env) or 0),
            store_key=_store_key(env),
        )


def _store_key(env: Mapping[str, str]) -> bytes:
    key = key_from_environ(env)
    if key is None:
        raise UsageError(f"env {STORE_KEY_ENV} is not set: "
                         "this process was not started by undying's agent "
                         "(run the script with `undying run`, or without the UNDYING_* variables)")
    return key
