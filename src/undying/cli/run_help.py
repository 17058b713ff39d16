"""``undying run``'s two helps: ``--help`` (the common options, one screen) and ``--help-all``.

``undying run`` has some 80 options; a ``--help`` that prints them all is 350
lines nobody reads. ``--help`` shows the options most jobs use, in full, and
then every other option's name under its group's title, so nothing is hidden:
``--help-all`` (and the generated Commands page of the docs, which renders
``format_help``) gives each one's text. Both fit 80 columns at ``COLUMNS=80``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["COMMON", "add_help_options", "short_help"]

# The options most jobs use, in the order the short help shows them (one per option: its first
# spelling). Every other option is named, by group, under them.
COMMON = ("--nproc-per-node", "--job-id", "--job-dir", "--max-restarts", "--checkpoint-dir",
          "--save-every", "--save-interval", "--port", "--nnodes", "--manager",
          "--trace")  # fmt: skip

# The short help's width: the terminal's (argparse's own rule), at most 80.
_MAX_WIDTH = 80


def _key(action: argparse.Action) -> str:
    """The option's long name (``--nproc-per-node`` for ``-n``), or a positional's dest."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    return longs[0] if longs else (action.option_strings or [action.dest])[0]


def _title(group: argparse._ArgumentGroup) -> str:
    """A group's title without its note in brackets (``timeouts`` for ``timeouts (seconds;
    ...)``)."""
    title = (group.title or "").split(" (", 1)[0]
    return "general" if title in ("", "options", "optional arguments") else title


def short_help(parser: argparse.ArgumentParser, summary: str) -> str:
    """The one-screen help of ``parser``: usage, ``summary``, the common options, the others by
    name."""
    # (argparse's own width, the terminal's less 2, at most 78: a wide terminal gets one screen too)
    width = max(40, min(shutil.get_terminal_size().columns, _MAX_WIDTH) - 2)
    formatter = argparse.HelpFormatter(parser.prog, width=width)
    formatter.add_usage("%(prog)s [options] script [script args ...]", [], [])
    formatter.add_text(summary)
    by_key = {_key(a): a for a in parser._actions}
    common = [by_key[k] for k in ("--help", "--help-all", *COMMON) if k in by_key]
    formatter.start_section("common options")
    formatter.add_arguments(common)
    formatter.end_section()
    text = formatter.format_help()
    shown = {id(a) for a in common}
    more = ["", "every other option, by group (`undying run --help-all` says what each does):"]
    for group in parser._action_groups:
        names = [_key(a) for a in group._group_actions
                 if id(a) not in shown and a.option_strings and a.help != argparse.SUPPRESS]
        if names:
            more.extend(textwrap.wrap(f"{_title(group)}: {', '.join(names)}", width,
                                      initial_indent="  ", subsequent_indent="    ",
                                      break_on_hyphens=False))
    return text.rstrip("\n") + "\n" + "\n".join(more) + "\n"


class _ShortHelp(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, summary: str = "",
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.summary = summary

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        sys.stdout.write(short_help(parser, self.summary))
        parser.exit()


class _FullHelp(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        parser.print_help()
        parser.exit()


def add_help_options(p: argparse.ArgumentParser, summary: str) -> None:
    """``-h/--help`` (the short help, with ``summary`` as its text) and ``--help-all`` on ``p``,
    made with ``add_help=False``."""
    p.add_argument("-h", "--help", action=_ShortHelp, summary=summary,
                   help="show the common options and name the others")
    p.add_argument("--help-all", action=_FullHelp,
                   help="show every option and what it does, by group")
