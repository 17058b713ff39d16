"""bench/screenshots.py's drawing of a terminal, and the screenshots the docs show.

The terminal's screenshot is what a terminal would show at the end: a line
rewritten in place (a progress line's ``\\r``) keeps its last text, cursor
movements are dropped, colours stay. The SVG uses the system's fonts only:
rich's own template loads Fira Code from the web, which a site opened offline
cannot reach and the docs may not name.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "assets" / "screenshots"
_spec = importlib.util.spec_from_file_location("screenshots", ROOT / "bench" / "screenshots.py")
assert _spec is not None and _spec.loader is not None
screenshots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(screenshots)

WEB_HOST = re.compile(r"[a-z]+://(?!127\.0\.0\.1[:/])[^\s\"'<>]+")


def test_a_line_rewritten_in_place_shows_its_last_text_and_colours_stay() -> None:
    raw = ("first line\r\n"
           "step 1 of 80\rstep 2 of 80\x1b[K\rstep 80 of 80\r\n"
           "\x1b[33mwarned\x1b[0m\x1b[2K\r\n"
           "\x1b[1A\x1b[?25lhidden cursor\r\n\r\n")
    assert screenshots.screen_lines(raw) == ["first line", "step 80 of 80", "\x1b[33mwarned\x1b[0m",
                                             "hidden cursor"]


def test_the_terminals_svg_has_its_lines_and_no_font_from_the_web() -> None:
    svg = screenshots.terminal_svg(["undying", "run", "x.py"],
                                   "status page: http://127.0.0.1:4000/\r\n\x1b[31mcrash\x1b[0m\r\n")
    text = re.sub(r"<[^>]+>", "", svg).replace("&#160;", " ")
    assert "$ undying run x.py" in text and "crash" in text and "http://127.0.0.1:4000/" in text
    assert "@font-face" not in svg and "cloudflare" not in svg
    assert not WEB_HOST.findall(svg.replace('xmlns="http://www.w3.org/2000/svg"', ""))


def test_the_checked_in_screenshots_are_small_and_load_nothing_from_the_web() -> None:
    svg, png = SHOTS / "terminal-crash.svg", SHOTS / "status-page.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert svg.stat().st_size < 100_000 and png.stat().st_size < 300_000, "a screenshot grew: shrink it"
    text = svg.read_text()
    assert "@font-face" not in text
    assert not WEB_HOST.findall(text.replace('xmlns="http://www.w3.org/2000/svg"', "")), "the SVG names the web"
