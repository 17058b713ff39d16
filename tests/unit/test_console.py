"""What reaches the terminal (undying.config.console): the launcher's log and a rank's, each in a
process of its own, as `undying` and a rank set them up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from undying.errors import UsageError
from undying.inputs import check_environment
from undying.protocol.env import VERBOSE_ENV

# Every logger a job's line comes from, at INFO and WARNING.
LINES = """
import logging
for name in ("undying.manager", "undying.worker", "undying.shown", "script"):
    logging.getLogger(name).info("info of %s", name)
    logging.getLogger(name).warning("warning of %s", name)
"""


def _stderr(code: str, verbose: str | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != VERBOSE_ENV}
    if verbose is not None:
        env[VERBOSE_ENV] = verbose
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + LINES], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stderr.splitlines()


def _said(lines: list[str]) -> list[str]:
    """Each line's message, without the time and level a handler put before it."""
    return [line.rpartition("] ")[2] for line in lines]


@pytest.mark.parametrize("verbose", [False, True])
def test_the_launcher_shows_warnings_and_the_lines_people_read_or_every_info_line_with_v(verbose: bool) -> None:
    lines = _stderr(f"from undying.config import show_launcher_log; show_launcher_log({verbose})")
    infos = [f"info of {name}" for name in ("undying.manager", "undying.worker", "undying.shown", "script")]
    warnings = [f"warning of {name}" for name in ("undying.manager", "undying.worker", "undying.shown", "script")]
    expected = [line for pair in zip(infos, warnings, strict=True) for line in pair] if verbose \
        else [line for line in [x for pair in zip(infos, warnings, strict=True) for x in pair]
              if line.startswith("warning") or line == "info of undying.shown"]
    assert _said(lines) == expected, lines
    assert all(line.startswith("[undying ") for line in lines), lines
    assert "INFO] info of undying.shown" in "\n".join(lines)


def test_a_rank_shows_undyings_warnings_only_even_when_the_script_logs_at_info() -> None:
    """A script's basicConfig(INFO) does not raise undying's lines in a rank: a handled fault's
    detail stays off the terminal."""
    plain = _stderr("from undying.config import show_rank_log; show_rank_log()")
    assert _said(plain) == ["warning of undying.manager", "warning of undying.worker",
                            "warning of undying.shown", "warning of script"], plain
    scripted = _stderr("""
        from undying.config import show_rank_log; show_rank_log()
        import logging; logging.basicConfig(level=logging.INFO, format="%(name)s] %(message)s")
    """)
    assert _said(scripted) == [
        "warning of undying.manager", "warning of undying.worker", "warning of undying.shown",
        "info of script", "warning of script"], scripted


def test_a_rank_of_a_verbose_launcher_shows_undyings_info_lines_once_with_or_without_the_scripts_logging() -> None:
    alone = _stderr("from undying.config import show_rank_log; show_rank_log()", verbose="1")
    assert _said(alone) == ["info of undying.manager", "warning of undying.manager",
                            "info of undying.worker", "warning of undying.worker",
                            "info of undying.shown", "warning of undying.shown", "warning of script"], alone
    assert alone[0].startswith("[undying ") and " INFO] " in alone[0], alone
    scripted = _stderr("""
        from undying.config import show_rank_log; show_rank_log()
        import logging; logging.basicConfig(level=logging.WARNING, format="%(name)s] %(message)s")
    """, verbose="1")
    # Once each, through undying's own handler (the script's own INFO line stays below its level).
    assert _said(scripted) == ["info of undying.manager", "warning of undying.manager",
                               "info of undying.worker", "warning of undying.worker",
                               "info of undying.shown", "warning of undying.shown", "warning of script"], scripted


@pytest.mark.parametrize("setup", ["show_rank_log()", "show_launcher_log(True)"])
def test_a_root_handler_as_hydra_sets_one_up_sees_nothing_of_undyings_while_undying_shows_every_line(
        setup: str) -> None:
    """hydra and accelerate configure the root logger: undying's lines, in a rank or the launcher,
    never reach it, and still reach undying's own output (the job's log)."""
    lines = _stderr(f"""
        from undying.config import show_launcher_log, show_rank_log; {setup}
        import logging, sys
        root = logging.StreamHandler(sys.stderr)
        root.setFormatter(logging.Formatter("ROOT %(name)s] %(message)s"))
        logging.getLogger().addHandler(root)
    """, verbose="1")
    rooted = [line for line in lines if line.startswith("ROOT ")]
    assert rooted and all(line.startswith("ROOT script]") for line in rooted), lines
    # (the launcher's root handler, for other libraries' lines, has undying's form: not counted)
    ours = [line for line in lines if line.startswith("[undying ") and "of script" not in line]
    assert _said(ours) == ["info of undying.manager", "warning of undying.manager",
                           "info of undying.worker", "warning of undying.worker",
                           "info of undying.shown", "warning of undying.shown"], lines


def test_a_bad_verbose_switch_is_one_line_that_names_it() -> None:
    with pytest.raises(UsageError, match=f"{VERBOSE_ENV}='yes': expected one of 0, 1"):
        check_environment({VERBOSE_ENV: "yes"})
    check_environment({VERBOSE_ENV: "1"})
