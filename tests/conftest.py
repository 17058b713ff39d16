"""Shared fixtures: the oracle's fault-free baselines are computed once per session."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.oracle import Oracle
from undying.checkpoint.mac import using_key
from undying.protocol.env import PROMETHEUS_DIR_ENV


@pytest.fixture(autouse=True)
def no_checkpoint_key_left_over() -> Iterator[None]:
    """Every test starts with no checkpoint MAC key in this process and leaves none behind.

    The manager's service sets the process's key when it starts (a unit test runs it in-process);
    a later test in the same pytest worker then read its unsigned checkpoints as tampered with.
    Found when the workers' test order changed (pytest-xdist's worksteal): 8 checkpoint tests failed.
    """
    with using_key(None):
        yield


@pytest.fixture(autouse=True)
def undying_logger_as_it_was() -> Iterator[None]:
    """A test that runs a command in-process sets the ``undying`` logger up as the command does
    (its own handler, no propagation: config.console); caplog reads the root logger, so the next
    test gets the logger back as it was."""
    ours = logging.getLogger("undying")
    saved = (ours.level, ours.propagate, list(ours.handlers))
    yield
    ours.setLevel(saved[0])
    ours.propagate = saved[1]
    ours.handlers[:] = saved[2]


@pytest.fixture(autouse=True)
def no_undying_setting_left_in_the_environment() -> Iterator[None]:
    """A test leaves the ``UNDYING_*`` settings of this process's environment as it found them:
    the ranks a later test in the same worker starts inherit them. (The launcher's live line
    left ``UNDYING_LIVE_LINE`` behind, and a later test's rank erased a line nobody drew.)"""
    before = {k: v for k, v in os.environ.items() if k.startswith("UNDYING_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("UNDYING_")}
    if after != before:
        for k in after.keys() - before.keys():
            del os.environ[k]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"the test left {', '.join(changed)} changed in the environment; set it with "
                    "monkeypatch, or restore it")


_WATCHED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                    signal.SIGCHLD)




def _still_ignored(signum: int, frame: object) -> None:
    """Ignores a signal here, as SIG_IGN did, but is reset to the default in a program this
    process starts (a handler does not survive an exec; SIG_IGN would)."""


# The suite's jobs start as from a terminal's shell, whose signals reach them: SIGINT for Ctrl-C,
# SIGHUP for a closed terminal, SIGQUIT for Ctrl-\. Where the suite itself was started with them
# ignored (`nohup`, `&` in a script), undying would leave them ignored in every job (as it must:
# agent.hangup.not_ignored) and the tests of those signals would send them in vain. Here they
# stay ignored by this process, and every job the suite starts has them at their defaults.
for _sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    if signal.getsignal(_sig) is signal.SIG_IGN:
        signal.signal(_sig, _still_ignored)

@pytest.fixture(autouse=True)
def process_left_as_found() -> Iterator[None]:
    """A test leaves this process's working folder, umask and signal handlers as it found them:
    a later test in the same worker (and every process it starts) would run with them."""
    cwd = os.getcwd()
    umask = os.umask(0o022)
    os.umask(umask)
    handlers = {s: signal.getsignal(s) for s in _WATCHED_SIGNALS}
    yield
    changed = []
    if os.getcwd() != cwd:
        changed.append(f"the working folder ({os.getcwd()})")
        os.chdir(cwd)
    if (now := os.umask(umask)) != umask:
        changed.append(f"the umask ({now:o})")
    for sig, handler in handlers.items():
        if signal.getsignal(sig) != handler:
            changed.append(f"the handler of {sig.name} ({handler!r} -> {signal.getsignal(sig)!r})")
            signal.signal(sig, handler)
    if changed:
        pytest.fail(f"the test left {', '.join(changed)} changed; restore it (monkeypatch.chdir, "
                    "a finally)")


@pytest.fixture(scope="session")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Oracle:
    """One set of references for the whole run: under pytest-xdist, the workers' common temp folder."""
    base = tmp_path_factory.getbasetemp()
    return Oracle((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "baselines")


@pytest.fixture(autouse=True, scope="session")
def job_token() -> Iterator[str]:
    """One token for every job a test starts (inherited through env), so helpers that know only a URL get in."""
    previous = os.environ.get("UNDYING_TOKEN")
    os.environ["UNDYING_TOKEN"] = token = secrets.token_urlsafe(32)
    yield token
    if previous is None:
        os.environ.pop("UNDYING_TOKEN", None)
    else:
        os.environ["UNDYING_TOKEN"] = previous


@pytest.fixture(autouse=True, scope="session")
def prometheus_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The jobs' Prometheus target files and scrape credential go to the session's temp folder, not the
    user's own (where a Prometheus of theirs would scrape the tests' jobs)."""
    previous = os.environ.get(PROMETHEUS_DIR_ENV)
    os.environ[PROMETHEUS_DIR_ENV] = str(folder := tmp_path_factory.mktemp("prometheus"))
    yield folder
    if previous is None:
        os.environ.pop(PROMETHEUS_DIR_ENV, None)
    else:
        os.environ[PROMETHEUS_DIR_ENV] = previous


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """PIDs a test started outside run_job; every one still alive is killed at the end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)
    _deal(items)


# Test files whose tests take 20-70 s each on 2 cores (the suite's --durations, 2026-11-29): a real
# Slurm cluster, several hosts, chaos, overlapping faults.
_LONG_JOBS = frozenset({
    "test_slurm.py", "test_slurm_more.py", "test_chaos.py", "test_multinode.py",
    "test_f8_regroup_overlaps.py", "test_f7_spares.py", "test_f1_strangers.py", "test_examples.py",
    "test_invariant.py", "test_migrate.py", "test_demo_node_loss.py", "test_trackers.py",
})


def _deal(items: list[pytest.Item]) -> None:
    """Under pytest-xdist's worksteal, each worker starts on its own slice of the collection and
    the others steal from a slice's end. Dealt like cards: each slice starts with its share of the
    jobs (integration and adversarial tests, seconds each) and ends with unit tests (cheap to
    steal), so no job of a minute waits at the end of one worker's slice while the others idle.
    Deterministic: every worker collects the same order, as xdist requires."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2:
        return
    jobs = [i for i in items if {"integration", "adversarial"} & set(Path(str(i.fspath)).parts)]
    # The longest first (a job of a minute started last is the run's tail): a stable sort, so the
    # order stays deterministic.
    jobs.sort(key=lambda i: Path(str(i.fspath)).name not in _LONG_JOBS)
    dealt_jobs = set(jobs)
    rest = [i for i in items if i not in dealt_jobs]
    dealt: list[pytest.Item] = []
    for worker in range(workers):
        dealt += jobs[worker::workers] + rest[worker::workers]
    items[:] = dealt
