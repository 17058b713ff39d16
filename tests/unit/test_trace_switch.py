"""The trace switch: parsing, the comm-needs-step rule, CLI semantics, the file watcher."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from undying.errors import UsageError
from undying.protocol.trace_switch import TraceSwitch, TraceSwitchError
from undying.trace import SwitchFileWatcher, read_switch_file


def parse(obj: object) -> TraceSwitch:
    return TraceSwitch.parse(obj, by="test", t=1.0)


# -- parse -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "step", "comm"),
    [
        ({}, False, False),
        ({"step": "on"}, True, False),
        ({"step": "ON", "comm": "On"}, True, True),
        ({"step": " off ", "comm": "off"}, False, False),
        ({"step": True, "comm": True}, True, True),
        ({"step": False}, False, False),
        ({"step": "on", "fp": "on", "data": True, "ckpt": "on"}, True, False),
        ({"step": "off", "fp": "off"}, False, False),
        ({"fp": False}, False, False),
        # to_dict's informational keys read back
        ({"step": True, "comm": False, "by": "cli", "t": 5.0}, True, False),
    ],
)
def test_parse_good(obj: object, step: bool, comm: bool) -> None:
    s = parse(obj)
    assert (s.step, s.comm, s.by, s.t) == (step, comm, "test", 1.0)


def test_parse_round_trips_to_dict() -> None:
    s = TraceSwitch(step=True, comm=True, by="api", t=3.5)
    d = s.to_dict()
    assert d == {"step": True, "comm": True, "by": "api", "t": 3.5}
    json.dumps(d)
    assert TraceSwitch.parse(d, by="api", t=3.5) == s


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ([], "JSON object"),
        ("on", "JSON object"),
        (None, "JSON object"),
        ({"stpe": "on"}, '"stpe"'),
        ({"step": "yes"}, "'step'"),
        ({"step": "yes"}, '"yes"'),
        ({"comm": 1}, "'comm'"),
        ({"step": None}, "'step'"),
        ({"step": ["on"]}, "'step'"),
        ({"step": "off", "fp": "on"}, "'fp'"),
        ({"step": "on", "data": "off"}, "switch together"),
        ({"ckpt": "on"}, "'ckpt'"),
        ({"step": "on", "fp": "maybe"}, "'fp'"),
    ],
)
def test_parse_bad_names_the_key_and_the_form(obj: object, needle: str) -> None:
    with pytest.raises(TraceSwitchError) as ei:
        parse(obj)
    msg = str(ei.value)
    assert needle in msg
    # Every message shows or names the allowed form.
    assert any(w in msg for w in ('"on"', "switch together", "comm markers need", "{")), msg


def test_error_is_a_usage_error() -> None:
    assert issubclass(TraceSwitchError, UsageError)


def test_comm_needs_step() -> None:
    with pytest.raises(TraceSwitchError, match="comm markers need the step markers"):
        TraceSwitch(step=False, comm=True)
    with pytest.raises(TraceSwitchError, match="turn step on too"):
        parse({"comm": "on"})
    with pytest.raises(TraceSwitchError, match="comm markers need"):
        parse({"step": "off", "comm": "on"})


def test_flags_must_be_bools() -> None:
    with pytest.raises(TraceSwitchError, match="'step' must be a bool"):
        TraceSwitch(step=1)  # type: ignore[arg-type]


def test_same_markers_ignores_who_and_when() -> None:
    a = TraceSwitch(step=True, by="cli", t=1.0)
    assert a.same_markers(TraceSwitch(step=True, by="api", t=2.0))
    assert not a.same_markers(TraceSwitch(step=True, comm=True))
    assert a.describe() == "step on, comm off"


# -- changed (CLI semantics) ---------------------------------------------------

OFF = TraceSwitch()
STEP = TraceSwitch(step=True)
BOTH = TraceSwitch(step=True, comm=True)


@pytest.mark.parametrize(
    ("before", "on", "comm_only", "after", "needle"),
    [
        (OFF, True, False, (True, False), "step markers"),
        (BOTH, True, False, (True, True), "comm markers stay on"),
        (OFF, True, True, (True, True), "step markers (step, ckpt, fp, data) on too"),
        (STEP, True, True, (True, True), "comm markers on"),
        (BOTH, True, True, (True, True), "already on"),
        (BOTH, False, True, (True, False), "comm markers off"),
        (STEP, False, True, (True, False), "already off"),
        (STEP, False, False, (False, False), "step markers (step, ckpt, fp, data) off"),
        (OFF, False, False, (False, False), "already off"),
    ],
)
def test_changed(
    before: TraceSwitch, on: bool, comm_only: bool, after: tuple[bool, bool], needle: str
) -> None:
    new, msg = before.changed(on=on, comm_only=comm_only, by="cli", t=9.0)
    assert (new.step, new.comm, new.by, new.t) == (*after, "cli", 9.0)
    assert needle in msg
    assert "\n" not in msg


def test_trace_off_turns_comm_off_too_and_says_so() -> None:
    new, msg = BOTH.changed(on=False, comm_only=False, by="cli", t=1.0)
    assert (new.step, new.comm) == (False, False)
    assert "comm markers turned off too: they need the step markers" in msg
    _, msg2 = STEP.changed(on=False, comm_only=False, by="cli", t=1.0)
    assert "comm" not in msg2


# -- read_switch_file ----------------------------------------------------------


def test_read_switch_file(tmp_path: Path) -> None:
    f = tmp_path / "switch.json"
    f.write_text('{"step": "on", "comm": "on"}')
    s = read_switch_file(f, t=2.0)
    assert (s.step, s.comm, s.by, s.t) == (True, True, f"file {f}", 2.0)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON"),
        ('{"step": "on"', "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"step": "sometimes"}', "'step'"),
        (b"\xff\xfe", "UTF-8"),
        ("x" * 70000, "larger than"),
    ],
)
def test_read_switch_file_bad(tmp_path: Path, content: str | bytes, needle: str) -> None:
    f = tmp_path / "switch.json"
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content)
    with pytest.raises(TraceSwitchError) as ei:
        read_switch_file(f)
    assert str(f) in str(ei.value)
    assert needle in str(ei.value)


def test_read_switch_file_missing_and_unreadable(tmp_path: Path) -> None:
    with pytest.raises(TraceSwitchError, match="does not exist"):
        read_switch_file(tmp_path / "nope.json")
    with pytest.raises(TraceSwitchError, match="cannot read"):
        read_switch_file(tmp_path)  # a directory


# -- SwitchFileWatcher ---------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.changes: list[TraceSwitch] = []
        self.errors: list[str] = []

    def watcher(self, path: Path, interval_s: float = 0.2) -> SwitchFileWatcher:
        return SwitchFileWatcher(path, self.changes.append, self.errors.append, interval_s)


def test_watcher_reports_changes_only(tmp_path: Path) -> None:
    f = tmp_path / "switch.json"
    f.write_text('{"step": "on"}')
    r = Recorder()
    w = r.watcher(f)
    got = w.poll_once()
    assert got is not None and got.step and not got.comm and got.by == f"file {f}"
    assert w.poll_once() is None  # same content
    f.write_text('{"step": "on", "comm": "off"}')  # new content, same markers
    assert w.poll_once() is None
    f.write_text('{"step": "on", "comm": "on"}')
    assert w.poll_once() is not None
    assert [(c.step, c.comm) for c in r.changes] == [(True, False), (True, True)]
    assert r.errors == []
    assert w.last_good is not None and w.last_good.comm


def test_watcher_bad_content_reported_once_last_good_kept(tmp_path: Path) -> None:
    f = tmp_path / "switch.json"
    f.write_text('{"step": "on"}')
    r = Recorder()
    w = r.watcher(f)
    w.poll_once()
    f.write_text("{oops")
    for _ in range(3):
        assert w.poll_once() is None
    assert len(r.errors) == 1
    assert "not valid JSON" in r.errors[0] and "keeping the last setting (step on" in r.errors[0]
    f.write_text('{"comm": "on"}')  # a different bad content: reported again
    w.poll_once()
    assert len(r.errors) == 2 and "comm markers need" in r.errors[1]
    assert w.last_good is not None and w.last_good.step
    f.write_text('{"step": "on"}')  # back to the good setting: no change to report
    assert w.poll_once() is None
    f.write_text("{oops")  # the same bad content after a good one: reported again
    w.poll_once()
    assert len(r.errors) == 3
    assert len(r.changes) == 1


def test_watcher_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "switch.json"
    r = Recorder()
    w = r.watcher(f)
    for _ in range(3):
        assert w.poll_once() is None
    assert len(r.errors) == 1 and "missing" in r.errors[0]
    f.write_text('{"step": "on"}')
    assert w.poll_once() is not None
    f.unlink()
    w.poll_once()
    w.poll_once()
    assert len(r.errors) == 2 and "keeping the last setting (step on, comm off)" in r.errors[1]
    f.write_text('{"step": "on"}')  # back with the same setting: nothing new
    assert w.poll_once() is None
    assert len(r.changes) == 1


def _configmap_write(mount: Path, content: str, version: int) -> None:
    """Update a mount the way kubelet does: new data dir, atomic swap of the ..data link."""
    data_dir = mount / f"..2026_11_23_10_15_0{version}.000000001"
    data_dir.mkdir()
    (data_dir / "switch.json").write_text(content)
    tmp_link = mount / "..data_tmp"
    os.symlink(data_dir.name, tmp_link)
    os.replace(tmp_link, mount / "..data")
    link = mount / "switch.json"
    if not link.is_symlink():
        os.symlink("..data/switch.json", link)


def test_watcher_follows_a_configmap_symlink_swap(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    mount.mkdir()
    _configmap_write(mount, '{"step": "on"}', 1)
    f = mount / "switch.json"
    r = Recorder()
    w = r.watcher(f)
    assert w.poll_once() is not None
    # Same size and mtime tricks do not matter: the content is compared.
    _configmap_write(mount, '{"step": "on", "comm": "on"}', 2)
    os.utime(mount / "..data" / "switch.json", (0, 0))
    assert w.poll_once() is not None
    _configmap_write(mount, '{"step": "off"}', 3)
    w.poll_once()
    assert [(c.step, c.comm) for c in r.changes] == [(True, False), (True, True), (False, False)]


def test_watcher_run_polls_until_cancelled(tmp_path: Path) -> None:
    f = tmp_path / "switch.json"
    f.write_text('{"step": "on"}')
    r = Recorder()
    w = r.watcher(f, interval_s=0.01)

    async def main() -> None:
        task = asyncio.create_task(w.run())
        for _ in range(200):
            if r.changes:
                break
            await asyncio.sleep(0.01)
        f.write_text('{"step": "off"}')
        for _ in range(200):
            if len(r.changes) == 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert [c.step for c in r.changes] == [True, False]


def test_watcher_survives_a_failing_callback(tmp_path: Path) -> None:
    f = tmp_path / "switch.json"
    f.write_text('{"step": "on"}')
    calls: list[TraceSwitch] = []

    def boom(s: TraceSwitch) -> None:
        calls.append(s)
        raise RuntimeError("callback bug")

    w = SwitchFileWatcher(f, boom, lambda m: None, interval_s=0.01)

    async def main() -> None:
        task = asyncio.create_task(w.run())
        await asyncio.sleep(0.05)
        f.write_text('{"step": "off"}')
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert [c.step for c in calls] == [True, False]


def test_watcher_rejects_bad_interval(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        SwitchFileWatcher(tmp_path / "x", lambda s: None, lambda m: None, interval_s=0)
