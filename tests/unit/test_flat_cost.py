"""A long job costs the manager no more than a short one: the book, the log and the status do not
grow per rank-step.

Thresholds, never timings: the book holds one entry per rank after 100,000
commits; the log grows by at most ``64 + 12 x ranks x (1 + values)`` bytes per
node-step (was ~64 bytes per rank-step, a row each); ``status --json`` after
3,000 steps is the size it was after 500. A log written before (schema 1, a
row per rank and step) reads as it did, and a manager restarted on it goes on.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest

from undying.cli.main import main
from undying.cli.status import STATUS_STEP_ROWS, step_values
from undying.config import JobConfig
from undying.jobfiles.events import EventLog, LogReader
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.step_rows import in_time_order, pack, rank_runs, ranks_of, unpack
from undying.manager.manager import Manager
from undying.manager.membership import RankBook
from undying.protocol.node_wire import NodeStep

OLD_LOG = Path(__file__).parent / "data" / "events-v1.db"  # a real 2-rank, 8-step job's, schema 1


def _size(log: EventLog) -> int:
    """The log's bytes with everything written folded into the file."""
    log.flush()
    log.db.execute("COMMIT")
    log.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    log.db.execute("BEGIN")
    return os.path.getsize(log.path)


def test_the_book_holds_one_entry_per_rank_after_100000_commits(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.db")
    book = RankBook(log, 4, [0])
    for step in range(1, 25_001):
        for rank in range(4):
            assert not book.commit(rank, step, 0, float(step))
    assert len(book.committed) == 4 and book.rerun_steps == set() and len(book.stepped) == 1
    assert book.newest_step() == book.slowest_step() == 25_000
    # A roll-back: the steps committed again are re-runs, the newest is still one number per rank.
    assert book.commit(2, 24_999, 1, 1.0) and book.commit(2, 25_000, 1, 2.0)
    assert not book.commit(2, 25_001, 1, 3.0)
    assert book.rerun_steps == {24_999, 25_000} and book.committed == {0: 25_000, 1: 25_000, 2: 25_001,
                                                                       3: 25_000}
    log.close()


def test_a_restarted_book_takes_the_newest_steps_and_still_sees_a_re_run(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.db")
    log.steps([(r, s, 0, 10.0 * s + r, {"loss": 1.0}) for s in (1, 2, 3) for r in (0, 1)])
    saved = log.saved_job()
    assert saved.newest_steps == {0: 3, 1: 3}
    book = RankBook(log, 2, [0])
    book.restore(saved.ranks, saved.newest_steps)
    assert book.newest_step() == 3 and book.commit(0, 3, 1, 99.0) and book.rerun_steps == {3}
    log.close()


@pytest.mark.parametrize(("nodes", "per_node", "values"), [(4, 8, 1), (4, 8, 0), (4, 8, 3), (1, 64, 1)])
def test_the_log_grows_by_at_most_a_stated_size_per_node_step(tmp_path: Path, nodes: int, per_node: int,
                                                              values: int) -> None:
    log = EventLog(tmp_path / "events.db")

    def train(first: int, last: int) -> None:
        for step in range(first, last):
            for node in range(nodes):  # a node's commits of a step come in one report (NodeStep)
                log.steps([(rank, step, 0, 1.7e9 + step + rank * 1e-4,
                            {f"v{k}": 1.0 / (step + rank + k) for k in range(values)})
                           for rank in range(node * per_node, (node + 1) * per_node)])
            if step % 10 == 0:
                log.flush()

    train(1, 300)
    before = _size(log)
    train(300, 1300)
    per_node_step = (_size(log) - before) / (1000 * nodes)
    assert per_node_step <= 64 + 12 * per_node * (1 + values)
    if values == 1:  # (a row per rank and step, as before, took about 64 bytes for each rank)
        assert per_node_step < 0.5 * 64 * per_node
    log.close()


def test_a_node_step_row_reads_back_exactly() -> None:
    commits = [(3, 7, 2, 1.7e9 + 0.123456789, {"loss": math.nan, "g": -0.0}),
               (4, 7, 2, 1.7e9 + 0.1, {"loss": math.inf, "g": 1e-300}),
               (9, 7, 2, 1.7e9 + 0.2, {"loss": "-inf", "g": 5}),
               (5, 7, 2, 1.7e9 + 0.3, {})]  # (another set of names: a row of its own)
    first, second = pack(commits)
    assert first[3] == "3-4,9" and second[3] == "5"
    back = unpack(first) + unpack(second)
    assert [(c.rank, c.step, c.generation, c.t) for c in back] == [c[:4] for c in commits]
    assert math.isnan(back[0].metrics["loss"]) and math.copysign(1, back[0].metrics["g"]) == -1
    assert back[1].metrics == {"loss": math.inf, "g": 1e-300}
    assert back[2].metrics == {"loss": -math.inf, "g": 5.0} and back[3].metrics == {}
    assert ranks_of(rank_runs([0, 1, 2, 3, 6, 8, 9, 2])) == [0, 1, 2, 3, 6, 8, 9, 2]
    with pytest.raises(ValueError, match="holds 8 numbers for 3 rank"):
        unpack(first[:5] + (first[5][:64],))
    # Rows whose commits overlap in time come out in time order, merged with a schema-1 table's.
    a, b = pack([(0, 1, 0, 1.0, {}), (1, 1, 0, 4.0, {})]), pack([(2, 1, 0, 2.0, {}), (3, 1, 0, 3.0, {})])
    old = unpack(pack([(9, 1, 0, 2.5, {})])[0])
    assert [c.rank for c in in_time_order(old, a + b)] == [0, 2, 9, 3, 1]


def test_a_log_written_before_node_steps_reads_as_it_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jd = JobDir(tmp_path / "job")
    jd.prepare()
    shutil.copyfile(OLD_LOG, jd.events_db)
    with LogReader(jd.events_db) as reader:
        commits = reader.commits()
        assert len(commits) == 16 and [c.t for c in commits] == sorted(c.t for c in commits)
        assert {(c.rank, c.step) for c in commits} == {(r, s) for r in (0, 1) for s in range(1, 9)}
        assert all(math.isfinite(c.metrics["loss"]) for c in commits)
        assert reader.newest_step() == 8 and reader.newest_steps() == {0: 8, 1: 8}
        assert [c.rank for c in reader.commits_of_step(3)] in ([0, 1], [1, 0])
        assert set(reader.first_commit_times()) == {0, 1}
    assert [(r["step"], r["rank"], r["runs"]) for r in step_values(jd)][:3] == [(1, 0, 1), (1, 1, 1), (2, 0, 1)]
    assert main(["status", "--job-dir", str(jd.path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "succeeded" and status["step"] == 8
    # A manager restarted on it (the upgrade mid-job): it reads the old rows and writes node rows beside them.
    log = EventLog(jd.events_db)
    saved = log.saved_job()
    assert saved.newest_steps == {0: 8, 1: 8} and len(list(saved.commits)) == 16
    last_t = commits[-1].t
    log.steps([(0, 9, 0, last_t + 1, {"loss": 0.5}), (1, 9, 0, last_t + 1.5, {"loss": 0.25})])
    log.close()
    with LogReader(jd.events_db) as reader:
        assert [(c.rank, c.step) for c in reader.commits()[-3:]] == [(commits[-1].rank, 8), (0, 9), (1, 9)]
        assert reader.newest_steps() == {0: 9, 1: 9}


def _manager(tmp_path: Path) -> tuple[Manager, JobDir]:
    jd = JobDir(tmp_path / "job")
    jd.prepare()
    return Manager(JobConfig(job_id="long", job_dir=str(jd.path), nproc_per_node=4, nnodes=2),
                   EventLog(jd.events_db)), jd


def _train(manager: Manager, first: int, last: int) -> None:
    for step in range(first, last):
        for node in (0, 1):
            ranks = [node * 4 + local for local in range(4)]
            manager.on_messages([NodeStep(0, step, ranks, [1.7e9 + step + 1e-3 * r for r in ranks],
                                          [{"loss": 1.0 / (step + r)} for r in ranks])])
        if step % 20 == 0:
            manager.events.flush()


def test_a_long_job_costs_the_manager_memory_and_status_no_more(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    manager, jd = _manager(tmp_path)
    _train(manager, 1, 2_000)  # (the page's series fill up to their capacity)
    early = len(json.dumps(manager.status(), default=str))
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        _train(manager, 2_000, 5_000)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    # The page's series (views/history.py) fill up to their capacity, then halve: bounded, but not flat
    # between two moments. The rest grows by goodput's ledger only (16 bytes a step of the job, not of a rank,
    # ~40 with its arrays' headroom), beside the commits held until the next flush (a window). Before, the
    # book alone kept ~100 bytes per rank-step: ~800 a step here.
    charts = [tracemalloc.Filter(False, "*/manager/views/history.py")]
    grown = sum(d.size_diff for d in after.filter_traces(charts).compare_to(before.filter_traces(charts),
                                                                              "filename"))
    assert grown / 3_000 < 100, f"the manager grew {grown / 3_000:.0f} bytes a step"
    history = manager.history
    assert all(len(series._n) <= history.capacity
               for series in (history.job, *history.ranks.values(), *history.values.values()))
    assert len(manager.core.book.committed) == 8
    late = len(json.dumps(manager.status(), default=str))
    assert late < 32_000 and abs(late - early) < 1_000, (early, late)
    manager.close()
    # The log's view of the ended job: its step values a window of the newest steps (every row: --steps).
    assert main(["status", "--job-dir", str(jd.path), "--json"]) == 0
    out = capsys.readouterr().out
    logged = json.loads(out)
    assert logged["step"] == 4_999 and len(logged["step_values"]) == STATUS_STEP_ROWS == 512
    assert logged["step_values_window"] == {"rows": 512, "max_rows": 512, "first_step": 4_936, "last_step": 4_999,
                                            "all": f"undying status --steps --job-dir {jd.path}"}
    assert [(r["step"], r["rank"]) for r in logged["step_values"][:2]] == [(4_936, 0), (4_936, 1)]
    assert len(out) < 100_000  # (it was every row: 40,000 of them here, ~4 MB)
