"""The manager's heap: what lives for the job is frozen out of the collector's walks; cycles made
later are still collected (manager/heap.py; the figures are bench/control_plane.py's)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.live_manager import starting
from undying.jobfiles.records import JobState
from undying.manager import heap
from undying.protocol.worker_wire import StepCommitted


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's collector as it was, whatever a test froze or set."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _walked(thing: object) -> bool:
    """Whether a full collection would walk ``thing`` (a frozen object is in no generation)."""
    return any(o is thing for o in gc.get_objects())


def test_at_start_freezes_what_lives_and_the_collector_still_frees_later_cycles(collector: None) -> None:
    old = _Cycle()
    heap.at_start()
    assert gc.get_freeze_count() > 0 and not _walked(old)
    assert gc.get_threshold()[0] >= heap.THRESHOLD0
    gc.collect()
    gc.callbacks.append(counted := _Counter())
    try:
        _Cycle()  # garbage at once: only the collector can free it
        gc.collect()
    finally:
        gc.callbacks.remove(counted)
    assert counted.collected >= 1
    assert counted.walked < gc.get_freeze_count(), "the frozen heap was walked again"


class _Counter:
    def __init__(self) -> None:
        self.collected = 0
        self.walked = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            self.collected += info["collected"]
            self.walked = max(self.walked, len(gc.get_objects()))


def test_the_job_running_freezes_its_book(tmp_path: Path, collector: None) -> None:
    manager, _agent = starting(tmp_path, 2)
    book = manager.ranks[1]
    assert _walked(book)
    for rank in range(2):  # the job's first commit: it runs
        manager.on_message(StepCommitted(rank, 0, 1, 2.0, {"loss": 1.0}))
    assert manager.core.state is JobState.RUNNING
    assert not _walked(book), "a rank's record, alive as long as the job, is still walked"
    manager.close()
