"""The docs site opened from disk, with no network: its search finds a page, its screenshots load, and nothing loads from the web.

Browsers refuse a Web Worker to a page opened as ``file://``, and the site's
search runs in one: the offline plugin and ``docs/assets/iframe-worker.js``
(mkdocs.yml) are what make it work there. This test builds a two-page site with
the project's own mkdocs.yml (its theme, plugins, extras and Markdown settings;
only the pages, the API page's plugin and the build hook differ, to build in
seconds), opens it from disk in a real headless Chromium with every request
that leaves the disk refused, types a word into the search box and waits for
the page that holds it. The start page holds the screenshots that index.md and
tutorial.md show, written as they are there; each must load.

The word is typed key by key, as a person types it. (A test that set the box's
value at once, with no key pressed, failed now and then: the theme reads the
box on a key, on focus and when the search worker says it is ready; when the
worker was ready before the value was set, the query stayed empty. That race
is the test's, not the site's.)

Needs mkdocs (the ``docs`` extra), playwright and Debian's ``chromium``; skips
and says why without them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install '.[docs]')")
yaml = pytest.importorskip("yaml", reason="PyYAML (mkdocs' own dependency) is not installed")
from tests.integration.test_web_page import CHROMIUM, browser_page, sync_api  # noqa: E402

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium); the site is not browser-tested"
)

ROOT = Path(__file__).resolve().parents[2]
WORD = "quartermaster"  # on one page only, in no theme text
IMAGE = re.compile(r"!\[[^\]]*\]\(assets/[^)\s]+\)(\{[^}]*\})?")


def screenshot_lines() -> list[str]:
    """Every image of index.md and tutorial.md, as written there (all under docs/assets/)."""
    return [m.group(0) for page in ("index.md", "tutorial.md")
            for m in IMAGE.finditer((ROOT / "docs" / page).read_text())]


def _build(tmp: Path, images: list[str]) -> Path:
    """A two-page site built with the project's mkdocs.yml; the folder of its built pages."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config: dict[str, Any] = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp / "docs"
    shutil.copytree(ROOT / "docs" / "assets", docs / "assets")
    (docs / "index.md").write_text("# Home\n\nThe start page.\n\n" + "\n\n".join(images) + "\n")
    (docs / "other.md").write_text(f"# Other\n\nA page about the {WORD} of the job.\n")
    plugins = [p for p in config["plugins"] if not (isinstance(p, dict) and "mkdocstrings" in p)]
    assert "offline" in plugins, "mkdocs.yml no longer has the offline plugin: the site has no search from disk"
    config.update(docs_dir=str(docs), site_dir=str(tmp / "site"), plugins=plugins,
                  nav=[{"Home": "index.md"}, {"Other": "other.md"}])
    config.pop("hooks", None)
    (tmp / "mkdocs.yml").write_text(yaml.safe_dump(config))
    build(load_config(str(tmp / "mkdocs.yml")))
    return tmp / "site"


def test_the_site_opened_from_disk_searches_and_shows_its_screenshots_with_no_network(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")  # the theme's banner, printed once it is imported
    images = screenshot_lines()
    assert {Path(re.sub(r"\).*", "", line.split("](", 1)[1])).suffix for line in images} >= {".png", ".svg"}, (
        f"index.md and tutorial.md show no screenshot of the page (.png) and of the terminal (.svg): {images}")
    site = _build(tmp_path, images)
    assert (site / "search" / "search_index.js").is_file()
    html = (site / "index.html").read_text()
    assert "unpkg.com" not in html and "fonts.googleapis.com" not in html, "the page loads from the web"

    with browser_page() as page:
        errors: list[str] = []
        outside: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

        def only_the_disk(route: Any) -> None:
            if route.request.url.startswith("file://"):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        page.route("**/*", only_the_disk)
        page.set_viewport_size({"width": 1280, "height": 800})  # the header's search box is shown
        page.goto((site / "index.html").as_uri())
        page.wait_for_load_state("load")
        shown = page.evaluate("[...document.querySelectorAll('article img')]"
                              ".map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])")
        assert len(shown) == len(images) and all(ok for _, ok in shown), f"images that did not load: {shown}"
        try:
            page.locator("input.md-search__input").press_sequentially(WORD, timeout=15_000)
            hit = page.wait_for_selector(".md-search-result__item a[href*='other.html']", timeout=15_000)
        except sync_api.TimeoutError:
            pytest.fail(f"opened from disk, the site's search never answered (its worker did not start?); "
                        f"page errors: {errors}, requests refused: {outside}")
        assert hit is not None and WORD in (hit.inner_text() or "").lower()
        page.click(".md-search-result__item a[href*='other.html']")
        page.wait_for_url("**/other.html*", timeout=10_000)
        assert WORD in page.inner_text("article")
    assert not outside, f"the site asked the web for {outside}"
    assert not errors, errors
