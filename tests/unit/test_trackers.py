"""The trackers' feed (#29): the durable cursor, each step once and in order, and the bounds of a
tracker's thread (one that raises, one that blocks, one that falls behind) — the job goes on.

The thread, the queue and the cursor's file are the real ones; the tracker behind them is a small
recording one here (the three real libraries: tests/integration/test_trackers.py, and TensorBoard
below).
"""

from __future__ import annotations

import json
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from undying.config import JobConfig
from undying.errors import UsageError
from undying.manager.trackers import CURSOR_FILE, Cursor, Trackers, missing_library
from undying.manager.trackers.feed import Feed


class Recording:
    """A tracker that keeps what it is sent; ``fail``/``block`` make it raise or hang in ``log``."""

    def __init__(self, fail: str = "", block: threading.Event | None = None, fail_open: bool = False) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.flushed = 0
        self.closed: list[bool] = []
        self.opened_with: list[tuple[dict[str, Any], int]] = []
        self.fail, self.block, self.fail_open = fail, block, fail_open

    def open(self, facts: Mapping[str, Any], last_step: int) -> dict[str, Any]:
        if self.fail_open:
            raise ModuleNotFoundError("No module named 'wandb'")
        self.opened_with.append((dict(facts), last_step))
        return {"run_id": "r-1"}

    def log(self, rows: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        if self.block is not None:
            self.block.wait(30)
        if self.fail:
            raise RuntimeError(self.fail)
        self.rows.extend((step, dict(values)) for step, values in rows)

    def flush(self) -> None:
        self.flushed += 1

    def close(self, succeeded: bool) -> None:
        self.closed.append(succeeded)


def _trackers(job_dir: Path, sinks: dict[str, Recording], reports: list[tuple[str, str]], **bounds: Any) -> Trackers:
    return Trackers(list(sinks), "job-1", job_dir, report=lambda name, why: reports.append((name, why)),
                    make=lambda name, job_id, folder: sinks[name], **bounds)


def _until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_cursor_is_durable_private_and_never_goes_back(tmp_path: Path) -> None:
    cursor = Cursor(tmp_path)
    assert cursor.last("mlflow") == 0 and cursor.facts("mlflow") == {}
    cursor.advance("mlflow", run_id="abc")
    cursor.advance("mlflow", 7)
    cursor.advance("mlflow", 5)  # (a late batch's step never moves it back)
    cursor.advance("tensorboard", 3)
    path = tmp_path / CURSOR_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Cursor(tmp_path)
    assert again.last("mlflow") == 7 and again.facts("mlflow") == {"run_id": "abc"} and again.last("tensorboard") == 3
    assert json.loads(path.read_text())["mlflow"] == {"run_id": "abc", "step": 7}


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"mlflow": {"step": -3}}', b'{"x": {"step": "7"}}',
                                     b" " * 70_000])
def test_a_damaged_cursor_is_named_and_read_as_empty(tmp_path: Path, content: bytes,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / CURSOR_FILE).write_bytes(content)
    assert Cursor(tmp_path).last("mlflow") == 0
    (record,) = caplog.records
    assert str(tmp_path / CURSOR_FILE) in record.getMessage() and "damaged" in record.getMessage()


def test_each_step_goes_once_in_order_and_a_relaunch_goes_on_after_the_cursor(tmp_path: Path) -> None:
    reports: list[tuple[str, str]] = []
    sinks = {"tensorboard": Recording(), "mlflow": Recording()}
    trackers = _trackers(tmp_path, sinks, reports)
    for step in (1, 2, 3, 2, 3, 4):  # steps 2 and 3 re-run after a recovery: their values again
        trackers.committed(step, {"loss": float(step)})
    trackers.committed(5, {})  # (a step without step.log values: nothing to send)
    trackers.close(succeeded=False)
    for sink in sinks.values():
        assert [s for s, _ in sink.rows] == [1, 2, 3, 4] and sink.closed == [False] and sink.flushed >= 1
    assert Cursor(tmp_path).last("tensorboard") == 4 and Cursor(tmp_path).facts("mlflow") == {"run_id": "r-1"}

    # A relaunch (or a restarted manager) resumes from step 2: steps up to 4 are not sent again.
    sinks = {"tensorboard": Recording(), "mlflow": Recording()}
    trackers = _trackers(tmp_path, sinks, reports)
    for step in range(3, 8):
        trackers.committed(step, {"loss": float(step)})
    trackers.close(succeeded=True)
    for sink in sinks.values():
        assert sink.opened_with == [({"run_id": "r-1"}, 4)]  # the run found again, and where it stood
        assert [s for s, _ in sink.rows] == [5, 6, 7] and sink.closed == [True]
    assert reports == []


def test_a_tracker_that_raises_is_reported_once_and_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    reports: list[tuple[str, str]] = []
    sinks = {"wandb": Recording(fail="quota exceeded"), "tensorboard": Recording()}
    trackers = _trackers(tmp_path, sinks, reports)
    trackers.committed(1, {"loss": 1.0})
    _until(lambda: trackers.feeds[0].problem)
    for step in range(2, 6):
        trackers.committed(step, {"loss": float(step)})
    trackers.close(succeeded=True)
    assert reports == [("wandb", "RuntimeError: quota exceeded")]
    assert sinks["wandb"].closed == [False]  # (its run is closed as failed)
    assert [s for s, _ in sinks["tensorboard"].rows] == [1, 2, 3, 4, 5]
    assert Cursor(tmp_path).last("wandb") == 0 and Cursor(tmp_path).last("tensorboard") == 5


def test_a_tracker_whose_library_is_missing_is_reported_not_fatal(tmp_path: Path) -> None:
    reports: list[tuple[str, str]] = []
    trackers = _trackers(tmp_path, {"wandb": Recording(fail_open=True)}, reports)
    _until(lambda: trackers.feeds[0].problem)
    trackers.committed(1, {"loss": 1.0})
    trackers.close(succeeded=True)
    assert reports == [("wandb", "ModuleNotFoundError: No module named 'wandb'")]


def test_a_tracker_that_hangs_is_reported_once_and_never_holds_the_job(tmp_path: Path) -> None:
    reports: list[tuple[str, str]] = []
    release = threading.Event()
    sinks = {"mlflow": Recording(block=release), "tensorboard": Recording()}
    trackers = _trackers(tmp_path, sinks, reports, hang_s=0.2)
    try:
        trackers.committed(1, {"loss": 1.0})
        _until(lambda: trackers.feeds[0].hung_for() > 0.3)
        started = time.monotonic()
        for step in range(2, 50):
            trackers.committed(step, {"loss": float(step)})  # never waits for the hung one
        assert time.monotonic() - started < 5
        assert reports == [("mlflow", "no answer for over 0.2 s")]
        started = time.monotonic()
        trackers.close(succeeded=True, timeout=0.5)
        assert time.monotonic() - started < 5  # (the hung one is left behind, not waited for)
        assert reports == [("mlflow", "no answer for over 0.2 s")]
        assert [s for s, _ in sinks["tensorboard"].rows] == list(range(1, 50))
    finally:
        release.set()


def test_a_tracker_a_whole_queue_behind_is_dropped_and_the_queue_stays_bounded(tmp_path: Path) -> None:
    reports: list[tuple[str, str]] = []
    release = threading.Event()
    sink = Recording(block=release)
    trackers = _trackers(tmp_path, {"wandb": sink}, reports, max_queued=3)
    try:
        trackers.committed(1, {"loss": 1.0})
        _until(lambda: trackers.feeds[0].hung_for() > 0)  # (step 1 taken, the tracker stuck in it)
        for step in range(2, 10):
            trackers.committed(step, {"loss": float(step)})
        assert reports == [("wandb", "3 steps behind (it takes steps slower than the job commits them)")]
        assert trackers.feeds[0]._queue.qsize() <= 3
    finally:
        release.set()
    trackers.close(succeeded=True, timeout=5)


def test_close_is_bounded_for_a_tracker_that_never_ends(tmp_path: Path) -> None:
    release = threading.Event()
    feed = Feed("wandb", Recording(block=release), Cursor(tmp_path))
    try:
        feed.offer((1, {"loss": 1.0}))
        started = time.monotonic()
        assert feed.close(0.3, succeeded=True) is False
        assert time.monotonic() - started < 5
    finally:
        release.set()


def test_tensorboard_takes_each_step_once_across_two_launches(tmp_path: Path) -> None:
    """The real TensorBoard writer, two launches on one job dir, the second re-running steps 3..4."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    reports: list[tuple[str, str]] = []
    for steps in ((1, 2, 3, 4), (3, 4, 5, 6)):
        trackers = Trackers(["tensorboard"], "job-1", tmp_path, report=lambda n, w: reports.append((n, w)))
        for step in steps:
            trackers.committed(step, {"loss": step / 10, "lr": 0.5})
        trackers.close(succeeded=True)
    seen: list[tuple[str, int]] = []
    files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    for path in files:
        seen += [(v.tag, e.step) for e in EventFileLoader(str(path)).Load() for v in e.summary.value]
    assert reports == [] and len(files) == 2
    assert sorted(seen) == sorted((tag, step) for tag in ("loss", "lr") for step in range(1, 7))


def test_the_option_names_known_trackers_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    from undying.cli.main import build_parser

    args = build_parser().parse_args(["run", "--trackers", " TensorBoard,mlflow,tensorboard", "train.py"])
    assert args.trackers == ("tensorboard", "mlflow")
    assert build_parser().parse_args(["run", "train.py"]).trackers == ()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--trackers", "tensorboard,comet", "train.py"])
    with pytest.raises(UsageError, match="unknown tracker 'comet'"):
        JobConfig(job_id="j", job_dir="d", trackers=("comet",)).validate()
    config = JobConfig(job_id="j", job_dir="d", trackers=("wandb", "mlflow"))
    assert JobConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert missing_library("tensorboard") == ""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert missing_library("wandb") == "--trackers wandb needs the wandb package: pip install 'undying[wandb]'"
    from undying.cli.run_config import config_from_args

    script = tmp_path / "train.py"
    script.write_text("import undying\n")
    args = build_parser().parse_args(["run", "--trackers", "mlflow", str(script)])
    with pytest.raises(UsageError, match=r"pip install 'undying\[mlflow\]'"):  # (refused at start, in one line)
        config_from_args(args)
