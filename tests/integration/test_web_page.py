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
from undying.jobfiles.tokens import TOKEN_FILE, read_token_file

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[test]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium); the page is not browser-tested"
)

# 2 ranks, about 0.1 s a step, 32 epochs of 32 steps: ~100 s if nothing stops it; the test stops it once it saw
# what it looks for. (8 epochs, ~26 s, once ran out under CI's load while a slow browser started: an ended job
# has no rate and no ETA, and the page rightly showed none.)
JOB_ARGS = ["--epochs", "32", "--step-seconds", "0.1"]


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
        # Progress and goodput, as the status API gives them: the total, a rate, an ETA, a share.
        try:
            page.wait_for_function("document.getElementById('eta').textContent !== '–'", timeout=10_000)
        except sync_api.TimeoutError as e:  # (say what the manager had and what the page last heard)
            raise AssertionError(f"no ETA on the page after 10 s: the job {status()['state']}, its progress "
                                 f"{status()['progress']}, the page's connection line "
                                 f"{page.text_content('#conn')!r}") from e
        progress = status()["progress"]
        assert str(progress["total_steps"]) in (page.text_content("#total-steps") or "")
        assert float(page.text_content("#rate") or 0) > 0
        assert (page.text_content("#goodput") or "").endswith("%")

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

        # Stopped: the page says so (the manager waits for it before it stops serving), and stops polling.
        api_post(url, "/api/stop", {}, token=token)
        page.wait_for_function("document.getElementById('job-state').textContent === 'stopped'", timeout=30_000)
        launcher.wait(timeout=30)
        assert "ended (stopped)" in (page.text_content("#conn") or "")
        assert not errors, errors


def _polyline(page: Any, selector: str) -> list[tuple[float, float]]:
    """The points of a rendered polyline, as drawn (pixels)."""
    text = page.get_attribute(selector, "points") or ""
    return [(float(x), float(y)) for x, y in (pair.split(",") for pair in text.split())]


def _geometry(page: Any, chart: str) -> dict[str, float]:
    data = page.eval_on_selector(chart, "c => Object.assign({}, c.dataset)")
    return {k: float(v) for k, v in data.items()}


# 2 ranks, 8 epochs of 32 steps = 256 steps (past the status' last 200), about 0.04 s each: ~12 s.
CHART_JOB_ARGS = ["--epochs", "8", "--step-seconds", "0.04"]


def test_the_page_draws_the_whole_run_per_rank_with_loss_incidents_zoom_and_the_end(
        tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"

    def status() -> dict[str, Any]:
        return dict(api_get(url, "/api/status", token=token))

    with browser_page() as page:  # (the browser first: the job is short)
        launcher = start_job(job_dir, CHART_JOB_ARGS, ranks=2, reap=reap)
        url = manager_url(job_dir)
        token = read_token_file(job_dir / TOKEN_FILE)
        wait_for(lambda: status()["state"] == "running", 60, "the job to run")
        api_post(url, "/api/inject", {"kind": "crash", "rank": 1, "at_step": 60}, token=token)
        errors: list[str] = []
        series_asked: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("request", lambda r: series_asked.append(r.url) if "/api/series" in r.url else None)
        outside: list[str] = []
        page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
        page.set_viewport_size({"width": 1200, "height": 1000})
        page.goto(f"{url}/?token={token}")
        page.wait_for_selector("#chart polyline.line", timeout=60_000)
        incident = wait_for(lambda: (i := status()["incidents"]) and i[0]["status"] == "recovered" and i[0], 60,
                            "the crash to be recovered")
        mark = f"#chart line.fault[data-incident='{incident['id']}']"
        page.wait_for_selector(mark, state="attached", timeout=15_000)  # (a vertical line: no area, "hidden")
        # Zoom: drag across the middle of the step-time chart; the page asks for those steps only.
        page.wait_for_function("Number(document.getElementById('chart').dataset.last) > 60", timeout=30_000)
        whole = _geometry(page, "#chart")
        box = page.locator("#chart").bounding_box()
        assert box is not None
        left, right = box["x"] + whole["left"], box["x"] + whole["right"]
        y = box["y"] + box["height"] / 2
        page.mouse.move(left + 0.3 * (right - left), y)
        page.mouse.down()
        page.mouse.move(left + 0.6 * (right - left), y, steps=4)
        page.mouse.up()
        page.wait_for_function(f"Number(document.getElementById('chart').dataset.first) > {whole['first']}",
                               timeout=10_000)
        zoomed = _geometry(page, "#chart")
        # The steps under 30% and 60% of the plot: the run grew between our look and the drag (by at most
        # what it has now), so the range drawn at the drag's time spans from whole["last"] to that.
        low, high = whole["last"] - whole["first"], status()["step"] - whole["first"]
        for at, got in ((0.3, zoomed["first"]), (0.6, zoomed["last"])):
            assert whole["first"] + at * low - 1 <= got <= whole["first"] + at * high + 1, (at, whole, zoomed, high)
        assert any(f"from={int(zoomed['first'])}&to={int(zoomed['last'])}" in u for u in series_asked), series_asked
        assert page.is_visible("#zoom-reset")
        page.click("#zoom-reset")
        page.wait_for_function("Number(document.getElementById('chart').dataset.first) <= 3", timeout=10_000)

        # The job ends on its own: the badge says how, and the charts hold the whole run.
        page.wait_for_function("document.getElementById('job-state').textContent === 'succeeded'", timeout=90_000)
        assert launcher.wait(timeout=30) == 0
        chart = _geometry(page, "#chart")
        assert chart["first"] <= 3 and chart["last"] == 256, chart  # every step, not the last 200
        line = _polyline(page, "#chart polyline.line")
        assert len(line) == int(page.get_attribute("#chart polyline.line", "data-points") or 0) >= 100
        xs = [x for x, _ in line]
        assert xs == sorted(xs) and xs[0] - chart["left"] < 5 and chart["right"] - xs[-1] < 5
        for rank in (0, 1):
            assert len(_polyline(page, f"#chart polyline.rank[data-rank='{rank}']")) >= 100
        # The incident's mark sits at its step on both charts.
        for chart_id in ("#chart", "#values-chart"):
            geometry = _geometry(page, chart_id)
            at = geometry["left"] + (incident["step"] - geometry["first"]) / (geometry["last"] - geometry["first"]) \
                * (geometry["right"] - geometry["left"])
            mark = f"{chart_id} line.fault[data-incident='{incident['id']}']"
            assert page.get_attribute(mark, "data-kind") == "crash"
            assert abs(float(page.get_attribute(mark, "x1") or 0) - at) < 1.0
        # The loss curve: every step, falling (a larger loss is drawn higher, at a smaller y).
        assert page.input_value("#value-name") == "loss"
        loss = _polyline(page, "#values-chart polyline.line")
        assert len(loss) >= 200 and loss[0][1] < loss[-1][1], loss[:3]
        assert "ended (succeeded)" in (page.text_content("#conn") or "")
        assert not errors, errors
        assert not outside, f"the page loaded from outside the manager: {outside}"
