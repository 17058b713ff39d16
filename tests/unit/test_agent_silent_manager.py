"""An agent whose manager is stopped for good (SIGSTOP) stops within its --rendezvous-timeout.

A stopped process's listening socket still completes connections into its queue, so the agent's
connect succeeds and only the reply never comes: the agent must judge that silence as it judges
an unreachable manager, not reconnect forever. The manager here is a real listening socket that
nobody accepts on, exactly what a stopped manager leaves.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from undying.agent.remote import NodeRunner
from undying.config import JobConfig
from undying.config.timeouts import Timeouts


def test_an_agent_stops_when_its_manager_accepts_connections_but_never_answers(tmp_path: Path) -> None:
    stopped = socket.socket()
    stopped.bind(("127.0.0.1", 0))
    stopped.listen(64)  # never accepted: the kernel completes the handshakes
    port = stopped.getsockname()[1]
    config = JobConfig(job_id="job-1", job_dir=str(tmp_path), nnodes=2, node_rank=1,
                       timeouts=Timeouts(rendezvous_timeout=2.0, heartbeat_timeout=1.0))
    runner = NodeRunner(config, "train.py", [], f"127.0.0.1:{port}", "t" * 32)

    async def serve() -> int:
        ticking = asyncio.ensure_future(runner.clock.keep_ticking())
        try:
            # (a bound for the test itself: before the fix the agent reconnected for ever)
            return await asyncio.wait_for(runner._serve(), 60.0)
        finally:
            ticking.cancel()

    try:
        assert asyncio.run(serve()) == 1
    finally:
        stopped.close()
        asyncio.run(runner.agent.close())
