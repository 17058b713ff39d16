"""Pages written at build time from the code itself: the command reference and the examples.

``cli.md``: from the real argparse parsers.

A hand-written copy of ``--help`` drifts the day an option is added; this page
cannot: mkdocs calls ``on_files`` on every build, which asks
``undying.cli.main.build_parser()`` for every command and subcommand and adds
their help, exactly as ``undying <command> --help`` prints it, as a generated
page. Nothing is written into ``docs/``. ``tests/unit/test_docs.py`` imports
``render`` from here and checks that every subcommand is on the page.

``examples.md``: every script in ``examples/`` as it is in the repository.
A page that links a script (``../examples/undying_fsdp.py``, which a
repository viewer opens as the file) is pointed at that script on this page
instead, and a link to any other repository file outside ``docs/`` keeps its
text without the link, since the site holds no files from outside ``docs/``.

The parsers import no torch (a tested rule of the CLI), so the build needs
only undying's light dependencies.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
EXAMPLES = ROOT / "examples"
WIDTH = 80  # the help's line width on the page (argparse reads COLUMNS, and leaves 2): fits the page's code block

_INTRO = """\
# Commands

Every `undying` command and option, as `undying <command> --help` prints it
(for `undying run`, as `undying run --help-all` does: its `--help` shows the
common options in full and names the others by group). This page is
generated from the command's own parsers each time the site is built, so it
is never out of date.

The commands in short:

| command | what it does |
| --- | --- |
{table}

Exit codes of every command: `0` done, `1` the job failed (for `undying
checkpoints verify`: a problem found), `2` bad input (one
line on stderr naming the input and what to do: see
[Troubleshooting](troubleshooting.md)), `130` stopped by Ctrl-C. `undying run`
adds `75`, `74` and `143` for a preempted job (below). A refused option is one
line, never a traceback.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``undying`` parser of this checkout (``src/`` first on the path, as the tests import it)."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    from undying.cli.main import build_parser as build

    return build()


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ("undying",)
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every parser under ``parser`` depth first: its command words, the parser, its one-line help."""
    yield words, parser, ""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        seen: set[int] = set()
        for name, sub in action.choices.items():
            if id(sub) in seen:  # an alias names a parser already shown
                continue
            seen.add(id(sub))
            for inner_words, inner, inner_help in commands(sub, (*words, name)):
                yield inner_words, inner, inner_help or helps.get(name, "")


def _help(parser: argparse.ArgumentParser) -> str:
    """``parser``'s --help at a fixed width and without colour, whatever terminal builds the site."""
    saved = {key: os.environ.get(key) for key in ("COLUMNS", "NO_COLOR")}
    os.environ["COLUMNS"] = str(WIDTH)
    os.environ["NO_COLOR"] = "1"
    try:
        return parser.format_help().rstrip()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page: a table of the commands, then each command's help under its own heading."""
    parser = parser or build_parser()
    found = list(commands(parser))
    table = "\n".join(f"| [`{' '.join(words)}`](#{'-'.join(words)}) | {text.replace('|', '&#124;')} |"
                      for words, _, text in found[1:])
    parts = [_INTRO.format(table=table)]
    for words, sub, _ in found:
        level = "#" * min(len(words) + 1, 4)
        anchor = "-".join(words)
        parts.append(f"{level} `{' '.join(words)}` {{#{anchor}}}\n\n```text\n{_help(sub)}\n```\n")
    return "\n".join(parts)


def render_examples() -> str:
    """The examples page: each script of ``examples/`` under a heading whose anchor is its file name."""
    parts = ["# Examples\n\nThe scripts in the repository's `examples/` folder, as they are there. "
             "The [tutorial](tutorial.md) walks through the changes from the first to the second.\n"]
    for script in sorted(EXAMPLES.glob("*.py")):
        doc = script.read_text()
        parts.append(f"## `examples/{script.name}` {{#{script.stem}}}\n\n```python\n{doc.rstrip()}\n```\n")
    return "\n".join(parts)


_REPO_LINK = re.compile(r"\[([^\]]*)\]\(((?:\.\./)+)([^)#\s]+)(#[^)\s]*)?\)")


def repository_links(markdown: str, depth: int) -> str:
    """``markdown`` with links to repository files outside ``docs/`` made right for the site.

    A page links ``../examples/undying_fsdp.py`` or ``../bench/cli.py``: right
    in the repository, nowhere on the site, which holds only ``docs/``. A
    script of ``examples/`` becomes a link to its place on the examples page;
    any other file keeps the link's text (its path, usually) without the link.
    ``depth``: how many folders below ``docs/`` the page is. Links that stay
    inside ``docs/`` are left alone.
    """

    def fix(m: re.Match[str]) -> str:
        text, ups, target = m.group(1), m.group(2).count("../"), m.group(3)
        if ups <= depth:
            return m.group(0)  # a page of the site
        example = re.fullmatch(r"examples/([A-Za-z0-9_]+)\.py", target)
        if example and ups == depth + 1:
            return f"[{text}]({'../' * depth}examples.md#{example.group(1)})"
        return text

    return _REPO_LINK.sub(fix, markdown)


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated ``cli.md`` and ``examples.md`` to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "cli.md", content=render()))
    files.append(File.generated(config, "examples.md", content=render_examples()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs hook: links to repository files outside ``docs/`` (see ``repository_links``)."""
    return repository_links(markdown, page.file.src_uri.count("/"))
