"""A generation that fails to form on a rank is told to the manager, and the rank follows its replacement.

A real store server plays the manager's; one real process joins a generation of two ranks whose other
member never comes. gloo gives up after --collective-timeout (its wait for every member is as long as
one collective); the rank must report that generation's failure (a ``CommFailure`` naming it) before it
waits, because nothing else would tell the manager (every process lives), and then join the generation
the manager opens in its place. A generation the manager already replaced (its store closed under the
wait) needs no word: the rank follows at once.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from tests.unit.store_server import KEY, serving
from undying.demo.cluster import wait_for
from undying.manager.membership.generations import Generations
from undying.manager.stores import StoreHandle, StoreServer
from undying.protocol.generations import GenerationRecord, arrival_key, generation_key
from undying.protocol.store_client import JobStore
from undying.protocol.store_wire import generation_store
from undying.protocol.worker_wire import CommFailure

FORMING_S = 1.5  # --collective-timeout


def _join(port: int, forming_s: float, out: Any) -> None:
    """Rank 0 joins generation 1 as a recovery would; what it sends, and the generation it ends in, go to
    ``out``."""
    from undying.config import CheckpointConfig, Timeouts
    from undying.worker.boot import end_process
    from undying.worker.checkpoints import Checkpoints
    from undying.worker.context import JobContext
    from undying.worker.env import WorkerEnv
    from undying.worker.faults import FaultSwitch
    from undying.worker.group import leave_group
    from undying.worker.rejoin import Rejoin
    from undying.worker.shards import Shards
    from undying.worker.tracing import WorkerTracing

    timeouts = Timeouts(connect_timeout=10, rendezvous_timeout=60, collective_timeout=forming_s)
    env = WorkerEnv("job", 0, 0, 2, 1, "127.0.0.1", port, "127.0.0.1", 1, 0, False, "gloo", timeouts,
                    CheckpointConfig(), store_key=KEY)
    ctx = JobContext(env, 0, 2, 0, 0, out.put, FaultSwitch(0, out.put, {}), WorkerTracing(None, 0, out.put))
    ctx.current_step = 7
    control = JobStore("127.0.0.1", port, "control", KEY, timedelta(seconds=10))
    rejoin = Rejoin(ctx, control, Shards(ctx), Checkpoints(ctx), [])
    rejoin.join(1)
    out.put({"joined": ctx.generation})
    leave_group()
    out.close()
    out.join_thread()
    end_process()


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with serving() as made:
        yield made


def _member(server: StoreServer, reap: list[int], forming_s: float) -> tuple[Any, Any]:
    """Generation 1 opened for two ranks, and rank 0's process joining it, gloo waiting ``forming_s`` for
    rank 1: (the process, its queue)."""
    server.open(generation_store(1))
    control = StoreHandle(server, "control")
    control.set(generation_key(1), GenerationRecord(1, 2, "127.0.0.1", server.port).to_json())
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    member = mp.Process(target=_join, args=(server.port, forming_s, out))
    member.start()
    assert member.pid is not None
    reap.append(member.pid)
    return member, out


def _replace_generation_1(server: StoreServer) -> None:
    """The manager's answer: generation 2, rank 0 alone, in place of generation 1 (whose store closes)."""
    control = StoreHandle(server, "control")
    server.open(generation_store(2))
    control.set(generation_key(2), GenerationRecord(2, 1, "127.0.0.1", server.port).to_json())
    control.set(generation_key(1), GenerationRecord(1, 2, "127.0.0.1", server.port, status="superseded",
                                                    superseded_by=2).to_json())
    server.drop(generation_store(1))


def test_a_generation_that_fails_to_form_is_reported_before_the_rank_waits_for_its_replacement(
        server: StoreServer, reap: list[int]) -> None:
    member, out = _member(server, reap, FORMING_S)
    try:
        report = out.get(timeout=60)
    except queue.Empty:
        pytest.fail("the rank reported nothing about the generation it could not form")
    assert isinstance(report, CommFailure), report
    assert (report.rank, report.generation, report.step) == (0, 1, 7), report
    assert report.error.startswith("generation 1 failed to form: ") and f"{FORMING_S}s" in report.error, report.error
    assert report.unformed and not report.torn
    assert arrival_key(0) in StoreHandle(server, generation_store(1)).list_keys(), "it said it came"
    with pytest.raises(queue.Empty):
        out.get(timeout=0.5)  # it waits for the manager's next word, not joining anything by itself
    _replace_generation_1(server)
    assert out.get(timeout=60) == {"joined": 2}, "it followed the replacement and formed it"
    member.join(30)
    assert member.exitcode == 0


def test_a_generation_superseded_while_it_forms_is_followed_at_once_untold(
        server: StoreServer, reap: list[int]) -> None:
    """A second fault replaced the generation while the rank waited in it for its peer: the store's close
    fails the wait at once, and the manager needs no word of it."""
    member, out = _member(server, reap, 60.0)  # (only the store's close ends its wait in time)
    forming = JobStore("127.0.0.1", server.port, generation_store(1), KEY, timedelta(seconds=30))
    wait_for(lambda: forming.num_keys() > 0, 60, "rank 0 to arrive in generation 1")  # in gloo's wait now
    _replace_generation_1(server)
    assert out.get(timeout=30) == {"joined": 2}, "followed at once, and nothing said"
    member.join(30)
    assert member.exitcode == 0


def test_the_manager_reads_who_came_to_a_generation_until_it_is_superseded() -> None:
    generations = Generations("job", "127.0.0.1")
    generations.serve(0, KEY)
    try:
        record = generations.open_next(3, "the start")
        came = JobStore("127.0.0.1", record.store_port, generation_store(record.generation), KEY, timedelta(seconds=10))
        assert generations.arrived(record.generation, [0, 1, 2]) == set()
        came.set(arrival_key(2), "1")
        came.set(arrival_key(0), "1")
        assert generations.arrived(record.generation, [0, 1, 2]) == {0, 2}
        assert generations.arrived(record.generation, [1]) == set(), "only the ranks asked about"
        generations.open_next(3, "a retry")
        assert generations.arrived(record.generation, [0, 1, 2]) is None, "superseded: its store is closed"
    finally:
        generations.close()
