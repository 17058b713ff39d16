"""The status web page in a real headless Chromium, against a real running job.

It loads, shows the job's ranks with their PIDs, loads nothing from outside the
manager, raises no script error, and a crash injected through the API shows up
as an incident (and then as recovered) while the page stays the same document:
it updates itself, no reload.

Needs Debian's ``chromium`` and the ``playwright`` package (the ``test`` extra);
playwright drives the system's Chromium over the DevTools protocol, so no
browser download is involved. Without either, the test skips and says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.jobs import manager_url, start_job, status, wait_for, wait_running
from undying.cli.client import api_post

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium); the page is not browser-tested"
)

# 2 ranks, about 0.1 s a step, 8 epochs of 32 steps: ~26 s if nothing stops it; the test stops it sooner.
JOB_ARGS = ["--epochs", "8", "--step-seconds", "0.1"]


def _children() -> dict[int, int]:
    """PID -> parent PID of every process on the machine."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, IndexError, ValueError, ProcessLookupError):
                continue
    return out


def _descendants(root: int) -> set[int]:
    parents = _children()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


@contextlib.contextmanager
def browser_page() -> Iterator[Any]:
    """A page of a headless Chromium; the driver and every browser process are killed by PID after."""
    before = _descendants(os.getpid())
    started: set[int] = set()
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            started = _descendants(os.getpid()) - before
            try:
                yield browser.new_page()
            finally:
                browser.close()
    finally:
        # playwright's close normally ends them; whatever is left (a crashed driver) goes by PID.
        for pid in started | (_descendants(os.getpid()) - before):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_page_shows_the_job_and_an_injected_crash_without_a_reload(tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, JOB_ARGS, ranks=2, reap=reap)
    url = manager_url(job_dir)
    running = wait_running(url, min_step=2)
    pids = {r["rank"]: r["pid"] for r in running["ranks"]}

    with browser_page() as page:
        errors: list[str] = []
        outside: list[str] = []
        loads: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
        page.on("load", lambda p: loads.append(p.url))

        page.goto(url + "/")
        page.wait_for_selector("#ranks tbody tr[data-rank='1']", timeout=15_000)
        assert page.text_content("#job-state") == "running"
        rows = page.locator("#ranks tbody tr")
        assert rows.count() == 2
        for rank, pid in pids.items():
            row = page.locator(f"#ranks tbody tr[data-rank='{rank}']")
            assert str(pid) in row.inner_text(), row.inner_text()
        assert "no incidents" in page.inner_text("#incidents")
        # The step count moves on its own: the page polls.
        first = int(page.text_content("#step") or 0)
        page.wait_for_function(f"Number(document.getElementById('step').textContent) > {first}", timeout=10_000)
        page.evaluate("window.stillTheSamePage = true")

        injected = api_post(url, "/api/inject", {"kind": "crash", "rank": 1})
        assert injected["pid"] == pids[1]
        incident = page.wait_for_selector("#incidents tbody tr[data-kind='crash'][data-rank='1']", timeout=20_000)
        assert incident is not None and "replace" in incident.inner_text()
        # The recovery finishes and the same row shows it, with its timeline.
        page.wait_for_function(
            "(() => { const r = document.querySelector(\"#incidents tbody tr[data-kind='crash']\");"
            " return r && r.innerText.includes('recovered') && r.innerText.includes('first_step_done'); })()",
            timeout=30_000,
        )
        new_pid = wait_for(lambda: (p := status(url)["ranks"][1]["pid"]) != pids[1] and p, 10, "the replacement")
        page.wait_for_function(
            f"document.querySelector(\"#ranks tbody tr[data-rank='1']\").innerText.includes('{new_pid}')",
            timeout=10_000,
        )
        assert page.evaluate("window.stillTheSamePage === true"), "the page was reloaded"
        assert len(loads) == 1, loads
        assert not outside, f"the page loaded from outside the manager: {outside}"
        assert not errors, errors

    api_post(url, "/api/stop", {})
    launcher.wait(timeout=30)
