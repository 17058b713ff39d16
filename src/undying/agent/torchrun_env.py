"""The environment a worker sees: torchrun's, variable for variable, plus undying's own
(``UNDYING_*``).

A script written for torchrun reads the same names with the same meanings:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT and the
TORCHELASTIC_* variables. Two differ on purpose and say so:

- ``TORCHELASTIC_USE_AGENT_STORE`` is ``False``: the job's own stores only
  answer a process that proves the job's key, so a script that builds a store
  itself on MASTER_ADDR:MASTER_PORT hosts it on rank 0 (as under torchrun's
  static rendezvous). MASTER_ADDR is loopback on one node, and MASTER_PORT a
  free port, new for each generation (a whole-group restart gets a fresh one).
  ``init_process_group("env://")`` does not use it: the worker's boot points
  that at the job's authenticated store (``UNDYING_STORE_ADDR``).
- ``TORCHELASTIC_RESTART_COUNT`` counts the job's generations: 0 at the first
  start, more after any recovery (a whole-group restart is one).

``TORCHELASTIC_ERROR_FILE`` is a file in the process's own folder of the job
dir; the manager reads it back when the rank fails (torchrun's ``@record``
writes the traceback there), and puts the traceback in the failure report.

One source of truth: every variable is derived, at each spawn, from the
agent's own ``config`` and ``node`` (``EnvSource``), never from a copy taken
when the agent started. An agent that learns its job dir from the manager (a
multi-node agent started without ``--job-dir``) or its node number (a warm
standby given a lost node) changes those two, and its next ranks see exactly
what a rank of that node sees.
"""

from __future__ import annotations

import os
import shutil
import socket
from typing import Protocol

from undying.config import ERROR_FILE, RETURNED_FILE, JobConfig, worker_dir
from undying.protocol.env import (
    CONSOLE_ENV,
    LOG_DIR_ENV,
    REDIRECTS_ENV,
    RETURNED_FILE_ENV,
    SEED_ENV,
    TEE_ENV,
)
from undying.protocol.generations import GenerationRecord

__all__ = ["TorchrunEnv", "EnvSource"]

# torchrun's default --signals-to-handle (what its @record and elastic handlers read).
_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
_MULTI_NODE_MASTER_PORT = 29500


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EnvSource(Protocol):
    """Where the environment comes from: the agent, whose job settings and node number may
    change."""

    @property
    def config(self) -> JobConfig: ...

    @property
    def node(self) -> int: ...


class TorchrunEnv:
    """The torchrun variables of one node's workers (the agent adds undying's own beside them)."""

    def __init__(self, source: EnvSource) -> None:
        self._source = source
        self._ports: dict[int, int] = {}  # generation -> MASTER_PORT (one node: a free port each)

    @property
    def config(self) -> JobConfig:
        return self._source.config

    @property
    def node(self) -> int:
        return self._source.node

    def base(self, inherited: dict[str, str]) -> dict[str, str]:
        """What every process of the node gets, spares included (``inherited``: the agent's own
        environment)."""
        env = {SEED_ENV: str(self.config.seed), "TORCHELASTIC_RUN_ID": self.config.job_id,
               "TORCHELASTIC_MAX_RESTARTS": str(self.config.max_restarts)}
        defaults = {"TORCHELASTIC_SIGNALS_TO_HANDLE": _SIGNALS,
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
        if self.config.nproc_per_node > 1:
            # torchrun's rule: several workers on a node, one thread each
            defaults["OMP_NUM_THREADS"] = "1"
        env.update({k: v for k, v in defaults.items() if k not in inherited})
        return env

    def master(self, generation: int, manager_host: str) -> tuple[str, int]:
        """MASTER_ADDR and MASTER_PORT: where rank 0 of a script that hosts its own store puts
        it."""
        launch = self.config.launch
        several = self.config.nnodes > 1
        addr = launch.master_addr or (manager_host if several and manager_host else "127.0.0.1")
        if launch.master_port:
            return addr, launch.master_port
        if several:
            return addr, _MULTI_NODE_MASTER_PORT
        port = self._ports.get(generation)
        if port is None:
            port = self._ports[generation] = _free_port(
                addr if addr != "localhost" else "127.0.0.1")
            for old in [g for g in self._ports if g < generation - 8]:
                del self._ports[old]
        return addr, port

    def rank(self, rank: int, record: GenerationRecord, incarnation: int,
             manager_host: str) -> dict[str, str]:
        """torchrun's variables for ``rank`` in ``record``'s generation, and the process's files."""
        config = self.config
        local = rank % config.nproc_per_node
        addr, port = self.master(record.generation, manager_host)
        folder = worker_dir(config.job_dir, rank, incarnation)
        shutil.rmtree(folder, ignore_errors=True)  # (a job dir run again starts its count again)
        os.makedirs(folder, exist_ok=True)
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(record.world_size),
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "GROUP_RANK": str(self.node),
            "GROUP_WORLD_SIZE": str(max(1, record.world_size // config.nproc_per_node)),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(record.world_size),
            "ROLE_NAME": config.launch.role,
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_RESTART_COUNT": str(record.generation),
            "TORCHELASTIC_ERROR_FILE": os.path.join(folder, ERROR_FILE),
            RETURNED_FILE_ENV: os.path.join(folder, RETURNED_FILE),
        }
        env.update(self._streams(local, record.generation))
        return env

    def _streams(self, local: int, generation: int) -> dict[str, str]:
        launch = self.config.launch
        filtered_out = launch.local_ranks_filter and local not in launch.local_ranks_filter
        env = {CONSOLE_ENV: "0" if filtered_out else "1"}
        redirects, tee = launch.streams(local, launch.redirects), launch.streams(local, launch.tee)
        if (redirects or tee) and launch.log_dir:
            env[LOG_DIR_ENV] = os.path.join(os.path.abspath(launch.log_dir), self.config.job_id,
                                            f"attempt_{generation}", str(local))
            env[REDIRECTS_ENV] = str(redirects)
            env[TEE_ENV] = str(tee)
        return env
