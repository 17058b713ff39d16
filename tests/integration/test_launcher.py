"""The launcher: no orphans, a clean Ctrl-C, the event log, the HTTP API and `undying status`."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.jobs import alive, manager_url, start_job, status, wait_for, wait_running
from undying.cli.client import api_get, api_post
from undying.cli.demo import run_job
from undying.demo import TRAIN_SCRIPT
from undying.demo.oracle import load_run


def _worker_pids(url: str) -> list[int]:
    return [r["pid"] for r in status(url)["ranks"]]


def test_killing_the_launcher_kills_its_workers(tmp_path: Path, reap: list[int]) -> None:
    launcher = start_job(tmp_path / "job", ["--epochs", "50"], reap=reap)
    url = manager_url(tmp_path / "job")
    wait_running(url)
    workers = _worker_pids(url)
    reap.extend(workers)
    assert all(alive(pid) for pid in workers)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=10)
    wait_for(lambda: not any(alive(pid) for pid in workers), 10, "the workers to die with the launcher")


def test_ctrl_c_stops_the_job_cleanly(tmp_path: Path, reap: list[int]) -> None:
    launcher = start_job(tmp_path / "job", ["--epochs", "50"], reap=reap)
    url = manager_url(tmp_path / "job")
    wait_running(url)
    workers = _worker_pids(url)
    reap.extend(workers)
    os.kill(launcher.pid, signal.SIGINT)
    assert launcher.wait(timeout=30) == 130
    assert not any(alive(pid) for pid in workers)
    assert not (tmp_path / "job" / "manager.json").exists()
    out = subprocess.run(
        [sys.executable, "-m", "undying", "status", "--job-dir", str(tmp_path / "job"), "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    )
    after = json.loads(out.stdout)
    assert after["state"] == "stopped" and after["live"] is False
    assert "SIGINT" in after["exit_reason"]


def test_status_api_and_event_log_of_a_live_job_with_a_fault(tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, ["--epochs", "400"], reap=reap)
    url = manager_url(job_dir)
    before = wait_running(url, min_step=3)
    assert before["world_size"] == 4 and before["generation"] == 0
    ranks = api_get(url, "/api/ranks")
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and all(r["pid"] > 0 for r in ranks)
    # A random moment of a step, from outside: `undying inject crash` now.
    wait_for(lambda: random.random() < 0.2, 5, "a random moment")
    victim = ranks[2]["pid"]
    cli = subprocess.run(
        [sys.executable, "-m", "undying", "inject", "crash", "--rank", "2", "--job-dir", str(job_dir)],
        capture_output=True, text=True, timeout=30,
    )
    assert cli.returncode == 0, cli.stderr
    assert f"pid {victim}" in cli.stdout
    incident = wait_for(
        lambda: [i for i in api_get(url, "/api/incidents") if i["status"] == "recovered"], 60, "the recovery"
    )[0]
    assert incident["kind"] == "crash" and incident["rank"] == 2 and incident["mttr_s"] > 0
    live = subprocess.run(
        [sys.executable, "-m", "undying", "status", "--job-dir", str(job_dir)],
        capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "200"},
    )
    assert live.returncode == 0 and "crash" in live.stdout and "recovered" in live.stdout
    api_post(url, "/api/stop", {})
    assert launcher.wait(timeout=60) == 130
    db = sqlite3.connect(job_dir / "events.db")
    kinds = {k for (k,) in db.execute("SELECT kind FROM events")}
    assert {"generation_opened", "spawned", "exited", "decided", "fault_injected"} <= kinds
    (stored,) = [json.loads(d) for (d,) in db.execute("SELECT data FROM incidents")]
    assert stored["status"] == "recovered" and set(stored["phases"]) >= {"detected", "first_step_done"}
    db.close()


def test_inject_rejects_a_rank_that_does_not_exist(tmp_path: Path, reap: list[int]) -> None:
    launcher = start_job(tmp_path / "job", ["--epochs", "50"], ranks=2, reap=reap)
    url = manager_url(tmp_path / "job")
    cli = subprocess.run(
        [sys.executable, "-m", "undying", "inject", "crash", "--rank", "7", "--job-dir", str(tmp_path / "job")],
        capture_output=True, text=True, timeout=30,
    )
    assert cli.returncode == 2
    assert "rank 7 does not exist" in cli.stderr and len(cli.stderr.strip().splitlines()) == 1
    api_post(url, "/api/stop", {})
    assert launcher.wait(timeout=30) == 130


def test_a_bug_is_not_a_fault(tmp_path: Path) -> None:
    """A user exception at the same step again after recovery stops the job after --max-step-recoveries."""
    job_dir = tmp_path / "job"
    rc = run_job(job_dir, ["--epochs", "1", "--fail-at-step", "5", "--fail-rank", "1"], ranks=2,
                 extra_run_args=["--max-step-recoveries", "2"], timeout_s=150)
    assert rc == 1
    incidents = load_run(job_dir / "events.db").incidents
    errors = [i for i in incidents if i["kind"] == "error"]
    assert [i["action"] for i in errors] == ["replace", "replace", "fail"], incidents
    assert all(i["rank"] == 1 and i["step"] == 5 for i in errors)
    assert "ValueError: a bug in the training script at step 5" in errors[-1]["traceback"]
    log = (tmp_path / "job.log").read_text()
    assert "FAILED" in log and "--max-step-recoveries 2" in log and "ValueError" in log


def test_a_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = tmp_path / "train.py"
        script.write_text("print('never runs')\n")
        cli = subprocess.run(
            [sys.executable, "-m", "undying", "run", "-n", "2", "--port", str(port), "--job-dir",
             str(tmp_path / "job"), str(script)],
            capture_output=True, text=True, timeout=60,
        )
    assert cli.returncode == 2
    assert f"port {port} is in use" in cli.stderr and "--port" in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_lone_agent_leaves_on_sigterm_and_sighup_alike(sig: signal.Signals, tmp_path: Path, reap: list[int]) -> None:
    """A multi-node agent whose manager is not up yet: SIGHUP (a closed terminal) is its SIGTERM, exit 143.

    (The whole path with a manager, on separate hosts, is test_multinode.py's
    node that leaves on SIGHUP.) Its children go with it.
    """
    argv = [sys.executable, "-m", "undying", "run", "--nnodes", "2", "--node-rank", "1", "--manager", "127.0.0.1:9",
            "-n", "1", "--job-dir", str(tmp_path / "job"), "--job-id", "lone", str(TRAIN_SCRIPT)]
    with open(tmp_path / "agent.log", "wb") as out:
        agent = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    reap.append(agent.pid)
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    kids = wait_for(lambda: children.read_text().split(), 30, "the agent's zygote")
    os.kill(agent.pid, sig)
    assert agent.wait(timeout=30) == 143, (tmp_path / "agent.log").read_text()
    said = (tmp_path / "agent.log").read_text()
    what = "SIGHUP (the terminal hung up)" if sig == signal.SIGHUP else "SIGTERM"
    assert f"node 1: {what}: this node leaves the job" in said, said
    wait_for(lambda: not any(alive(int(k)) for k in kids), 10, "the agent's children to go with it")
