"""A multi-node job on test hosts: the manager on host 0, each node's agent on a host of its own.

Used by ``undying demo --fault node-loss`` and the multi-node tests. The hosts
are anything with ``popen(i, argv, **kw)``, ``addr(i)`` and ``inside(i)``
(network namespaces in practice: ``undying.demo.hosts``). Every process is
started through the hosts, so losing a host kills what ran there.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from undying.cli.client import api_get, api_post
from undying.demo import TRAIN_SCRIPT
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.tokens import TOKEN_FILE

__all__ = ["Cluster", "TestHosts"]


class TestHosts(Protocol):
    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]: ...

    def addr(self, i: int) -> str: ...

    def inside(self, i: int) -> contextlib.AbstractContextManager[None]: ...


class Cluster:
    """One job: ``undying manager`` on host ``manager_host``, agents started with
    ``start_agent``."""

    def __init__(self, hosts: TestHosts, root: Path, job_id: str, script_args: Sequence[str], *,
                 nnodes: int = 2, nproc_per_node: int = 2, run_args: Sequence[str] = (),
                 min_nodes: int = 0, manager_host: int = 0, port: int = 29400,
                 script: Path = TRAIN_SCRIPT) -> None:
        self.hosts = hosts
        self.root = root
        self.job_id = job_id
        self.job_dir = root / job_id
        self.script_args = list(script_args)
        self.run_args = list(run_args)
        self.nnodes = nnodes
        self.min_nodes = min_nodes  # with one, the job is elastic: --nnodes MIN:MAX
        self.nproc_per_node = nproc_per_node
        self.manager_host = manager_host
        self.port = port
        self.script = script
        self.manager: subprocess.Popen[bytes] | None = None
        self.agents: dict[int, subprocess.Popen[bytes]] = {}  # node -> its latest agent
        # host -> a standby agent started there
        self.standbys: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []
        self._starts = 0

    # --- processes ------------------------------------------------------------

    def _log(self, name: str) -> Any:
        f = open(self.root / f"{self.job_id}.{name}.log", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(f)
        return f

    def start_manager(self, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """Start (or restart, on the same job dir) the manager; returns once its token exists."""
        self._starts += 1
        argv = [sys.executable, "-m", "undying", "-v", "manager", "--job-id", self.job_id,
                "--job-dir", str(self.job_dir), "--host", self.hosts.addr(self.manager_host),
                "--port", str(self.port), *extra]
        log = self._log("manager")
        manager = self.hosts.popen(self.manager_host, argv, stdout=log, stderr=subprocess.STDOUT)
        self.manager = manager
        wait_for(lambda: (self.job_dir / TOKEN_FILE).exists() or manager.poll() is not None, 60,
                 "the manager's token")
        if manager.poll() is not None:
            raise RuntimeError(f"the manager exited ({manager.returncode}): "
                               f"{self.log('manager')[-2000:]}")
        return manager

    def start_agent(self, node: int, host: int,
                    extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        process = self.hosts.popen(host, self._agent_argv(node, extra),
                                   stdout=self._log(f"node{node}"), stderr=subprocess.STDOUT)
        self.agents[node] = process
        return process

    def _agent_argv(self, node: int, extra: Sequence[str]) -> list[str]:
        nnodes = f"{self.min_nodes}:{self.nnodes}" if self.min_nodes else str(self.nnodes)
        return [sys.executable, "-m", "undying", "-v", "run", "--nnodes", nnodes,
                *(["--node-rank", str(node)] if node >= 0 else []),
                "--manager", f"{self.hosts.addr(self.manager_host)}:{self.port}",
                "-n", str(self.nproc_per_node), "--job-id", self.job_id,
                "--token-file", str(self.job_dir / TOKEN_FILE), "--stop-grace", "3",
                *self.run_args, *extra, str(self.script), *self.script_args]

    def start_standby(self, host: int, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """A warm standby agent (``--standby``) on ``host``; its log is ``standby<host>``."""
        process = self.hosts.popen(host, self._agent_argv(-1, ["--standby", *extra]),
                                   stdout=self._log(f"standby{host}"), stderr=subprocess.STDOUT)
        self.standbys[host] = process
        return process

    def start(self) -> None:
        """The manager on its host, node i's agent on host i + 1."""
        self.start_manager()
        for node in range(self.nnodes):
            self.start_agent(node, node + 1)

    def wait(self, timeout: float) -> int:
        """The manager's exit code once the job ended; every agent exits with it."""
        assert self.manager is not None
        try:
            code = self.manager.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the job did not end within {timeout}s; manager log:\n"
                                 f"{self.log('manager')[-4000:]}") from None
        for agent in [*self.agents.values(), *self.standbys.values()]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=15)
        return code

    def close(self) -> None:
        for f in self._logs:
            f.close()

    def log(self, name: str) -> str:
        path = self.root / f"{self.job_id}.{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        names = ["manager", *(f"node{n}" for n in range(self.nnodes))]
        return "\n".join(f"===== {n}\n{self.log(n)[-3000:]}" for n in names)

    # --- the API, called from the manager's host ------------------------------

    @property
    def token(self) -> str:
        return (self.job_dir / TOKEN_FILE).read_text().strip()

    def url(self, timeout: float = 60) -> str:
        return str(wait_for(lambda: (JobDir(self.job_dir).read_manager() or {}).get("url"),
                            timeout, "the manager's API"))

    def status(self) -> dict[str, Any]:
        with self.hosts.inside(self.manager_host):
            return dict(api_get(self.url(), "/api/status", token=self.token))

    def inject(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.hosts.inside(self.manager_host):
            return dict(api_post(self.url(), "/api/inject", body, token=self.token))

    def wait_for_step(self, step: int, timeout: float = 90) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            with contextlib.suppress(Exception):
                status = self.status()
                if status["state"] == "running" and status["step"] >= step:
                    return status
            return None

        return dict(wait_for(reached, timeout, f"the job to reach step {step}"))


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
