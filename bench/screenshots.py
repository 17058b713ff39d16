"""The docs' screenshots, made again from real runs: the status page of a job and the terminal
of a run with a crash and its recovery.

- ``docs/assets/screenshots/terminal-crash.svg``: the tutorial's step 7 as a user runs it, in a
  fresh folder: ``undying inject crash --rank 2 --at-step 60 --wait 60 ...`` arms the fault,
  then ``undying run -n 4 --job-id tutorial examples/undying_ddp.py`` runs on a pseudo-terminal
  80 columns wide; what the launcher wrote there (colours included) is drawn by rich's SVG
  export, with the system's monospace font (rich's own template would load a font from the web).
  The temporary folder it ran in is shown as ``~/project``; nothing else is changed.
- ``docs/assets/screenshots/status-page.png``: the status page of a 4-rank demo job (the demo's
  training script, 0.1 s a step) in headless Chromium, after a crash of rank 2 injected through
  the job's API was recovered; the PNG is cut to 256 colours (pillow, if installed) to stay small.

Needs the project installed (``pip install -e '.[test]'``), Debian's ``chromium`` and playwright
for the page. Each job runs in a temporary folder, and every process started here is stopped by
its PID at the end. The figures in a screenshot (times, PIDs, losses) are those of the run
that made it. Run it from the repository root::

    python bench/screenshots.py                  # both
    python bench/screenshots.py --only terminal  # or --only page
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "assets" / "screenshots"
COLUMNS, ROWS = 80, 24
HOME = "~/project"  # the temporary folder the drill runs in, as the terminal's screenshot names it
RUN = ["undying", "run", "-n", "4", "--job-id", "tutorial", "examples/undying_ddp.py"]
INJECT = ["undying", "inject", "crash", "--rank", "2", "--at-step", "60", "--wait", "60",
          "--job-dir", "undying-jobs/tutorial"]
# The demo's training script: 32 epochs of 0.1 s steps, long enough to watch, stopped once shot.
PAGE_JOB = ["--epochs", "32", "--step-seconds", "0.1"]
WEB = re.compile(r"[a-z]+://([^/:\s\"'<>]+)")  # the host of any address in the SVG
CURSOR = re.compile(r"\x1b\[[0-9;?]*[A-Za-ln-z]")  # escape sequences other than colours (m)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            value = predicate()
            if value:
                return value
        time.sleep(0.2)
    raise SystemExit(f"screenshots: timed out after {timeout:.0f} s waiting for {what}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """The process and its session (the launcher, its manager and ranks): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait)


def undying(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "undying", *args[1:]]


def on_terminal(argv: list[str], work: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``argv`` run on a fresh 80-column pseudo-terminal: its exit code and what it wrote there."""
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    process = subprocess.Popen(argv, cwd=work, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
                               start_new_session=True, env=env)
    os.close(terminal)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                raise SystemExit(f"screenshots: {argv[3:]} did not end within {timeout:.0f} s")
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal closed it
                break
            if not chunk:
                break
            out += chunk
        return process.wait(timeout=60), out.decode(errors="replace")
    finally:
        os.close(master)
        stop(process)


def capture_terminal(work: Path, timeout: float = 300) -> tuple[list[str], str]:
    """The tutorial's drill: the command run, and what its launcher wrote on the terminal.

    The launcher runs on the tutorial's command line; if its port is taken (another job on this
    machine), once more with ``--port 0`` (a free one), and the screenshot shows that command.
    """
    (work / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "undying_ddp.py", work / "examples")
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(COLUMNS), "LINES": str(ROWS)}
    inject = subprocess.Popen(undying(INJECT), cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        command = RUN
        code, raw = on_terminal(undying(command), work, env, timeout)
        if code == 2 and "is in use" in raw:
            command = [*RUN[:4], "--port", "0", *RUN[4:]]
            code, raw = on_terminal(undying(command), work, env, timeout)
        armed = inject.communicate(timeout=60)[0].decode(errors="replace").strip()
    finally:
        stop(inject)
    if "armed" not in armed or code != 0:
        raise SystemExit(f"screenshots: the drill did not run as the tutorial says: inject said {armed!r}, "
                         f"{' '.join(command)} exited {code}, saying:\n{raw}")
    return command, raw.replace(str(work), HOME)


def screen_lines(raw: str) -> list[str]:
    """The lines a terminal shows at the end: a line rewritten in place (\\r) keeps its last text."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        line = CURSOR.sub("", line)
        lines.append(next((part for part in reversed(line.split("\r")) if part), ""))
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def terminal_svg(command: list[str], raw: str) -> str:
    """The terminal's lines as an SVG of a terminal window, fonts from the system only."""
    from rich._export_format import CONSOLE_SVG_FORMAT
    from rich.console import Console
    from rich.text import Text

    console = Console(record=True, width=COLUMNS, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor", legacy_windows=False)
    console.print(Text("$ " + " ".join(command), style="bold"))
    for line in screen_lines(raw):
        console.print(Text.from_ansi(line), overflow="fold")
    template = re.sub(r"\s*@font-face \{\{.*?\}\}", "", CONSOLE_SVG_FORMAT, flags=re.S)
    template = re.sub(r"\s*<!-- Generated with Rich.*?-->", "", template)
    svg = console.export_svg(title="undying run: a crash and its recovery", code_format=template)
    web = set(WEB.findall(svg.replace('xmlns="http://www.w3.org/2000/svg"', ""))) - {"127.0.0.1", "localhost"}
    if web:
        raise SystemExit(f"screenshots: the terminal's SVG names an address on the web: {sorted(web)}")
    return svg


def capture_page(work: Path, png: Path, timeout: float = 180) -> None:
    """The status page of a running 4-rank job, after a crash of rank 2 it recovered from."""
    from playwright.sync_api import sync_playwright

    from undying.cli.client import api_get, api_post
    from undying.demo import TRAIN_SCRIPT
    from undying.jobfiles.jobdir import JobDir
    from undying.jobfiles.tokens import TOKEN_FILE, read_token_file

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("screenshots: no chromium on PATH (Debian: apt-get install chromium)")
    job_dir = work / "undying-jobs" / "demo"
    log = open(work / "page.log", "wb")  # noqa: SIM115 (open while the job runs)
    launcher = subprocess.Popen(
        undying(["undying", "run", "-n", "4", "--port", "0", "--job-id", "demo", str(TRAIN_SCRIPT),
                 *PAGE_JOB]),
        cwd=work, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = wait_for(lambda: (JobDir(job_dir).read_manager() or {}).get("url"), 60, "the job's manager")
        token = read_token_file(job_dir / TOKEN_FILE)

        def status() -> dict[str, Any]:
            return dict(api_get(url, "/api/status", token=token))

        wait_for(lambda: status()["state"] == "running" and status()["step"] >= 40, timeout, "step 40")
        api_post(url, "/api/inject", {"kind": "crash", "rank": 2}, token=token)
        wait_for(lambda: status()["state"] == "running" and status()["step"] >= 120, timeout,
                 "the recovery and step 120")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1200, "height": 900})
                page.goto(f"{url}/?token={token}")
                page.wait_for_function(
                    "(() => { const r = document.querySelector(\"#incidents tbody tr[data-kind='crash']\");"
                    " return r && r.innerText.includes('recovered'); })()", timeout=30_000)
                page.wait_for_function("document.getElementById('eta').textContent !== '–'", timeout=30_000)
                time.sleep(2)  # a few more polls: the charts drawn to the newest step
                page.screenshot(path=str(png), full_page=True)
            finally:
                browser.close()
        api_post(url, "/api/stop", {}, token=token)
        launcher.wait(timeout=60)
    finally:
        stop(launcher)
        log.close()


def shrink_png(png: Path) -> None:
    """256 colours and pillow's optimisation: a screenshot of flat colours loses nothing to see."""
    try:
        from PIL import Image
    except ImportError:
        print("screenshots: pillow is not installed; the PNG stays as Chromium wrote it", file=sys.stderr)
        return
    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(png, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--only", choices=("terminal", "page"), help="make one of the two screenshots")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the folder written (default: {OUT})")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="undying-shots-") as tmp:
        if args.only in (None, "terminal"):
            work = Path(tmp) / "terminal"
            work.mkdir()
            svg = args.out / "terminal-crash.svg"
            svg.write_text(terminal_svg(*capture_terminal(work)))
            print(f"{svg} ({svg.stat().st_size // 1024} KiB)")
        if args.only in (None, "page"):
            work = Path(tmp) / "page"
            work.mkdir()
            png = args.out / "status-page.png"
            capture_page(work, png)
            shrink_png(png)
            print(f"{png} ({png.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
