"""torchrun's environment as the agent computes it, the error file as the manager reads it, a returned rank's exit."""

from __future__ import annotations

import json
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from undying.agent.exits import returned_exit
from undying.agent.torchrun_env import TorchrunEnv
from undying.config import ERROR_FILE, RETURNED_FILE, JobConfig, LaunchConfig, Timeouts, worker_dir
from undying.manager.recovery.detection import error_file
from undying.protocol.env import SEED_ENV
from undying.protocol.generations import GenerationRecord


@dataclass
class _Source:
    """What an agent is to its environment: its job settings and its node (agent/torchrun_env.EnvSource)."""

    config: JobConfig
    node: int


def _config(tmp_path: Path, **changes: Any) -> JobConfig:
    return JobConfig(job_id="job-1", job_dir=str(tmp_path), **changes)


def _record(generation: int = 0, world: int = 4) -> GenerationRecord:
    return GenerationRecord(generation=generation, world_size=world, store_host="127.0.0.1", store_port=1234)


def test_the_variables_of_a_rank(tmp_path: Path) -> None:
    env = TorchrunEnv(_Source(_config(tmp_path, nproc_per_node=2, nnodes=2, launch=LaunchConfig(role="trainer")), 1))
    got = env.rank(3, _record(generation=2), incarnation=7, manager_host="10.0.0.5")
    assert {k: got[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "trainer"}
    # Several nodes: rank 0's store is reached where the manager is, on torchrun's default port.
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.5", "29500")
    assert got["TORCHELASTIC_USE_AGENT_STORE"] == "False" and got["TORCHELASTIC_RESTART_COUNT"] == "2"
    folder = worker_dir(str(tmp_path), 3, 7)
    assert got["TORCHELASTIC_ERROR_FILE"] == os.path.join(folder, ERROR_FILE) and os.path.isdir(folder)
    assert got["UNDYING_RETURNED_FILE"] == os.path.join(folder, RETURNED_FILE)


def test_one_node_gets_loopback_and_a_free_port_new_for_each_generation(tmp_path: Path) -> None:
    env = TorchrunEnv(_Source(_config(tmp_path, nproc_per_node=2), 0))
    first = env.rank(0, _record(0), 1, "")
    assert first["MASTER_ADDR"] == "127.0.0.1"
    assert env.rank(1, _record(0), 2, "")["MASTER_PORT"] == first["MASTER_PORT"]  # one store per generation
    port = int(env.rank(0, _record(1), 3, "")["MASTER_PORT"])
    with socket.socket() as s:  # free: rank 0 can bind it
        s.bind(("127.0.0.1", port))
    given = TorchrunEnv(_Source(_config(tmp_path, launch=LaunchConfig(master_addr="node0", master_port=29611)), 0))
    assert (given.rank(0, _record(), 1, "")["MASTER_ADDR"], given.rank(0, _record(), 1, "")["MASTER_PORT"]) == \
        ("node0", "29611")


@pytest.mark.parametrize(("nproc", "inherited", "expected"), [(1, {}, None), (2, {}, "1"), (4, {"OMP_NUM_THREADS": "8"}, None)])
def test_omp_num_threads_as_torchrun_sets_it(tmp_path: Path, nproc: int, inherited: dict[str, str],
                                              expected: str | None) -> None:
    base = TorchrunEnv(_Source(_config(tmp_path, nproc_per_node=nproc, seed=11, max_restarts=5), 0)).base(inherited)
    assert base.get("OMP_NUM_THREADS") == expected  # (an inherited value is the user's, passed on as it is)
    assert base[SEED_ENV] == "11" and SEED_ENV == "UNDYING_SEED"
    assert base["TORCHELASTIC_RUN_ID"] == "job-1" and base["TORCHELASTIC_MAX_RESTARTS"] == "5"


def test_streams_follow_redirects_tee_and_the_console_filter(tmp_path: Path) -> None:
    launch = LaunchConfig(log_dir=str(tmp_path / "logs"), redirects={1: 3}, tee={-1: 2}, local_ranks_filter=(0,))
    env = TorchrunEnv(_Source(_config(tmp_path, nproc_per_node=2, launch=launch), 0))
    zero, one = env.rank(0, _record(3), 1, ""), env.rank(1, _record(3), 2, "")
    assert (zero["UNDYING_REDIRECTS"], zero["UNDYING_TEE"], zero["UNDYING_CONSOLE"]) == ("0", "2", "1")
    assert (one["UNDYING_REDIRECTS"], one["UNDYING_TEE"], one["UNDYING_CONSOLE"]) == ("3", "2", "0")
    assert one["UNDYING_LOG_DIR"] == str(tmp_path / "logs" / "job-1" / "attempt_3" / "1")


def test_the_error_file_is_read_as_torchrun_reads_it(tmp_path: Path) -> None:
    folder = Path(worker_dir(str(tmp_path), 2, 5))
    assert error_file(str(tmp_path), 2, 5) == ("", "")  # no file: the exit code speaks
    folder.mkdir(parents=True)
    (folder / ERROR_FILE).write_text(json.dumps({"message": {"message": "ValueError: bad", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\nValueError: bad\n", "timestamp": "1"}}}))
    assert error_file(str(tmp_path), 2, 5) == ("ValueError: bad", "Traceback (most recent call last):\nValueError: bad\n")
    (folder / ERROR_FILE).write_text("{not json")
    assert error_file(str(tmp_path), 2, 5) == ("", "")


def test_a_returned_rank_is_done_whatever_its_exit(tmp_path: Path) -> None:
    config = _config(tmp_path, timeouts=Timeouts(exit_grace=3))
    notes: list[tuple[str, int, dict[str, Any]]] = []

    def note(what: str, pid: int, **detail: Any) -> None:
        notes.append((what, pid, detail))

    assert returned_exit(config, 0, 1, 100, -9, note) == -9  # no mark: a crash stays a crash
    folder = Path(worker_dir(str(tmp_path), 0, 1))
    folder.mkdir(parents=True)
    (folder / RETURNED_FILE).write_text("1")
    assert returned_exit(config, 0, 1, 100, -int(signal.SIGALRM), note) == 0
    assert notes == [("exit_stuck", 100, {"rank": 0, "returncode": -int(signal.SIGALRM), "exit_grace_s": 3})]
    assert not (folder / RETURNED_FILE).exists()  # read once


def test_a_promoted_standby_gives_its_ranks_the_environment_of_the_node_it_takes_over(tmp_path: Path) -> None:
    """A standby given node 1, and node 1's own agent, both started without --job-dir (their own dir is
    elsewhere): their ranks get the same environment, GROUP_RANK 1 and the error file in the job's dir."""
    from undying.agent.remote import NodeRunner
    from undying.protocol.env import AGENT_KEY_ENV

    job_dir, own = tmp_path / "job", tmp_path / "undying-jobs" / "job-1"  # the manager's; the agents' default
    config = _config(tmp_path, nproc_per_node=2, nnodes=2, node_rank=1)
    config = JobConfig(**{**config.__dict__, "job_dir": str(own)})
    node = NodeRunner(config, "train.py", [], "10.0.0.5:29400", "t" * 32, job_dir_given=False)
    standby = NodeRunner(config, "train.py", [], "10.0.0.5:29400", "t" * 32, job_dir_given=False, standby=True)
    assert standby.agent.node == -1
    for runner in (node, standby):
        runner._follow(7, str(job_dir), None)  # the manager's welcome (or parked answer): the job's dir
    standby._become(1)  # the manager gave the standby node 1
    record = _record(generation=3)
    for rank in (2, 3):
        ours = standby.agent.environment.rank(rank, record, True, incarnation=5)
        theirs = node.agent.environment.rank(rank, record, True, incarnation=5)
        assert ours == theirs, {k: (ours.get(k), theirs.get(k)) for k in {*ours, *theirs} if ours.get(k) != theirs.get(k)}
        assert ours["GROUP_RANK"] == "1" and ours["LOCAL_RANK"] == str(rank - 2)
        assert ours["TORCHELASTIC_ERROR_FILE"] == os.path.join(worker_dir(str(job_dir), rank, 5), ERROR_FILE)
    bases = [{k: v for k, v in r.agent.environment.base().items() if k != AGENT_KEY_ENV} for r in (standby, node)]
    assert bases[0] == bases[1]
    assert not own.exists()  # nothing of the job in the agents' own default dir
