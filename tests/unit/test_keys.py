"""The job's secrets in process environments (``undying.protocol.keys``), and a stale key left in the shell.

A worker's, spare's or zygote's environment holds the agent's derived keys and
never the token; a launcher refuses derived keys that no agent of an
enclosing job put in its environment (a real process tree tells which), in
one line, exit 2, before anything is created.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from undying.checkpoint.mac import CHECKPOINT_KEY_ENV as KEY_ENV
from undying.protocol.env import AGENT_PID_ENV, CHECKPOINT_KEY_ENV, STORE_KEY_ENV, TOKEN_ENV
from undying.protocol.keys import (
    child_environment,
    inherited_key_problem,
    started_by_an_agent,
)
from undying.protocol.store_wire import STORE_KEY_ENV as WIRE_STORE_KEY_ENV


def test_the_names_are_the_ones_the_workers_read() -> None:
    assert CHECKPOINT_KEY_ENV == KEY_ENV and STORE_KEY_ENV == WIRE_STORE_KEY_ENV


def test_a_child_gets_the_agents_keys_and_never_the_token_or_an_inherited_key() -> None:
    inherited = {TOKEN_ENV: "t0k3n", CHECKPOINT_KEY_ENV: "stale", STORE_KEY_ENV: "stale", "PATH": "/bin"}
    env = child_environment(inherited, {CHECKPOINT_KEY_ENV: "aa" * 32})
    assert env == {"PATH": "/bin", CHECKPOINT_KEY_ENV: "aa" * 32}
    with pytest.raises(ValueError, match=TOKEN_ENV):
        child_environment({}, {TOKEN_ENV: "t0k3n"})


def test_keys_from_an_agent_that_is_an_ancestor_are_not_refused() -> None:
    """A real process tree: this process plays the agent, a grandchild looks up its ancestors."""
    env = {**os.environ, AGENT_PID_ENV: str(os.getpid()), CHECKPOINT_KEY_ENV: "aa" * 32}
    code = ("import os, sys; from undying.protocol.keys import inherited_key_problem as p; "
            "sys.exit(0 if p(os.environ) is None else 3)")
    nested = [sys.executable, "-c", f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {code!r}]))"]
    assert subprocess.run(nested, env=env, timeout=60).returncode == 0
    assert started_by_an_agent({AGENT_PID_ENV: str(os.getppid())})


def test_keys_in_a_copied_environment_are_refused() -> None:
    # Names a live process that is no ancestor (a sibling), or a dead one, or none at all.
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for agent in (str(sibling.pid), "999999999", "", "1"):
            env = {AGENT_PID_ENV: agent, STORE_KEY_ENV: "bb" * 32}
            problem = inherited_key_problem(env)
            assert problem is not None and STORE_KEY_ENV in problem and "unset" in problem, agent
    finally:
        sibling.kill()
        sibling.wait()
    assert inherited_key_problem({TOKEN_ENV: "a token is how a launcher gets its keys"}) is None


@pytest.mark.parametrize("name", [CHECKPOINT_KEY_ENV, STORE_KEY_ENV])
def test_a_launch_with_a_stale_key_in_the_shell_is_one_line_exit_2_and_creates_nothing(
        tmp_path: Path, name: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    env = {k: v for k, v in os.environ.items() if k not in (CHECKPOINT_KEY_ENV, STORE_KEY_ENV, AGENT_PID_ENV)}
    env[name] = "cc" * 32
    run = subprocess.run([sys.executable, "-m", "undying", "run", "-n", "1", "--job-dir", str(tmp_path / "job"),
                          str(script)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("undying: error: ") and name in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "job").exists() and not (tmp_path / "undying-jobs").exists()
