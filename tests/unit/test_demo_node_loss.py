"""``undying demo --fault node-loss``: the refusal where test hosts cannot be made, and its incident check.

Where namespaces cannot be made the demo says why in one line and exits 2
before running anything. That is run for real where it can be: the CLI as
user ``nobody`` (``setpriv``), who cannot make network namespaces. The
messages are checked for any uid and a missing ``ip`` through
``netns_missing``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from undying.demo.namespaces import netns_missing
from undying.demo.node_loss import check_incidents


def test_not_root_says_run_as_root() -> None:
    reason = netns_missing(1000, "/usr/sbin/ip")
    assert reason is not None and "uid 1000" in reason and "run it as root" in reason


def test_no_ip_says_install_iproute2() -> None:
    reason = netns_missing(0, None)
    assert reason is not None and "`ip`" in reason and "install iproute2" in reason


def test_root_with_ip_is_not_ruled_out() -> None:
    assert netns_missing(0, "/usr/sbin/ip") is None


def _as_nobody() -> list[str]:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the CLI as user nobody (here the test runs as "
                    f"uid {os.geteuid()}, setpriv {'found' if setpriv else 'not found'})")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody on this machine to run the CLI as")
    return [setpriv, f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]


@pytest.mark.parametrize("as_json", [False, True])
def test_the_cli_as_nobody_refuses_in_one_line_and_runs_nothing(tmp_path: Path, as_json: bool) -> None:
    prefix = _as_nobody()
    os.chmod(tmp_path, 0o777)  # nobody's working directory
    argv = [*prefix, sys.executable, "-m", "undying", "demo", "--fault", "node-loss", *(["--json"] if as_json else [])]
    env = {**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert time.monotonic() - started < 30, "it must refuse before running any job"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("undying: error: demo --fault node-loss cannot run here:"), lines[0]
    assert "run it as root" in lines[0] and f"uid {pwd.getpwnam('nobody').pw_uid}" in lines[0], lines[0]
    assert not list(tmp_path.glob("undying-demo-*")), "no job dir may be made before the refusal"
    if as_json:
        result = json.loads(done.stdout)
        assert result["ok"] is False and result["fault"] == "node-loss", result
        assert "run it as root" in result["unavailable"] and any("run it as root" in r for r in result["reasons"])
        assert {"identical", "steps", "lost_steps", "incidents", "ranks", "final_state_identical", "exit_codes",
                "wall_s"} <= set(result), result
    else:
        assert done.stdout == "", done.stdout


def _incident(rank: int, action: str = "replace", status: str = "recovered", kind: str = "node-loss") -> dict:
    return {"kind": kind, "rank": rank, "action": action, "status": status}


def test_both_lost_ranks_replaced_and_recovered_pass() -> None:
    assert check_incidents([_incident(3), _incident(2), _incident(0, kind="crash")]) == []


def test_a_missing_or_unrecovered_node_loss_incident_is_named() -> None:
    assert check_incidents([_incident(2)]) == ["node-loss incidents name ranks [2], not node 1's ranks [2, 3]"]
    assert check_incidents([]) == ["node-loss incidents name ranks [], not node 1's ranks [2, 3]"]
    assert check_incidents([_incident(2), _incident(3, action="restart", status="failed")]) == [
        "rank 3's node-loss incident is restart/failed, not replace/recovered"]
