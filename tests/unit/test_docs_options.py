"""Every ``undying`` option the documentation names exists on that command's real parser.

A page that says ``undying run --max-restarts`` where the option is now
``--max-step-recoveries`` reads fine and misleads for months. These tests read
README.md and every page of docs/, take each ``undying`` command written in a
code block or in inline code, and look up each ``--option`` after it in the
parser ``undying`` itself builds (``undying.cli.main.build_parser``, no
subprocess). A failure names the page, the line and the option.

What counts as the command's options: the words after ``undying COMMAND``
(and a subcommand) up to the end of the shell command (``&&``, ``|``, ``;``,
``#``, ``--``) or, for ``undying run`` and ``undying k8s``, up to the script,
whose own options follow it (``undying run -n 4 train.py --epochs 3``). An
option's value is skipped, as argparse would take it. Placeholders in
brackets (``[--json]``) and alternatives (``--job-dir D | --manager URL``)
are read as options too.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from undying.cli.demo import FAULTS
from undying.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^\s*(```|~~~)")
_SPAN = re.compile(r"(`+)(.+?)\1", flags=re.S)
_END = "<end>"  # a nested inline span closed: `` ... `undying run` ... `` names no option after it
_STOP = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>&1", "--", _END}
_ALTERNATIVE = "<or>"  # `--job-dir D \| --manager URL` (a table's escaped bar): both are options
_PLACEHOLDER = {"...", "…"}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def snippets(text: str) -> Iterator[tuple[int, str]]:
    """Each piece of code of a Markdown page with its line number: a code block's lines (a line
    ending in a backslash joined with the next, as the shell does) and each inline code span
    outside the blocks (which may run across a line break)."""
    in_block = False
    paragraph: list[tuple[int, str]] = []
    continued: tuple[int, str] | None = None

    def spans(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
        if not lines:
            return
        first, joined = lines[0][0], "\n".join(line for _, line in lines)
        for match in _SPAN.finditer(joined):
            yield first + joined.count("\n", 0, match.start()), " ".join(match.group(2).split())

    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            yield from spans(paragraph)
            paragraph = []
            if continued is not None:
                yield continued
                continued = None
            in_block = not in_block
        elif in_block:
            for span in re.finditer(r"`([^`]+)`", line):  # `undying ...` in a comment
                yield number, span.group(1)
            start, before = continued if continued is not None else (number, "")
            code = f"{before} {line.strip()}".strip()
            if code.endswith("\\"):
                continued = (start, code[:-1])
            else:
                continued = None
                yield start, code
        elif line.strip():
            paragraph.append((number, line))
        else:
            yield from spans(paragraph)
            paragraph = []
    yield from spans(paragraph)


def _tokens(code: str) -> list[str]:
    """The words of a piece of code, as the shell splits them where it can (quotes kept together)."""
    code = code.split(" #", 1)[0] if not code.startswith("#") else ""
    code = re.sub(r"(?<=\s)\\\|(?=\s)", _ALTERNATIVE, code)
    try:
        words = shlex.split(code, posix=True)
    except ValueError:  # an unbalanced quote in an excerpt: split on spaces
        words = code.split()
    tokens = []
    for word in words:
        if word in _STOP:
            tokens.append(word)
            continue
        inner = word.lstrip("[({").lstrip("`")  # a nested span opens: (`undying ...
        closes = "`" in inner  # ... and closes: a word`
        inner = inner.split("`", 1)[0].strip("[](){},")
        tokens += [inner] if inner else []
        tokens += [_END] if closes else []
    return tokens


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _takes_a_script(parser: argparse.ArgumentParser) -> bool:
    """``undying run SCRIPT ARGS`` and ``undying k8s ... -- SCRIPT ARGS``: words after the first
    positional belong to the script."""
    return any(not action.option_strings and action.nargs == argparse.REMAINDER
               for action in parser._actions)


def named_options(code: str, top: argparse.ArgumentParser
                  ) -> Iterator[tuple[tuple[str, ...], str, bool]]:
    """Each option written after an ``undying`` command in ``code``: (the command's words, the
    option, whether that command's parser has it)."""
    tokens = _tokens(code)
    for start, token in enumerate(tokens):
        if token != "undying":
            continue
        parser, words, i = top, ["undying"], start + 1
        while i < len(tokens) and tokens[i] in _subcommands(parser):
            parser = _subcommands(parser)[tokens[i]]
            words.append(tokens[i])
            i += 1
        if len(words) == 1 and i < len(tokens) and not tokens[i].startswith("-"):
            continue  # `undying <command> --help`, `undying: job j2 started`: no command named
        known = _options(parser)
        while i < len(tokens):
            word = tokens[i]
            i += 1
            if word == "|" and i < len(tokens) and tokens[i].startswith("-"):
                continue  # `--job-dir D | --manager URL`: one or the other
            if word in _STOP or word.startswith("#") or word == "undying":
                break
            if word == _ALTERNATIVE or word in _PLACEHOLDER or " " in word:
                continue  # a quoted argument (`--run-args '--heartbeat-timeout 5'`'s value) too
            if word.startswith("--") or re.fullmatch(r"-[A-Za-z]", word):
                option = word.split("=", 1)[0]
                action = known.get(option)
                yield tuple(words), option, action is not None
                takes_value = action is not None and action.nargs != 0
                if takes_value and "=" not in word and i < len(tokens) and tokens[i] not in _STOP \
                        and (not tokens[i].startswith("-") or " " in tokens[i]):
                    i += 1  # its value
                continue
            if _takes_a_script(parser):
                break  # the script and its own arguments


def unknown_options(text: str, page: str, top: argparse.ArgumentParser) -> list[str]:
    """'page:line: `undying run --x`: ...' for each option ``text`` names that its command lacks."""
    problems = []
    for line, code in snippets(text):
        for words, option, exists in named_options(code, top):
            if not exists:
                command = " ".join(words)
                problems.append(f"{page}:{line}: {option} is not an option of `{command}` "
                                f"(`{command} --help` lists them)")
    return problems


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_every_option_the_docs_name_exists(parser: argparse.ArgumentParser) -> None:
    problems: list[str] = []
    checked = 0
    for page in _pages():
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        problems += unknown_options(text, name, parser)
        checked += sum(1 for _, code in snippets(text) for _ in named_options(code, parser))
    assert checked > 250, f"only {checked} options found in the docs: is the scan still reading them?"
    assert not problems, "options the docs name that undying does not have:\n" + "\n".join(problems)


@pytest.mark.parametrize("markdown, expected", [
    # inline code, the option's value skipped, a made-up option named with its line
    ("A line.\nRun `undying run -n 4 --frobnicate 3 train.py`.\n",
     ["p.md:2: --frobnicate is not an option of `undying run` (`undying run --help` lists them)"]),
    # a subcommand's parser, not its parent's
    ("```\nundying trace on --comm --perfetto x.json --nope\n```\n",
     ["p.md:2: --nope is not an option of `undying trace` (`undying trace --help` lists them)"]),
    # a block's line continued with a backslash is one command, named by its first line
    ("```bash\nundying k8s --job-id J \\\n    --gpus 8 --no-such-flag -- train.py --lr 3\n```\n",
     ["p.md:2: --no-such-flag is not an option of `undying k8s` (`undying k8s --help` lists them)"]),
    # an inline span that runs across a line break
    ("text `undying status\n--json --wrong` more\n",
     ["p.md:1: --wrong is not an option of `undying status` (`undying status --help` lists them)"]),
    # options of the script, of another program, after a comment or a pipe: not undying's
    ("```\nundying run -n 4 train.py --epochs 3   # --not-checked\n"
     "torchrun --nproc-per-node 4 x.py\nundying status --json | jq --raw-output .state\n```\n", []),
    # placeholders and alternatives as the README's table writes them
    ("| `undying status [--job-dir D \\| --manager URL] [--json] [--steps]` | ... |\n", []),
    ("`undying run --max-restarts 3` and `undying run --max-step-recoveries 3`", []),
    # a message quoted with a command inside it; a command in a code block's comment
    ("- ``no X; start `undying manager --job-id J --bogus` first, then pass --run-args``\n",
     ["p.md:1: --bogus is not an option of `undying manager` (`undying manager --help` lists them)"]),
    ("(`undying run --standby --nope ...` on a host)", ["p.md:1: --nope is not an option of `undying run` (`undying run --help` lists them)"]),
    ("```\n# first `undying manager --job-ID J`\n```\n",
     ["p.md:2: --job-ID is not an option of `undying manager` (`undying manager --help` lists them)"]),
])
def test_the_scan_finds_what_a_reader_would(parser: argparse.ArgumentParser, markdown: str,
                                            expected: list[str]) -> None:
    assert unknown_options(markdown, "p.md", parser) == expected


def test_the_demo_faults_are_all_listed() -> None:
    """docs/index.md and the README's command table name every fault `undying demo` takes."""
    index = (DOCS / "index.md").read_text()
    missing = [name for name in FAULTS if f"| `{name}`" not in index]
    assert not missing, f"demo faults missing from docs/index.md's table: {missing}"
    [row] = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("| `undying demo [--fault ")]
    listed = row.split("--fault ", 1)[1].split("]", 1)[0].split("\\|")
    assert sorted(listed) == sorted(FAULTS), \
        f"the README's demo row lists {listed}, the demo has {list(FAULTS)}"


def test_ci_runs_the_readmes_test_command() -> None:
    """.ci/run is the README's second command (install quietly, then the same checks)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    demo, tests = blocks[0].strip(), blocks[1].strip()
    assert demo.endswith("undying demo") and "pip install torch==2.13.0 -e ." in demo
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == tests.replace("pip install ", "pip install -q ", 1), \
        "the README's test command and .ci/run's last line differ"
