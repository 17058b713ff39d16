"""What a worker's process is started with: undying's own variables and torchrun's
(``torchrun_env.py``).

One named part of the agent. Every variable is derived at each start from the
agent as it is then (``EnvironmentSource``): its job settings and node number
(a standby given a node, an agent that took the manager's job dir), its
workers' channel's port, the manager's addresses. Never the token, never a
derived key inherited from the user: only those the agent hands on.
"""

from __future__ import annotations

import os
import socket
from typing import Protocol

from undying.agent.torchrun_env import TorchrunEnv
from undying.config import JobConfig
from undying.protocol import env as names
from undying.protocol.generations import GenerationRecord
from undying.protocol.keys import DERIVED_KEY_ENVS, child_environment

__all__ = ["WorkerEnvironment", "EnvironmentSource"]


class EnvironmentSource(Protocol):
    """The agent, whose settings, node number and manager's control port may change."""

    @property
    def config(self) -> JobConfig: ...

    @property
    def node(self) -> int: ...

    @property
    def control_port(self) -> int: ...

    @property
    def worker_port(self) -> int: ...


class WorkerEnvironment:
    def __init__(self, source: EnvironmentSource, *, key: str, manager_host: str,
                 extra_env: dict[str, str]) -> None:
        """``key``: what a local process must show on the workers' channel; ``manager_host``: the
        manager's address as this node reaches it ("": in this process); ``extra_env``: what this
        node's processes get beside undying's own (the job's derived keys, the interface toward the
        manager)."""
        self._source = source
        self.key = key
        self.manager_host = manager_host
        self.extra_env = extra_env
        # torchrun's variables, from the agent's config and node
        self._torchrun = TorchrunEnv(source)

    def base(self) -> dict[str, str]:
        """What every process of the node gets, spares included."""
        source = self._source
        config = source.config
        derived_keys = {k: v for k, v in self.extra_env.items() if k in DERIVED_KEY_ENVS}
        env = child_environment(os.environ, derived_keys)
        env.update(
            {
                names.JOB_ID_ENV: config.job_id,
                names.JOB_DIR_ENV: config.job_dir,
                names.AGENT_ADDR_ENV: f"127.0.0.1:{source.worker_port}",
                names.AGENT_PID_ENV: str(os.getpid()),
                names.AGENT_KEY_ENV: self.key,
                # What traces name this node by: its host, and with several nodes its rank too
                # (two agents may share a host name: pods of one node, test hosts).
                names.NODE_NAME_ENV: socket.gethostname() if config.nnodes == 1
                else f"{socket.gethostname()}/{source.node}",
            }
        )
        env.update(config.timeout_env())
        env.update(config.checkpoint.env(config.job_dir))
        env.update(config.trace.env(config.job_dir))
        for key, value in self.extra_env.items():
            env.setdefault(key, value)
        # gloo's warnings on a dead peer are expected
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env.update(self._torchrun.base(env))
        return env

    def rank(self, rank: int, record: GenerationRecord, joining: bool,
             resume_from: str = "", incarnation: int = 0) -> dict[str, str]:
        """What makes a process rank ``rank`` of ``record``'s generation: torchrun's variables and
        undying's."""
        source = self._source
        return {
            **self._torchrun.rank(rank, record, incarnation, self.manager_host),
            names.INCARNATION_ENV: str(incarnation),
            names.RESUME_FROM_ENV: resume_from,
            # The generation's store lives in the manager: across hosts, where this agent reached
            # it.
            names.STORE_ADDR_ENV: f"{self.manager_host or record.store_host}:{record.store_port}",
            names.CONTROL_ADDR_ENV:
                f"{self.manager_host or source.config.host}:{source.control_port}",
            names.GENERATION_ENV: str(record.generation),
            names.JOINING_ENV: "1" if joining else "0",
            names.BACKEND_ENV: source.config.backend,
            # (again: a standby's spare started before the manager gave its agent a node)
            names.NODE_NAME_ENV: self.base()[names.NODE_NAME_ENV],
        }
