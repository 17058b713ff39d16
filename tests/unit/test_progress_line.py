"""The launcher's progress line (cli/progress_line.py, cli/progress_show.py): its words from given
figures, the terminal or not, ``--progress-every``'s input, and every line the launcher's builders
make within 80 columns."""

from __future__ import annotations

import asyncio
import fcntl
import io
import logging
import os
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.live_manager import running
from undying.cli.progress_line import clock, fit, live_line, periodic_line, progress_every_arg
from undying.cli.progress_show import LIVE, OFF, PERIODIC, ProgressShow, choose_mode
from undying.cli.summary import banner
from undying.errors import UsageError

URL = "http://127.0.0.1:41234"
NOW = 1_000_000.0


def status(*, step: int = 40, total: int | None = 80, rate: float | None = 2.5, eta: float | None = 16.0,
           ratio: float | None = 0.931, incidents: list[dict[str, Any]] | None = None, state: str = "running",
           has_steps: bool = True) -> dict[str, Any]:
    """Figures as ``Manager.status()`` gives them (the keys the line reads)."""
    return {"state": state, "step": step, "has_steps": has_steps, "started_at": NOW - 125.0,
            "progress": {"step": step, "total_steps": total, "fraction": step / total if total else None,
                         "steps_per_s": rate, "eta_s": eta},
            "goodput": {"ratio": ratio}, "incidents": incidents or []}


def incident(n: int, *, rank: int = 1, state: str = "recovered", recovery: int = 0, restart: int | None = None,
             kind: str = "crash") -> dict[str, Any]:
    detail = {"restart": restart} if restart is not None else {}
    return {"id": n, "kind": kind, "rank": rank, "status": state, "recovery": recovery, "fault_t": NOW - 60 + n,
            "action": "restart" if restart is not None else "replace", "detail": detail, "phases": {}}


def test_the_live_line_says_step_rate_eta_goodput_incidents_and_the_url() -> None:
    wide = live_line(status(), url=URL, now=NOW, width=200)
    assert wide == (f"step 40/80, 50%, 2.5 it/s, ETA 0:16, goodput 93%, 0 incidents, {URL}")
    # At 80 columns the percentage goes first (the step of total says it); the rest stays.
    assert live_line(status(), url=URL, now=NOW, width=80) == \
        f"step 40/80, 2.5 it/s, ETA 0:16, goodput 93%, 0 incidents, {URL}"
    # Narrower: the rate next (the ETA is measured from it); the step, ETA and incidents stay.
    assert live_line(status(), url=URL, now=NOW, width=70) == \
        f"step 40/80, ETA 0:16, goodput 93%, 0 incidents, {URL}"
    slow = live_line(status(rate=0.25, eta=160.0, step=4000, total=100_000), url=URL, now=NOW, width=200)
    assert "4 s/it" in slow and "ETA 2:40" in slow and "step 4000/100000, 4%" in slow
    recovering = live_line(status(state="recovering", incidents=[incident(1), incident(2, state="open")]),
                           url=URL, now=NOW, width=200)
    assert recovering.startswith("recovering, step 40/80") and "2 incidents (1 open)" in recovering
    # Before the first step: no rate, ETA or goodput to show yet; no total before the loop reported one.
    assert live_line(status(step=0, total=None, rate=None, eta=None, ratio=0.0, state="starting"), url=URL,
                     now=NOW, width=80) == f"starting, step 0, 0 incidents, {URL}"


def test_a_script_without_steps_shows_its_time_and_its_restarts_with_their_cause() -> None:
    one = [incident(1, recovery=1, restart=1)]
    assert live_line(status(has_steps=False, incidents=one), url=URL, now=NOW, width=200) == \
        f"elapsed 2:05, 1 restart (crash of rank 1), 1 incident, {URL}"
    two = [*one, incident(2, rank=0, recovery=2, restart=2, kind="hang")]
    line = periodic_line(status(has_steps=False, incidents=two), now=NOW, width=61)
    assert line == "elapsed 2:05, 2 restarts (last: hang of rank 0), 2 incidents"
    assert "step" not in line and "goodput" not in line
    assert periodic_line(status(has_steps=False), now=NOW, width=61) == "elapsed 2:05, 0 restarts, 0 incidents"


def test_every_line_fits_its_width_however_large_the_figures() -> None:
    many = [incident(n, state="open" if n % 2 else "recovered") for n in range(1, 1234)]
    for figures in (status(), status(step=12_345_678, total=99_999_999, rate=1234.5678, eta=360_000.0,
                                     incidents=many, state="recovering"),
                    status(has_steps=False, incidents=[incident(n, recovery=n, restart=n) for n in range(1, 40)])):
        for width in (80, 79, 61, 40):
            line = live_line(figures, url="http://[fd00::1234:5678:9abc]:65535", now=NOW, width=width)
            assert len(line) <= width, (width, line)
            assert len(periodic_line(figures, now=NOW, width=width)) <= width
    assert fit([(99, "x" * 100)], 10) == "x" * 9 + "…"


def test_the_figures_come_from_the_managers_own_status(tmp_path: Path) -> None:
    """The keys the line reads are the ones a real Manager's status has (no second bookkeeping)."""
    manager, _ = running(tmp_path)
    try:
        line = live_line(manager.status(), url=URL, now=time.time(), width=80)
    finally:
        manager.close()
    assert line.startswith("step 4, ") and line.endswith(f"0 incidents, {URL}"), line


def test_a_script_without_steps_has_its_restarts_from_the_managers_own_status(tmp_path: Path) -> None:
    from tests.unit.test_no_step_summary import crash, torchrun_job

    manager, _ = torchrun_job(tmp_path)
    try:
        crash(manager, 1, time.time())
        line = live_line(manager.status(), url=URL, now=time.time(), width=80)
    finally:
        manager.close()
    assert re.fullmatch(rf"elapsed 0:0\d, 1 restart \(crash of rank 1\), 1 incident, {URL}", line), line


def test_clock() -> None:
    assert [clock(s) for s in (None, -1.0, 0.4, 7.0, 725.0, 11_045.0)] == ["-", "-", "0:00", "0:07", "12:05",
                                                                          "3:04:05"]


@pytest.mark.parametrize("text", ["abc", "", "-1", "nan", "inf", "86401", "1e9"])
def test_progress_every_refuses_what_is_no_interval_in_one_line(text: str) -> None:
    with pytest.raises(UsageError) as refused:
        progress_every_arg(text)
    said = str(refused.value)
    assert said.startswith("--progress-every ") and "\n" not in said and "0 (off)" in said


def test_progress_every_takes_seconds_and_0_for_off() -> None:
    assert [progress_every_arg(t) for t in ("0", "0.5", "30", "86400")] == [0.0, 0.5, 30.0, 86400.0]


def test_a_bad_progress_every_is_one_line_from_both_commands(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for argv in (["run", "--job-dir", str(tmp_path / "j"), "--progress-every", "-5", str(script)],
                 ["manager", "--job-id", "m", "--job-dir", str(tmp_path / "m"), "--progress-every", "soon"]):
        done = subprocess.run([sys.executable, "-m", "undying", *argv], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and "--progress-every" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "j").exists() and not (tmp_path / "m").exists()


def test_a_terminal_gets_the_live_line_and_anything_else_the_periodic_one(tmp_path: Path) -> None:
    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty, open(tmp_path / "out.log", "w") as file:
            assert choose_mode(tty, 30.0, env={"TERM": "xterm"}) == LIVE
            assert choose_mode(tty, 30.0, env={"TERM": "dumb"}) == PERIODIC  # no cursor to move
            assert choose_mode(file, 30.0, env={"TERM": "xterm"}) == PERIODIC
            assert choose_mode(io.StringIO(), 30.0) == PERIODIC
            assert choose_mode(tty, 0.0, env={"TERM": "xterm"}) == OFF
            assert choose_mode(file, 0.0) == OFF
    finally:
        os.close(leader)
        os.close(follower)


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_the_live_line_is_rewritten_in_place_and_log_lines_print_above_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("UNDYING_LIVE_LINE", raising=False)
    monkeypatch.setattr("undying.cli.progress_show._REDRAW_S", 0.05)
    leader, follower = os.openpty()
    figures = status(step=1)
    handler: logging.StreamHandler[Any] | None = None
    try:
        tty = open(follower, "w", closefd=False)  # noqa: SIM115 - closed in finally
        handler = logging.StreamHandler(tty)
        logging.getLogger().addHandler(handler)

        async def show() -> None:
            shown = ProgressShow(lambda: figures, URL, 30.0, stream=tty).start()
            assert shown.mode == LIVE
            await asyncio.sleep(0.3)
            figures.update(status(step=2))
            await asyncio.sleep(0.3)
            logging.getLogger("undying.test").warning("a line of the log")
            await asyncio.sleep(0.2)
            shown.close()
            # After close, the log writes where it did, and nothing draws the line again.
            logging.getLogger("undying.test").warning("after the job")

        asyncio.run(show())
        tty.flush()
        text = _read_all(leader).decode()
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
        os.close(leader)
        os.close(follower)
    erase = "\r\x1b[K"
    assert f"{erase}step 1/80" in text and f"{erase}step 2/80" in text, repr(text)
    assert text.count(f"{erase}step 2/80") >= 2, repr(text)  # drawn again, in place
    # The log line: the progress line erased first, the line, then the progress line drawn again below.
    before, _, after = text.partition("a line of the log")
    assert before.endswith(erase) and after.startswith(f"\r\n{erase}step 2/80"), repr(text)
    # At the end the line is erased and what follows prints on its own line, with no progress after it.
    assert text.rstrip().endswith("after the job") and "step" not in text.partition("after the job")[2]
    assert all(len(line) <= 80 for line in text.replace(erase, "\n").splitlines())
    # Ranks started after the line is gone print plainly: the setting leaves with it (it leaked
    # into this test process once, and a later test's rank erased a line that was never drawn).
    assert "UNDYING_LIVE_LINE" not in os.environ


def test_off_the_terminal_a_progress_line_every_interval_within_80_columns() -> None:
    out = io.StringIO()

    async def show() -> None:
        shown = ProgressShow(lambda: status(), URL, 0.05, stream=out).start()
        assert shown.mode == PERIODIC
        await asyncio.sleep(0.4)
        shown.close()

    asyncio.run(show())
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and "\r" not in out.getvalue() and "\x1b" not in out.getvalue(), lines
    for line in lines:
        assert line.startswith("[undying ") and "] step 40/80, " in line and len(line) <= 80, line


def test_the_banner_fits_80_columns_with_a_path_or_url_alone_on_its_line() -> None:
    deep = "/home/someone/experiments/undying-jobs/" + "a-long-folder-name/" * 4 + "job-20261129-150258-c0001c"
    for job_dir, token_from in (("/jobs/j1", ""), (deep, f"{deep}/token (new)")):
        for open_status in (False, True):
            lines = banner("job-20261129-150258-c0001c", job_dir, URL, ranks=4, open_status=open_status,
                           token_from=token_from)
            flat = " ".join(" ".join(lines).split())
            assert f"job dir: {job_dir}" in flat and f"status page: {URL}" in flat
            assert f"status: undying status --job-dir {job_dir} (--watch to follow it)" in flat
            for line in lines:
                assert len(line) <= 80 or (deep in line and len(line.split()) <= 2), line


LOGS = """
import logging, sys
from undying.config import show_launcher_log
show_launcher_log(False)
logging.getLogger("undying.manager").warning(
    "job job-20261129-150258-c0001c gen 0: crash of rank 1 at step 5 -> replace (rank 1 exited; a new "
    "process takes its place) in 12.6 s, files in " + "/a-long-folder-name" * 5)
try:
    raise ValueError("kept as it is")
except ValueError:
    logging.getLogger("undying.manager").exception("failed")
"""


def _log_to(stderr: int) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-c", LOGS], stderr=stderr, stdout=subprocess.DEVNULL, timeout=60,
                          check=True)


def test_the_launchers_log_lines_fit_80_columns_on_a_terminal_and_stay_whole_in_a_file(tmp_path: Path) -> None:
    leader, follower = os.openpty()
    try:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        _log_to(follower)
        lines = _read_all(leader).decode().replace("\r\n", "\n").splitlines()
    finally:
        os.close(leader)
        os.close(follower)
    record = lines[:lines.index(next(line for line in lines if "ERROR] failed" in line))]
    assert len(record) > 1 and record[0].startswith("[undying ") and "WARNING] job " in record[0], lines
    assert all(line.startswith("  ") for line in record[1:]), record
    path = "/a-long-folder-name" * 5
    for line in record:
        assert len(line) <= 80 or line.strip() == path, line  # (a path alone on its line)
    said = " ".join(" ".join(record).split())
    assert said.endswith("a new process takes its place) in 12.6 s, files in " + path), said
    assert "12.6 s" in "\n".join(record)  # a number and its unit on one line
    assert "Traceback" in "\n".join(lines) and any(line == "ValueError: kept as it is" for line in lines)
    with open(tmp_path / "log", "wb") as file:
        _log_to(file.fileno())
    whole = (tmp_path / "log").read_text().splitlines()
    assert whole[0].endswith("files in " + path) and "WARNING] job " in whole[0], whole
