"""JobConfig and Timeouts: bad values are usage errors that name the flag or field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from undying.config import JobConfig, Timeouts, flag, timeouts_from_env
from undying.errors import UsageError
from undying.protocol.env import ENV_PREFIX, TIMEOUT_ENVS

FIELDS = [f.name for f in dataclasses.fields(Timeouts)]
# The timeouts a rank reads, sent to it (protocol/env.py TIMEOUT_ENVS).
SENT = list(TIMEOUT_ENVS)


def test_defaults_are_valid() -> None:
    Timeouts().validate()
    JobConfig(job_id="j", job_dir="/tmp/j").validate()


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("value", [0, 0.0, -1.0, 86400.001, 1e9, float("inf"), float("nan")])
def test_bad_timeouts_are_rejected_naming_the_field(name: str, value: float) -> None:
    with pytest.raises(UsageError, match=rf"{flag(name)} must be > 0"):
        Timeouts(**{name: value}).validate()


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("value", [0.001, 1, 86400.0])
def test_timeouts_in_range(name: str, value: float) -> None:
    Timeouts(**{name: value}).validate()


def test_job_config_validates_its_timeouts() -> None:
    with pytest.raises(UsageError, match="--connect-timeout"):
        JobConfig(job_id="j", job_dir="d", timeouts=Timeouts(connect_timeout=0)).validate()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"nproc_per_node": 0}, "--nproc-per-node must be at least 1, got 0"),
        ({"nproc_per_node": -2}, "--nproc-per-node"),
        ({"nnodes": 0}, "--nnodes"),
        ({"node_rank": 1}, "--node-rank must be in [0, 1), got 1"),
        ({"node_rank": -1}, "--node-rank"),
        ({"nnodes": 2, "node_rank": 2}, "--node-rank must be in [0, 2)"),
        ({"port": 65536}, "--port must be in [0, 65535], got 65536"),
        ({"port": -1}, "--port"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"backend": "mpi"}, "--backend must be gloo or nccl"),
    ],
)
def test_bad_job_configs_name_the_flag(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(UsageError) as info:
        JobConfig(job_id="j", job_dir="d", **changes).validate()
    assert words in str(info.value)


@pytest.mark.parametrize("changes", [{"port": 0}, {"port": 65535}, {"nnodes": 2, "node_rank": 1}, {"max_restarts": 0},
                                     {"backend": "nccl"}])
def test_edge_values_are_fine(changes: dict[str, Any]) -> None:
    JobConfig(job_id="j", job_dir="d", **changes).validate()


@pytest.mark.parametrize("http_port", [-1, 65536, 70000])
def test_a_bad_http_port_is_a_usage_error(http_port: int) -> None:
    with pytest.raises(UsageError, match="--http-port"):
        JobConfig(job_id="j", job_dir="d", http_port=http_port).validate()


def test_world_size() -> None:
    assert JobConfig(job_id="j", job_dir="d", nproc_per_node=4, nnodes=2).world_size == 8


def test_timeouts_from_env_reads_every_field_a_rank_reads() -> None:
    env = {TIMEOUT_ENVS[name]: str(1.5 + i) for i, name in enumerate(SENT)}
    env["UNRELATED"] = "x"
    t = timeouts_from_env(env)
    assert [getattr(t, name) for name in SENT] == [1.5 + i for i in range(len(SENT))]


def test_timeouts_from_env_keeps_defaults_for_the_rest() -> None:
    assert timeouts_from_env({}) == Timeouts()
    assert timeouts_from_env({"UNDYING_TIMEOUT_CONNECT": "7"}) == Timeouts(connect_timeout=7.0)


def test_timeouts_from_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDYING_TIMEOUT_EXIT", "2.5")
    assert timeouts_from_env().exit_grace == 2.5


def test_a_worker_sees_what_the_launcher_was_given() -> None:
    """Every timeout a rank reads comes back exactly; the others are not sent (their defaults stay)."""
    given = {"rendezvous_timeout": 0.1 + 0.2, "connect_timeout": 3, "collective_timeout": 4.25,
             "heartbeat_timeout": 7.5, "exit_grace": 1.25}
    assert set(given) == set(SENT)
    timeouts = Timeouts(**given, recovery_timeout=9, comm_error_grace=0.05, stop_grace=1)
    config = JobConfig(job_id="j", job_dir="d", timeouts=timeouts)
    assert timeouts_from_env(config.timeout_env()) == Timeouts(**given)


@pytest.mark.parametrize("raw", ["abc", "", "5s", "1,5"])
def test_timeouts_from_env_rejects_non_numbers(raw: str) -> None:
    with pytest.raises(UsageError) as info:
        timeouts_from_env({"UNDYING_TIMEOUT_COLLECTIVE": raw})
    assert f"UNDYING_TIMEOUT_COLLECTIVE={raw!r} is not a number" in str(info.value)


@pytest.mark.parametrize("raw", ["0", "-3", "nan", "inf", "100000"])
def test_timeouts_from_env_rejects_out_of_range(raw: str) -> None:
    with pytest.raises(UsageError, match="--rendezvous-timeout must be > 0"):
        timeouts_from_env({"UNDYING_TIMEOUT_RENDEZVOUS": raw})


def test_the_step_timeout_is_as_configured_or_derived_from_the_slowest_recent_step() -> None:
    from undying.agent.liveness import step_timeout
    from undying.config import AUTO_STEP_TIMEOUT_FACTOR, AUTO_STEP_TIMEOUT_FLOOR_S

    assert step_timeout(2.5, 100.0) == 2.5
    assert step_timeout(None, None) == AUTO_STEP_TIMEOUT_FLOOR_S
    assert step_timeout(None, 0.01) == AUTO_STEP_TIMEOUT_FLOOR_S
    assert step_timeout(None, 12.0) == 12.0 * AUTO_STEP_TIMEOUT_FACTOR


def test_a_step_timeout_of_none_means_auto_and_zero_or_a_negative_one_is_refused() -> None:
    assert Timeouts().step_timeout is None  # auto, the default
    Timeouts(step_timeout=None).validate()
    for value in (0.0, -1.0):
        with pytest.raises(UsageError, match="--step-timeout"):
            Timeouts(step_timeout=value).validate()


def test_an_elastic_job_spans_min_to_max_nodes() -> None:
    fixed = JobConfig(job_id="j", job_dir="/tmp/j", nproc_per_node=2, nnodes=3)
    assert (fixed.fewest_nodes, fixed.elastic, fixed.world_size) == (3, False, 6)
    elastic = dataclasses.replace(fixed, min_nodes=1)
    elastic.validate()
    assert (elastic.fewest_nodes, elastic.elastic, elastic.world_size) == (1, True, 6)
    assert JobConfig.from_dict(elastic.to_dict()) == elastic
    assert "min_nodes" in fixed.differences(elastic)  # every node must agree on it
    with pytest.raises(UsageError, match="1 <= MIN <= MAX"):
        dataclasses.replace(fixed, min_nodes=4).validate()


def test_torchruns_launch_settings_travel_to_a_manager_and_back() -> None:
    """An agent sends its JobConfig as JSON: the launch settings (int keys, a tuple) come back equal."""
    import json

    from undying.config import LaunchConfig

    config = JobConfig(job_id="j", job_dir="d", seed=7, max_step_recoveries=2, step_api=False,
                       launch=LaunchConfig(module=True, log_dir="logs", redirects={-1: 1}, tee={0: 3, 1: 2},
                                           local_ranks_filter=(0,), role="trainer", master_port=29600))
    back = JobConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert back == config
    # The streams and the log folder are each node's own; the rest is the job's.
    other = dataclasses.replace(config, launch=dataclasses.replace(config.launch, tee={}, log_dir="elsewhere"))
    assert config.differences(other) == []
    assert config.differences(dataclasses.replace(config, seed=8)) == ["seed"]


@pytest.mark.parametrize(("launch", "words"), [
    ({"module": True, "no_python": True}, "exclude each other"),
    ({"redirects": {0: 4}, "log_dir": "x"}, "--redirects"),
    ({"tee": {-1: 3}}, "need --log-dir"),
    ({"role": ""}, "--role must be 1 to 256 printable characters"),
    ({"master_port": 65536}, "--master-port"),
])
def test_bad_launch_settings_name_the_flag(launch: dict[str, Any], words: str) -> None:
    from undying.config import LaunchConfig

    with pytest.raises(UsageError, match=words):
        JobConfig(job_id="j", job_dir="d", launch=LaunchConfig(**launch)).validate()


def test_the_exit_grace_reaches_workers_as_a_timeout() -> None:
    env = JobConfig(job_id="j", job_dir="d", timeouts=Timeouts(exit_grace=3.5)).timeout_env()
    assert env[f"{ENV_PREFIX}TIMEOUT_EXIT"] == "3.5"
