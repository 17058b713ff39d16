"""Every ``--help`` at 80 columns, and ``undying run --help`` on one screen: the real commands.

Each is run as a person runs it (a process, ``COLUMNS=80``, stdout a pipe) and its output
read: no line wider than 80 columns, and ``run --help`` at most 80 lines that still name
every option (``--help-all`` and the docs' Commands page give each one's text).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from undying.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 80


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The command words of every parser under ``parser`` (``()`` is ``undying`` itself)."""
    found = [words]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    found += _commands(sub, (*words, name))
    return found


COMMANDS = _commands(build_parser())


def undying(*argv: str, columns: int = WIDTH) -> str:
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-m", "undying", *argv], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _wide(text: str) -> list[str]:
    return [f"{len(line)}: {line}" for line in text.splitlines() if len(line) > WIDTH]


def test_every_command_is_checked() -> None:
    assert len(COMMANDS) >= 14 and ("run",) in COMMANDS and ("trace",) in COMMANDS


@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: " ".join(("undying", *w)))
def test_each_help_fits_80_columns(words: tuple[str, ...]) -> None:
    text = undying(*words, "--help")
    assert text.startswith("usage: undying")
    assert _wide(text) == []


def test_run_help_is_one_screen_naming_every_option() -> None:
    text = undying("run", "--help")
    lines = text.splitlines()
    assert len(lines) <= 80, f"{len(lines)} lines"
    assert "--help-all" in text and "common options:" in text
    # the common ones with their text, every other one named (by its long spelling) in its group
    assert "worker processes on this node" in text and "--checkpoint-dir PATH_OR_URL" in text
    run = next(a.choices["run"] for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    named = set(text.replace(",", " ").split())
    missing = [a.option_strings for a in run._actions if a.option_strings
               and not any(o in named for o in a.option_strings)]
    assert missing == []
    assert "  timeouts: --rendezvous-timeout," in text and "  torchrun's flags: --standalone," in text
    # a wide terminal gets the same one screen, no wider
    wide = undying("run", "--help", columns=200)
    assert len(wide.splitlines()) <= 80 and _wide(wide) == []


def test_run_help_all_gives_every_option_its_text() -> None:
    text = undying("run", "--help-all")
    assert len(text.splitlines()) > 200 and _wide(text) == []
    assert "takes that node's rank" in " ".join(text.split())  # --standby's text, which the short help only names
    assert "Exit code: 0 succeeded" in text
