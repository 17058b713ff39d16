"""The async writer blocks only for the CPU copy, never reads live tensors, and never loses an error."""

from __future__ import annotations

import gc
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import undying.checkpoint.replicated as replicated_mod
import undying.checkpoint.writer as writer_mod
from undying.checkpoint import (
    AsyncCheckpointer,
    CheckpointWriteError,
    SaveResult,
    latest_valid,
    load_replicated,
    save_replicated,
)
from undying.checkpoint.cpu_copy import cpu_copy
from undying.checkpoint.gasp import measure, recent_dying_gasp, state_nbytes


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every background write until set, so a test can act while a write is in flight."""
    event = threading.Event()
    real = writer_mod.save_replicated

    def held(*args: Any, **kw: Any) -> SaveResult:
        assert event.wait(10), "test never opened the gate"
        return real(*args, **kw)

    monkeypatch.setattr(writer_mod, "save_replicated", held)
    return event


def test_save_blocks_only_for_the_copy_and_never_reads_live_tensors(tmp_path: Path, gate: threading.Event) -> None:
    w = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    live = {"model": {"w": w}, "step": 3}
    ckpt = AsyncCheckpointer(tmp_path, job_id="j", world_size=2)
    ticket = ckpt.save(3, live)
    assert not ticket.skipped and ticket.waited_s == 0.0
    assert 0.0 < ticket.blocking_s < 5.0
    assert ckpt.busy  # save returned while the write is still held
    w.add_(1.0)  # training goes on and mutates the live state in place
    live["step"] = 4
    gate.set()
    result = ckpt.wait(timeout=30)
    assert result is not None and result.step == 3
    assert result.blocking_s == ticket.blocking_s and result.write_s > 0
    assert result.bytes > w.numel() * 4
    state, manifest = load_replicated(result.path)
    assert torch.equal(state["model"]["w"], torch.arange(1 << 20, dtype=torch.float32))
    assert state["step"] == 3 and manifest.world_size == 2 and manifest.job_id == "j"


def test_skip_policy_skips_while_busy_but_never_a_dying_gasp(tmp_path: Path, gate: threading.Event) -> None:
    ckpt = AsyncCheckpointer(tmp_path, if_busy="skip")
    ckpt.save(1, {"x": torch.ones(4)})
    assert ckpt.save(2, {"x": torch.ones(4)}).skipped
    threading.Timer(0.2, gate.set).start()
    gasp = ckpt.save(3, {"x": torch.ones(4)}, kind="dying-gasp")
    assert not gasp.skipped and gasp.waited_s > 0.1
    result = ckpt.wait(timeout=30)
    assert result is not None and (result.step, result.kind) == (3, "dying-gasp")
    found, _ = latest_valid(tmp_path)
    assert found is not None and found.step == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001", "step-000000003"]


def test_skip_policy_never_skips_the_jobs_last_step(tmp_path: Path, gate: threading.Event) -> None:
    """Found under load: the job's last periodic save was skipped while the one before still wrote, so the
    job ended with its newest state saved nowhere (the last valid checkpoint a save behind)."""
    ckpt = AsyncCheckpointer(tmp_path, if_busy="skip")
    ckpt.save(8, {"x": torch.ones(4)})
    threading.Timer(0.2, gate.set).start()
    final = ckpt.save(16, {"x": torch.ones(4)}, last=True)
    assert not final.skipped and final.waited_s > 0.1
    result = ckpt.wait(timeout=30)
    assert result is not None and result.step == 16
    found, _ = latest_valid(tmp_path)
    assert found is not None and found.step == 16


def test_wait_policy_waits_for_the_previous_write(tmp_path: Path, gate: threading.Event) -> None:
    ckpt = AsyncCheckpointer(tmp_path, keep=1)
    ckpt.save(1, {"x": torch.ones(4)})
    threading.Timer(0.2, gate.set).start()
    second = ckpt.save(2, {"x": torch.ones(4)})
    assert not second.skipped and second.waited_s > 0.1
    assert ckpt.wait(timeout=30) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000002"]  # keep=1 pruned step 1


def test_background_exception_is_kept_and_raised_by_wait(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = AsyncCheckpointer(tmp_path)
    ckpt.save(1, {"x": torch.ones(2)})
    assert ckpt.wait(timeout=30) is not None
    ckpt.save(2, {"x": torch.ones(2), "bad": lambda: None})  # cannot be pickled: fails in the thread
    with pytest.raises(CheckpointWriteError, match="checkpoint write of step 2 failed") as info:
        ckpt.wait(timeout=30)
    assert info.value.step == 2 and info.value.__cause__ is not None
    assert ckpt.last_error is info.value and ckpt.errors == [info.value]
    assert "checkpoint write of step 2 failed" in caplog.text  # logged when it happened
    assert ckpt.wait(timeout=30) is not None  # reported once; training goes on
    found, _ = latest_valid(tmp_path)
    assert found is not None and found.step == 1  # the failed save touched nothing
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000001"]
    ckpt.save(3, {"x": torch.ones(2)})  # the retry
    result = ckpt.wait(timeout=30)
    assert result is not None and result.step == 3


def test_context_manager_surfaces_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointWriteError), AsyncCheckpointer(tmp_path) as ckpt:
        ckpt.save(1, {"bad": lambda: None})


def test_cpu_copy_is_deep_and_keeps_ties() -> None:
    w = torch.ones(3)
    src: dict[str, Any] = {"a": w, "b": [w, {"n": 1}], "t": (torch.zeros(1), "s")}
    out = cpu_copy(src)
    assert out["a"] is out["b"][0] and out["a"] is not w
    w.add_(1)
    src["b"][1]["n"] = 2
    assert torch.equal(out["a"], torch.ones(3)) and out["b"][1]["n"] == 1
    assert isinstance(out["t"], tuple) and out["t"][1] == "s"


def test_measure_and_grace_period(tmp_path: Path) -> None:
    sd = {"w": torch.zeros(1024, 256), "tied": None}
    sd["tied"] = sd["w"]
    assert state_nbytes(sd) == 1024 * 256 * 4
    probe = measure(sd, tmp_path, probe_bytes=1 << 20)
    assert probe.bytes == 1 << 20 and probe.write_bytes_per_s > 0 and probe.source.startswith("probe")
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    result = save_replicated(tmp_path, 1, sd)
    m = measure(last=result)
    assert m.bytes == result.bytes and m.write_bytes_per_s == result.write_bytes_per_s
    assert m.grace_period_s(margin=2.0, minimum_s=0.0) == pytest.approx(2 * result.write_s)
    assert m.grace_period_s(minimum_s=5.0) >= 5.0


def test_recent_dying_gasp_is_reused(tmp_path: Path) -> None:
    save_replicated(tmp_path, 5, {"x": torch.ones(1)}, kind="periodic")
    assert recent_dying_gasp(tmp_path, within_s=60) is None
    result = save_replicated(tmp_path, 7, {"x": torch.ones(1)}, kind="dying-gasp", job_id="j")
    found = recent_dying_gasp(tmp_path, within_s=60, step=7, job_id="j")
    assert found is not None and found.url == result.path
    assert recent_dying_gasp(tmp_path, within_s=60, step=8) is None
    assert recent_dying_gasp(tmp_path, within_s=60, job_id="other") is None
    later = found.manifest.created_at + 120 if found.manifest else 0
    assert recent_dying_gasp(tmp_path, within_s=60, now=later) is None
    (tmp_path / "step-000000007" / "state.pt").write_bytes(b"torn")
    assert recent_dying_gasp(tmp_path, within_s=60) is None  # a corrupt one is never reused


def test_one_writer_thread_started_up_front_and_stopped_by_close(tmp_path: Path) -> None:
    """Starting a thread inside save would stall the caller; the writer lives as long as the checkpointer."""
    ckpt = AsyncCheckpointer(tmp_path / "a")
    writer = ckpt._thread
    assert writer is not None and writer.is_alive()  # started by the constructor
    for step in (1, 2, 3):
        ckpt.save(step, {"x": torch.ones(2)})
        assert ckpt.wait(timeout=30) is not None
    assert ckpt._thread is writer and writer.is_alive()  # the same thread wrote all three
    assert ckpt.close(timeout=30) is not None
    assert not writer.is_alive()
    ckpt.save(4, {"x": torch.ones(2)})  # a save after close starts it again
    result = ckpt.close(timeout=30)
    assert result is not None and result.step == 4
    dropped = AsyncCheckpointer(tmp_path / "b")
    orphan = dropped._thread
    assert orphan is not None
    dropped.save(1, {"x": torch.ones(2)})
    dropped.wait(timeout=30)
    del dropped  # never closed: its thread notices and ends
    gc.collect()
    orphan.join(10)
    assert not orphan.is_alive()


def test_state_file_skips_torchs_second_checksum_and_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest's checksum covers every byte; torch's per-record CRCs would hash them all again."""
    sd: dict[str, Any] = {"w": torch.randn(64, 8), "nested": [torch.arange(5), {"k": 2}]}
    assert torch.serialization.get_crc32_options()
    result = save_replicated(tmp_path / "a", 1, sd)
    assert torch.serialization.get_crc32_options()  # torch's switch is back as it was
    with zipfile.ZipFile(Path(result.path) / "state.pt") as z:
        assert {info.CRC for info in z.infolist()} == {0}
    loaded = torch.load(Path(result.path) / "state.pt", weights_only=True)
    assert torch.equal(loaded["w"], sd["w"]) and loaded["nested"][1] == {"k": 2}
    # A torch without the internals it uses: plain torch.save, same contents.
    monkeypatch.setattr(replicated_mod, "_torch_internals", lambda: None)
    fallback = save_replicated(tmp_path / "b", 1, sd)
    state, _ = load_replicated(fallback.path)
    assert torch.equal(state["w"], sd["w"])
