"""The status web page in a real headless Chromium, against a real running job.

It loads, shows the job's ranks with their PIDs, loads nothing from outside the
manager, raises no script error, and a crash injected through the API shows up
as an incident (and then as recovered) while the page stays the same document:
it updates itself, no reload. The manager wants the job's token: the test takes
it from the job dir (where the launcher wrote it, 0600), opens the page as
``/?token=...``, and checks that the page's polls carry it as a header, never
in an address, and that the page and the API refuse a caller without it.

Needs Debian's ``chromium`` and the ``playwright`` package (the ``test`` extra);
playwright drives the system's Chromium over the DevTools protocol, so no
browser download is involved. Without either, the test skips and says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.jobs import manager_url, start_job, wait_for
from undying.cli.client import api_get, api_post
from undying.manager.auth import TOKEN_FILE, read_token_file

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


def refused(address: str) -> int | None:
    """The HTTP status of a GET with no token at all (not even env's); None if it was let in."""
    try:
        with urllib.request.urlopen(address, timeout=5):
            return None
    except urllib.error.HTTPError as e:
        return e.code


def test_the_page_shows_the_job_and_an_injected_crash_without_a_reload(tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, JOB_ARGS, ranks=2, reap=reap)
    url = manager_url(job_dir)
    assert stat.S_IMODE((job_dir / TOKEN_FILE).stat().st_mode) == 0o600
    token = read_token_file(job_dir / TOKEN_FILE)

    def status() -> dict[str, Any]:
        return dict(api_get(url, "/api/status", token=token))

    running = wait_for(lambda: (s := status())["state"] == "running" and s["step"] >= 2 and s, 60,
                       "the job to run past step 2")
    pids = {r["rank"]: r["pid"] for r in running["ranks"]}
    assert refused(url + "/") == 401 and refused(url + "/api/status") == 401
    assert refused(url + "/?token=wrong") == 401

    with browser_page() as page:
        errors: list[str] = []
        outside: list[str] = []
        loads: list[str] = []
        polls: list[tuple[str, str | None]] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
        page.on("request", lambda r: polls.append((r.url, r.headers.get("authorization")))
                if "/api/" in r.url else None)
        page.on("load", lambda p: loads.append(p.url))

        page.goto(f"{url}/?token={token}")
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

        injected = api_post(url, "/api/inject", {"kind": "crash", "rank": 1}, token=token)
        assert injected["pid"] == pids[1]
        incident = page.wait_for_selector("#incidents tbody tr[data-kind='crash'][data-rank='1']", timeout=20_000)
        assert incident is not None and "replace" in incident.inner_text()
        # The recovery finishes and the same row shows it, with its timeline.
        page.wait_for_function(
            "(() => { const r = document.querySelector(\"#incidents tbody tr[data-kind='crash']\");"
            " return r && r.innerText.includes('recovered') && r.innerText.includes('first_step_done'); })()",
            timeout=30_000,
        )
        new_pid = wait_for(lambda: (p := status()["ranks"][1]["pid"]) != pids[1] and p, 10, "the replacement")
        page.wait_for_function(
            f"document.querySelector(\"#ranks tbody tr[data-rank='1']\").innerText.includes('{new_pid}')",
            timeout=10_000,
        )
        assert page.evaluate("window.stillTheSamePage === true"), "the page was reloaded"
        assert len(loads) == 1, loads
        assert not outside, f"the page loaded from outside the manager: {outside}"
        assert not errors, errors
        # Every poll showed the token as a header; none put it in an address (where logs and history keep it).
        assert polls and all(auth == f"Bearer {token}" for _, auth in polls), polls[:3]
        assert not [u for u, _ in polls if "token" in u], polls[:3]

    api_post(url, "/api/stop", {}, token=token)
    launcher.wait(timeout=30)
