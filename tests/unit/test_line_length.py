"""The 100-column check is on for every file of src/: ruff's E501, with no file of src/ exempt.

Tests, benchmarks and examples may run longer (their tables of cases and expected output read
better on one line); the library's code may not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 100


def _ruff() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]


def test_the_line_length_is_ruffs_and_the_check_is_on() -> None:
    ruff = _ruff()
    assert ruff["line-length"] == WIDTH
    assert "E501" not in ruff["lint"].get("ignore", [])
    assert "E" in ruff["lint"]["select"] or "E501" in ruff["lint"]["select"]


def test_no_file_of_src_is_exempt() -> None:
    ignores = _ruff()["lint"].get("per-file-ignores", {})
    exempt = sorted(path for path, codes in ignores.items()
                    if "E501" in codes and path.startswith(("src", "**", "*")))
    assert not exempt, f"exempt from the {WIDTH} columns: {exempt} (wrap them instead)"


def test_every_line_of_src_is_within_the_width() -> None:
    """What ruff checks, checked here too: a ruff that is not run (or a noqa) does not hide a long line."""
    long = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "src").rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if len(line) > WIDTH]
    assert not long, f"{len(long)} lines over {WIDTH} columns: {long[:10]}"
