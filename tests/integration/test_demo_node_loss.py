"""``undying demo --fault node-loss --json`` end to end: the demo's own process, its own hosts, the contract.

The demo makes its network-namespace hosts itself, runs the 2 nodes x 2 ranks
job on them, loses node 1's host mid-run and brings a new one; this checks
the one JSON object it prints (identical losses, nothing lost, both of node
1's ranks replaced and recovered after a node loss) and that it left no host
behind. Where namespaces cannot be made the test skips with the reason (the
refusal itself is tested in tests/unit/test_demo_node_loss.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.netns import NETNS_DIR, netns_pids, our_namespaces, requires_netns
from undying.demo.node_loss import LOST_RANKS

pytestmark = requires_netns

DEMO_TIMEOUT_S = 240  # the demo bounds its own runs; this only stops a stuck demo
EPOCHS = 1  # 32 steps, node 1's host lost at step 15: the smallest job with a loss mid-run


def test_demo_node_loss_recovers_on_a_new_host_and_keeps_every_step(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "undying", "demo", "--fault", "node-loss", "--json", "--epochs", str(EPOCHS)]
    demo = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        out, err = demo.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop(demo)
        raise AssertionError(f"undying demo --fault node-loss did not end within {DEMO_TIMEOUT_S}s") from None
    finally:
        left = our_namespaces(demo.pid)
        _remove_hosts_of(demo.pid)
    assert not left, f"the demo left its test hosts behind: {left}"
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line on stdout, got: {out!r}\nstderr:\n{err}"
    result = json.loads(lines[0])
    context = f"{json.dumps(result, indent=1)}\nstderr:\n{err[-6000:]}"
    assert demo.returncode == 0, context
    assert result["fault"] == "node-loss" and result["ok"] is True and result["reasons"] == [], context
    assert result["identical"] is True and result["final_state_identical"] is True, context
    assert result["lost_steps"] == 0 and result["steps"] == 32 * EPOCHS and result["ranks"] == 4, context
    assert result["exit_codes"] == {"fault_free": 0, "with_fault": 0}, context
    lost = [i for i in result["incidents"] if i["kind"] == "node-loss"]
    assert sorted(i["rank"] for i in lost) == LOST_RANKS, context
    for incident in lost:
        assert incident["action"] == "replace" and incident["status"] == "recovered", context
        assert incident["mttr_s"] is not None and incident["mttr_s"] > 0, context
        assert incident["phases"]["first_step_done"] >= incident["phases"]["detected"], context
    assert "node 1's host" in err and "lost" in err, err


def _stop(demo: subprocess.Popen[str]) -> None:
    """SIGTERM first (the demo then removes its hosts and their processes), SIGKILL by PID if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(demo.pid, signal.SIGTERM)
    try:
        demo.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(demo.pid, signal.SIGKILL)
        demo.communicate(timeout=10)


def _remove_hosts_of(owner: int) -> None:
    """After a demo that could not clean up: kill by PID whatever runs in its namespaces, delete them."""
    for name in our_namespaces(owner):
        for pid in netns_pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if os.path.exists(os.path.join(NETNS_DIR, name)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
