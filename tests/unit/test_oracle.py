"""compare_runs: the "no work lost" oracle, on hand-built records and on a real event log."""

from __future__ import annotations

import dataclasses
import math
import struct
from pathlib import Path
from typing import Any

from undying.demo.oracle import RunRecord, compare_runs, load_run
from undying.jobfiles.events import EventLog

LOSSES = {s: 1.0 / (s + 2) + 0.1 for s in range(1, 11)}


def record(**changes: Any) -> RunRecord:
    base = RunRecord(
        state="succeeded",
        losses=dict(LOSSES),
        inconsistent_steps=[],
        rerun_steps=[],
        digests={0: "aa", 1: "bb"},
        incidents=[],
        commits=20,
    )
    return dataclasses.replace(base, **changes)


def last_bit_flipped(x: float) -> float:
    (bits,) = struct.unpack("<q", struct.pack("<d", x))
    (y,) = struct.unpack("<d", struct.pack("<q", bits ^ 1))
    return y


def test_identical_runs() -> None:
    c = compare_runs(record(), record(incidents=[{"kind": "crash"}], commits=21))
    assert c.identical and c.digests_equal
    assert c.steps == 10 and c.lost_steps == 0
    assert c.mismatched_steps == [] and c.missing_steps == [] and c.reasons == []


def test_a_loss_differing_in_the_last_bit() -> None:
    for other in (last_bit_flipped(LOSSES[7]), math.nextafter(LOSSES[7], math.inf)):
        assert other != LOSSES[7] and abs(other - LOSSES[7]) < 1e-15
        faulty = record(losses={**LOSSES, 7: other})
        c = compare_runs(record(), faulty)
        assert not c.identical
        assert c.mismatched_steps == [7]
        assert any("losses differ at steps [7]" in r for r in c.reasons)


def test_a_missing_step() -> None:
    losses = dict(LOSSES)
    del losses[4]
    c = compare_runs(record(), record(losses=losses))
    assert not c.identical
    assert c.missing_steps == [4] and c.mismatched_steps == []
    assert any("missing" in r and "[4]" in r for r in c.reasons)


def test_an_extra_step() -> None:
    c = compare_runs(record(), record(losses={**LOSSES, 11: 0.5}))
    assert not c.identical
    assert any("only in the run with the fault: [11]" in r for r in c.reasons)


def test_rerun_steps_are_lost_work() -> None:
    c = compare_runs(record(), record(rerun_steps=[5, 6]))
    assert not c.identical
    assert c.lost_steps == 2
    assert any("re-run: [5, 6]" in r for r in c.reasons)


def test_a_failed_run_is_not_identical() -> None:
    for baseline, faulty in ((record(), record(state="failed")), (record(state="failed"), record())):
        c = compare_runs(baseline, faulty)
        assert not c.identical
        assert any("ended failed" in r for r in c.reasons)
        assert c.mismatched_steps == [] and c.missing_steps == []  # only the state differs


def test_different_final_states_are_not_identical() -> None:
    c = compare_runs(record(), record(digests={0: "aa", 1: "bc"}))
    assert not c.identical and not c.digests_equal
    assert any("ranks [1] ended in different states" in r for r in c.reasons), c.reasons
    c = compare_runs(record(), record(digests={0: "aa"}))  # a rank never reported its digest
    assert not c.identical and not c.digests_equal
    assert any("faulty run reported no final state for ranks [1]" in r for r in c.reasons), c.reasons


def test_no_digests_at_all_is_not_proof() -> None:
    c = compare_runs(record(digests={}), record(digests={}))
    assert not c.identical and not c.digests_equal


def test_an_empty_baseline_is_not_proof() -> None:
    c = compare_runs(record(losses={}), record(losses={}))
    assert not c.identical and c.steps == 0


def test_inconsistent_ranks_are_not_identical() -> None:
    c = compare_runs(record(), record(inconsistent_steps=[3]))
    assert not c.identical
    assert any("different losses at steps [3]" in r for r in c.reasons)


def _write_log(path: Path, commits: list[tuple[int, int, float]], digests: dict[int, str], state: str) -> None:
    log = EventLog(path)
    for i, (rank, step, loss) in enumerate(commits):
        log.step(rank, step, generation=0, t=1000.0 + i, metrics={"loss": loss})
    for rank, digest in digests.items():
        log.event("done", rank=rank, step=3, digest=digest)
    log.set_job("state", state)
    log.close()


def test_load_run_from_an_event_log(tmp_path: Path) -> None:
    a, b = 0.5, last_bit_flipped(0.5)
    commits = [
        (0, 1, 0.9), (1, 1, 0.9),
        (0, 2, 0.7), (1, 2, 0.7),
        (1, 2, 0.7),  # rank 1 completed step 2 twice
        (0, 3, a), (1, 3, b),  # the ranks disagree in the last bit
    ]
    path = tmp_path / "events.db"
    _write_log(path, commits, {0: "d0", 1: "d1"}, "succeeded")
    run = load_run(path)
    assert run.state == "succeeded"
    assert run.losses == {1: 0.9, 2: 0.7}
    assert run.inconsistent_steps == [3]
    assert run.rerun_steps == [2]
    assert run.digests == {0: "d0", 1: "d1"}
    assert run.commits == 7

    clean = tmp_path / "clean.db"
    _write_log(clean, [(r, s, 1.0 / s) for s in (1, 2, 3) for r in (0, 1)], {0: "d0", 1: "d1"}, "succeeded")
    base = load_run(clean)
    assert compare_runs(base, load_run(clean)).identical
    c = compare_runs(base, run)
    assert not c.identical and c.lost_steps == 1 and c.missing_steps == [3]
