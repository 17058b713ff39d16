"""TraceWriter: real files in a tmp dir, a real background thread."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import undying.trace.files as files_mod
import undying.trace.writer as writer_mod
from undying.errors import UsageError
from undying.trace.files import (
    default_job_label,
    default_trace_dir,
    is_trace_file,
    trace_file_name,
    trace_file_time,
)
from undying.trace.writer import TraceWriter


@pytest.fixture
def writers() -> Iterator[list[TraceWriter]]:
    """Writers a test makes, closed at its end even if it fails."""
    made: list[TraceWriter] = []
    yield made
    for w in made:
        w.close(timeout_s=2.0)


def make(
    writers: list[TraceWriter], trace_dir: Path, job: str = "J", rank: int = 2, **kw: Any
) -> TraceWriter:
    w = TraceWriter(trace_dir, job, rank, **kw)
    writers.append(w)
    return w


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def current(w: TraceWriter) -> Path:
    assert w.path is not None
    return w.path


def trace_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if is_trace_file(p.name))


def put_file(path: Path, nbytes: int, mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * (nbytes - 1) + b"\n")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


OLD = 1_600_000_000.0  # 2020: long past, not a live writer's file


# -- names ---------------------------------------------------------------------


def test_file_names() -> None:
    name = trace_file_name(1_795_428_901.123456)
    assert name == "20261123T101501.123456Z.ndjson"
    assert is_trace_file(name)
    assert trace_file_time(name) == pytest.approx(1_795_428_901.123456, abs=1e-6)
    for bad in ("notes.txt", "20261123T101501Z.ndjson", "20261123T101501.123456Z.json", "x" + name):
        assert not is_trace_file(bad)
    with pytest.raises(ValueError):
        trace_file_time("notes.txt")


def test_defaults(tmp_path: Path) -> None:
    assert default_trace_dir(tmp_path) == tmp_path / "traces"
    label = default_job_label()
    assert label.startswith("job-20") and label.endswith("Z") and "/" not in label


@pytest.mark.parametrize("job", ["", ".", "..", "a/b", "a\\b"])
def test_bad_job_id(tmp_path: Path, job: str) -> None:
    with pytest.raises(UsageError, match="trace folder"):
        TraceWriter(tmp_path, job, 0)


# -- writing ---------------------------------------------------------------------


def test_records_land_as_ndjson_in_the_rank_folder(
    tmp_path: Path, writers: list[TraceWriter]
) -> None:
    w = make(writers, tmp_path)
    t0 = time.time()
    for i in range(5):
        w.write({"kind": "step", "step": i, "p": Path("/x"), "s": {3}})
    assert w.flush()
    assert w.written == 5 and w.dropped == 0
    files = trace_files(tmp_path / "J" / "2")
    assert len(files) == 1 and w.path == files[0]
    assert abs(trace_file_time(files[0].name) - t0) < 5
    raw = files[0].read_text()
    assert raw.endswith("\n") and ", " not in raw and '": ' not in raw  # compact
    recs = lines_of(files[0])
    assert [r["step"] for r in recs] == list(range(5))
    assert recs[0]["p"] == "/x" and recs[0]["s"] == [3]


def test_appends_to_the_newest_file_on_restart(tmp_path: Path, writers: list[TraceWriter]) -> None:
    folder = tmp_path / "J" / "2"
    older = put_file(folder / "20200101T000000.000000Z.ndjson", 10)
    newer = put_file(folder / "20200102T000000.000000Z.ndjson", 10)
    w1 = make(writers, tmp_path)
    w1.write({"n": 1})
    w1.close()
    assert w1.path == newer
    w2 = make(writers, tmp_path)
    w2.write({"n": 2})
    w2.close()
    assert trace_files(folder) == [older, newer]
    assert newer.read_text().splitlines()[1:] == ['{"n":1}', '{"n":2}']
    assert older.stat().st_size == 10


def test_new_file_when_the_newest_is_full(tmp_path: Path, writers: list[TraceWriter]) -> None:
    folder = tmp_path / "J" / "2"
    # Named in the future: a clock stepped back must not make the new file sort first.
    full = put_file(folder / "20990101T000000.000000Z.ndjson", 300)
    w = make(writers, tmp_path, max_file_bytes=300)
    w.write({"n": 1})
    assert w.flush()
    files = trace_files(folder)
    assert len(files) == 2 and files[0] == full and files[1] == w.path
    assert full.stat().st_size == 300
    assert files[1].name > full.name


def test_repairs_a_cut_last_line(tmp_path: Path, writers: list[TraceWriter]) -> None:
    f = tmp_path / "J" / "2" / "20200101T000000.000000Z.ndjson"
    f.parent.mkdir(parents=True)
    f.write_text('{"a":1}\n{"cut')
    w = make(writers, tmp_path)
    w.write({"b": 2})
    assert w.flush()
    assert f.read_text().splitlines() == ['{"a":1}', '{"cut', '{"b":2}']


def test_rotation_past_max_file_bytes(tmp_path: Path, writers: list[TraceWriter]) -> None:
    w = make(writers, tmp_path, max_file_bytes=200)
    for i in range(40):
        w.write({"i": i, "pad": "y" * 20})
    assert w.flush()
    files = trace_files(tmp_path / "J" / "2")
    assert len(files) > 5
    assert all(f.stat().st_size <= 200 for f in files)
    got = [r["i"] for f in files for r in lines_of(f)]
    assert got == list(range(40))
    assert w.written == 40


def test_a_record_bigger_than_a_file_still_goes_out(
    tmp_path: Path, writers: list[TraceWriter]
) -> None:
    w = make(writers, tmp_path, max_file_bytes=50)
    w.write({"big": "z" * 200})
    w.write({"small": 1})
    assert w.flush()
    files = trace_files(tmp_path / "J" / "2")
    assert [list(lines_of(f)[0]) for f in files] == [["big"], ["small"]]


def test_unencodable_record_is_dropped_others_kept(
    tmp_path: Path, writers: list[TraceWriter]
) -> None:
    w = make(writers, tmp_path)
    loop: dict[str, Any] = {}
    loop["self"] = loop
    w.write({"n": 1})
    w.write(loop)
    w.write({"n": 2})
    assert w.flush()
    assert (w.written, w.dropped) == (2, 1)
    assert [r["n"] for r in lines_of(current(w))] == [1, 2]


def test_records_from_many_threads(tmp_path: Path, writers: list[TraceWriter]) -> None:
    w = make(writers, tmp_path)

    def produce(k: int) -> None:
        for i in range(500):
            w.write({"k": k, "i": i})

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert w.flush()
    recs = lines_of(current(w))
    assert len(recs) == 2000 and w.written == 2000
    for k in range(4):
        assert [r["i"] for r in recs if r["k"] == k] == list(range(500))


# -- never blocking, never raising -------------------------------------------------


class Stall:
    """Encodes (via str) only once released: holds the writer thread."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __str__(self) -> str:
        self.entered.set()
        self.release.wait(10)
        return "stall"


def test_write_never_blocks_when_the_queue_is_full(
    tmp_path: Path, writers: list[TraceWriter]
) -> None:
    w = make(writers, tmp_path, queue_limit=10)
    stall = Stall()
    w.write({"x": stall})
    assert stall.entered.wait(5)  # the writer thread is stuck in the disk's place
    t0 = time.perf_counter()
    for i in range(10_000):
        w.write({"i": i})
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0
    assert w.dropped == 10_000 - 10
    stall.release.set()
    assert w.flush()
    assert w.written == 11
    assert [r["i"] for r in lines_of(current(w))[1:]] == list(range(10))


def test_blocked_folder_drops_counts_warns_once_and_recovers(
    tmp_path: Path, writers: list[TraceWriter], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "J").write_text("a file where the job folder should be")
    w = make(writers, tmp_path)
    with caplog.at_level(logging.WARNING, logger="undying.trace"):
        for batch in range(3):
            for i in range(5):
                w.write({"batch": batch, "i": i})
            assert w.flush()
    assert (w.written, w.dropped) == (0, 15)
    warnings = [r for r in caplog.records if "trace records dropped" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on" in warnings[0].getMessage()
    # The folder comes back: writing resumes.
    (tmp_path / "J").unlink()
    w.write({"back": True})
    assert w.flush()
    assert w.written == 1 and lines_of(current(w)) == [{"back": True}]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_drops_and_counts(tmp_path: Path, writers: list[TraceWriter]) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        w = make(writers, ro)
        w.write({"n": 1})
        assert w.flush()
        assert (w.written, w.dropped) == (0, 1)
    finally:
        ro.chmod(0o755)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_drops_and_counts(
    tmp_path: Path, writers: list[TraceWriter], caplog: pytest.LogCaptureFixture
) -> None:
    # The newest trace file is a link to /dev/full: every write fails with ENOSPC.
    folder = tmp_path / "J" / "2"
    folder.mkdir(parents=True)
    os.symlink("/dev/full", folder / "20990101T000000.000000Z.ndjson")
    w = make(writers, tmp_path)
    with caplog.at_level(logging.WARNING, logger="undying.trace"):
        for i in range(20):
            w.write({"i": i})
        assert w.flush()
        w.write({"i": 20})
        assert w.flush()
    assert (w.written, w.dropped) == (0, 21)
    msgs = [r.getMessage() for r in caplog.records if "trace records dropped" in r.getMessage()]
    assert len(msgs) == 1 and "No space left" in msgs[0]


def test_close(tmp_path: Path, writers: list[TraceWriter]) -> None:
    w = make(writers, tmp_path)
    w.write({"n": 1})
    w.close()
    assert w.written == 1
    w.write({"n": 2})
    assert w.dropped == 1
    w.close()  # twice is fine
    assert not w._thread.is_alive()
    assert w.flush()  # nothing left queued


# -- the size cap --------------------------------------------------------------------


def test_cap_deletes_the_oldest_fifth_of_trace_files_only(
    tmp_path: Path, writers: list[TraceWriter]
) -> None:
    a = [
        put_file(tmp_path / "A" / "0" / f"2020010{d}T000000.000000Z.ndjson", 1000, OLD)
        for d in range(1, 10)
    ]
    b = [
        put_file(tmp_path / "B" / "1" / f"2021010{d}T000000.000000Z.ndjson", 1000, OLD)
        for d in range(1, 7)
    ]
    keep = [
        put_file(tmp_path / "notes.txt", 50_000, OLD),
        put_file(tmp_path / "A" / "notes.txt", 50_000, OLD),
        put_file(tmp_path / "A" / "0" / "notes.txt", 50_000, OLD),
        put_file(tmp_path / "A" / "0" / "20190101.ndjson", 50_000, OLD),
        put_file(tmp_path / "A" / "x" / "20190101T000000.000000Z.ndjson", 50_000, OLD),
        put_file(tmp_path / "A" / "0" / "sub" / "20190101T000000.000000Z.ndjson", 50_000, OLD),
    ]
    # 15 old trace files + the writer's new one = 16 files past the cap: ceil(3.2) = 4 go.
    w = make(writers, tmp_path, job="C", rank=0, max_dir_bytes=5000)
    w.write({"n": 1})
    assert w.flush()
    assert [p.exists() for p in a] == [False] * 4 + [True] * 5
    assert all(p.exists() for p in b)
    assert all(p.exists() for p in keep)
    assert w.path is not None and w.path.exists()


def test_cap_never_deletes_the_writers_own_file(tmp_path: Path, writers: list[TraceWriter]) -> None:
    own = put_file(tmp_path / "J" / "2" / "20200101T000000.000000Z.ndjson", 5000, OLD)
    w = make(writers, tmp_path, max_dir_bytes=100)
    w.write({"n": 1})
    assert w.flush()
    assert w.path == own and own.exists()


def test_cap_spares_a_peers_live_file_but_not_a_stale_one(
    tmp_path: Path, writers: list[TraceWriter]
) -> None:
    live = put_file(tmp_path / "J" / "0" / "20200101T000000.000000Z.ndjson", 5000)  # recent mtime
    stale = put_file(tmp_path / "K" / "0" / "20200101T000001.000000Z.ndjson", 5000, OLD)
    w = make(writers, tmp_path, rank=1, max_dir_bytes=1000)
    w.write({"n": 1})
    assert w.flush()
    assert live.exists() and not stale.exists()


def test_cap_is_checked_as_bytes_are_written(
    tmp_path: Path, writers: list[TraceWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_mod, "CAP_CHECK_BYTES", 2000)
    old = [
        put_file(tmp_path / "A" / "0" / f"2020010{d}T000000.000000Z.ndjson", 100, OLD)
        for d in range(1, 6)
    ]
    w = make(writers, tmp_path, max_dir_bytes=1500, max_file_bytes=1_000_000)
    assert w.flush()
    assert all(p.exists() for p in old)  # nothing written, nothing opened yet
    w.write({"pad": "p" * 100})
    assert w.flush()
    assert all(p.exists() for p in old)  # 600 bytes: under the cap
    for _ in range(30):
        w.write({"pad": "p" * 100})
    assert w.flush()
    assert not old[0].exists()


def test_own_file_deleted_under_the_writer_starts_a_new_one(
    tmp_path: Path, writers: list[TraceWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_mod, "CAP_CHECK_BYTES", 100)
    w = make(writers, tmp_path)
    w.write({"n": 0})
    assert w.flush()
    first = w.path
    assert first is not None
    first.unlink()
    # Records up to the next check go to the deleted file; after it, to a new one.
    for i in range(10):
        w.write({"n": i, "pad": "p" * 50})
    assert w.flush()
    w.write({"n": 99})
    assert w.flush()
    assert w.path != first and lines_of(current(w)) == [{"n": 99}]


def test_cap_tolerates_files_vanishing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = put_file(tmp_path / "A" / "0" / "20200101T000000.000000Z.ndjson", 100, OLD)
    real_scandir = files_mod._scandir

    def racing_scandir(path: str) -> list[os.DirEntry[str]]:
        entries = real_scandir(path)
        if f.exists() and str(f.parent) == path:
            f.unlink()  # a peer deletes it between listing and stat
        return entries

    monkeypatch.setattr(files_mod, "_scandir", racing_scandir)
    assert files_mod.scan_trace_files(tmp_path) == []
