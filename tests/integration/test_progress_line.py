"""`undying run`'s progress: on a real pseudo-terminal one live line, rewritten in place; in a file
a line every --progress-every seconds. A fault-free run prints no warning either way."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from undying.demo import TRAIN_SCRIPT

ERASE = "\r\x1b[K"
SCRIPT_ARGS = ["--epochs", "1", "--samples", "512", "--step-seconds", "0.15"]  # 16 steps, 2.4 s or more


def _argv(job_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "undying", "run", "-n", "2", "--port", "0", "--job-dir", str(job_dir),
            "--job-id", job_dir.name, *extra, str(TRAIN_SCRIPT), *SCRIPT_ARGS]


def _on_a_terminal(argv: list[str], timeout_s: float = 180.0) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal of 80 columns as its stdin, stdout and stderr; its exit
    code and all it wrote."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    process = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower,
                               env={**os.environ, "TERM": "xterm"}, start_new_session=True)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # (EIO: every writer closed the terminal)
                    break
                if not chunk:
                    break
                out += chunk
            elif process.poll() is not None:
                break
        return process.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(errors="replace")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        os.close(leader)


def test_a_live_line_on_a_terminal_and_a_periodic_one_in_a_file(tmp_path: Path) -> None:
    rc, text = _on_a_terminal(_argv(tmp_path / "tty"))
    assert rc == 0, text[-3000:]
    url = re.search(r"status page: (http://127\.0\.0\.1:\d+)/", text)
    assert url, text[-3000:]
    # Every draw starts by erasing the line it replaces, and ends with no newline: in place.
    drawn = [part.split("\r")[0] for part in text.split(ERASE)[1:]]
    lines = [d for d in drawn if re.match(r"(starting, |recovering, )?step \d+", d)]
    steps = [d for d in lines if re.match(r"step \d+/16, ", d)]
    assert len(steps) >= 2, text[-3000:]  # drawn, then rewritten with newer figures
    assert all(d.endswith(f"0 incidents, {url.group(1)}") and len(d) <= 80 for d in lines), lines
    assert "\n" not in "".join(lines)
    # Then the line is taken off and the end summary prints where it was; no warning on the way.
    assert re.search(r"\x1b\[Kundying: job tty succeeded: step 16 of 16", text), text[-3000:]
    assert "WARNING" not in text, text[-3000:]
    # Every line within 80 columns but for a path alone on its line (the job dir's is long here).
    for line in text.replace(ERASE, "\n").replace("\r\n", "\n").splitlines():
        assert len(line) <= 80 or len(line.split()) == 1, line

    log = tmp_path / "file.log"
    with open(log, "wb") as out:
        done = subprocess.run(_argv(tmp_path / "file", "--progress-every", "0.5"), stdout=out,
                              stderr=subprocess.STDOUT, timeout=180)
    written = log.read_text(errors="replace")
    assert done.returncode == 0, written[-3000:]
    periodic = re.findall(r"^\[undying \d\d:\d\d:\d\d\] (?:starting, )?step \d+.*$", written, re.M)
    assert len(periodic) >= 2 and any(re.search(r"step \d+/16, ", p) for p in periodic), written[-3000:]
    assert all(len(p) <= 80 and p.endswith("0 incidents") for p in periodic), periodic
    assert "\r" not in written and "\x1b" not in written and "WARNING" not in written
