"""The agent's own children (agent/children.py), with real processes and no torch: cheap.

An orphan that carries this agent's mark (a rank's child left behind, in a
session of its own) comes to the agent, a child subreaper, and is ended after
its grace and reaped; one without the mark (anything else's) is left alone; a
worker the agent watches is never taken for an orphan; ``kill_tree`` reaches
descendants in sessions and groups of their own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from undying.agent.children import (
    ChildProcess,
    Orphans,
    become_subreaper,
    descendants,
    kill_tree,
    release_subreaper,
)
from undying.protocol.env import AGENT_PID_ENV

# A "rank" that leaves two children in sessions of their own and exits: one with the agent's mark in its
# environment (inherited, as a rank's children get it), one whose environment was replaced.
LEAVER = """
import os, subprocess, sys
quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **quiet)
foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **quiet,
                           env={"PATH": os.environ.get("PATH", "")})
print(marked.pid, foreign.pid, flush=True)
"""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat[stat.rfind(b")") + 2:].split()[0].decode()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rfind(b")") + 2:].split()[1])


def test_an_orphan_of_a_rank_is_ended_after_its_grace_and_anything_else_is_left_alone() -> None:
    assert become_subreaper()
    foreign = 0
    try:
        env = {**os.environ, AGENT_PID_ENV: str(os.getpid())}
        out = subprocess.run([sys.executable, "-c", LEAVER], env=env, capture_output=True, text=True, timeout=30)
        marked, foreign = (int(p) for p in out.stdout.split())
        assert _parent(marked) == os.getpid() and _parent(foreign) == os.getpid()  # adopted, not init's
        orphans = Orphans(grace_s=0.3)
        t0 = time.monotonic()
        assert orphans.sweep(set(), now=t0) == []  # seen: its grace begins
        assert orphans.sweep(set(), now=t0 + 0.1) == []
        assert orphans.sweep(set(), now=t0 + 0.4) == [marked]  # past it: ended
        deadline = time.monotonic() + 5
        while _state(marked) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.02)
        orphans.sweep(set())
        assert _state(marked) == ""  # reaped
        assert _state(foreign) in ("S", "R")  # not ours: left alone (and not reaped)
    finally:
        if foreign:
            os.kill(foreign, signal.SIGKILL)
            os.waitpid(foreign, 0)
        release_subreaper()


def test_a_watched_worker_is_no_orphan_and_its_exit_is_read_by_its_pidfd() -> None:
    async def run() -> tuple[list[int], int]:
        env = {**os.environ, AGENT_PID_ENV: str(os.getpid())}
        popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
        # (a Popen stands in for a forked worker: the agent's child, watched by a pidfd)
        worker = ChildProcess(popen.pid)
        ended = Orphans(grace_s=0.0).sweep(set())
        os.kill(popen.pid, signal.SIGKILL)
        code = await asyncio.wait_for(worker.wait(), 10)
        popen.returncode = code  # (read by ChildProcess's waitpid, not Popen's)
        return ended, code

    ended, code = asyncio.run(run())
    assert ended == [] and code == -signal.SIGKILL


def test_kill_tree_reaches_descendants_in_sessions_and_groups_of_their_own(tmp_path: Path) -> None:
    tree = subprocess.Popen([sys.executable, "-c", """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
time.sleep(60)
"""])
    try:
        deadline = time.monotonic() + 30
        while len(descendants(tree.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = descendants(tree.pid)
        assert len(below) == 2
        kill_tree(tree.pid)
        assert tree.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while any(_state(p) not in ("", "Z") for p in below) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_state(p) in ("", "Z") for p in below)
    finally:
        if tree.poll() is None:
            tree.kill()
            tree.wait()
