"""The documentation against the code: every command, event and error message documented, no link out.

The site itself is built by ``mkdocs build --strict`` in ``.ci/run`` (broken
links, missing pages and unreadable docstrings fail it). These tests need no
mkdocs: they read the code (its parsers, and its source for the event names
and error messages it can produce) and the Markdown, so they run everywhere
the unit tests run, in well under a second.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "undying"
DOCS = ROOT / "docs"


def _hook() -> ModuleType:
    """docs/hooks/generated.py, the mkdocs hook that writes the command reference and the examples page."""
    spec = importlib.util.spec_from_file_location("docs_hooks_generated", DOCS / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _sources() -> tuple[tuple[Path, ast.Module, tuple[ast.AST, ...]], ...]:
    """Each module of the package: its path, its tree, and every node of it (parsed once per session)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        found.append((path, tree, tuple(ast.walk(tree))))
    return tuple(found)


def _called(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _flat(text: str) -> str:
    return " ".join(text.split())


# --- the command reference ------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_cli_reference_has_every_command_and_option() -> None:
    hook = _hook()
    parser = hook.build_parser()
    page = hook.render(parser)
    names = [name for name, _ in _subparsers(parser)]
    assert {"run", "manager", "status", "inject", "checkpoints", "k8s"} <= set(names)
    sections = re.split(r"^#+ ", page, flags=re.M)
    for name, sub in _subparsers(parser):
        heading = f"`undying {name}` {{#undying-{name}}}"
        assert f"### {heading}" in page, f"undying {name} has no section on the commands page"
        [section] = [s for s in sections if s.startswith(heading)]
        for action in sub._actions:
            for option in action.option_strings:
                assert option in section, f"undying {name} {option} is missing from its section"
            for choice in action.choices or ():  # positional choices: checkpoints list|verify|show, ...
                assert str(choice) in section, f"undying {name}'s choice {choice} is missing"
        # The table at the top links the section.
        assert f"](#undying-{name})" in page


def test_cli_reference_follows_nested_subcommands() -> None:
    """A subcommand with subcommands of its own gets a section for each, under its parent's."""
    hook = _hook()
    top = argparse.ArgumentParser(prog="undying")
    sub = top.add_subparsers().add_parser("outer", help="the outer one")
    inner = sub.add_subparsers().add_parser("inner", help="the inner one")
    inner.add_argument("--deep-option", help="only here")
    page = hook.render(top)
    assert "#### `undying outer inner` {#undying-outer-inner}" in page
    assert "--deep-option" in page.split("undying outer inner` {")[1]
    assert "| [`undying outer inner`](#undying-outer-inner) | the inner one |" in page


def test_help_is_rendered_at_a_fixed_width() -> None:
    """The page does not depend on the terminal that built it."""
    hook = _hook()
    page = hook.render()
    blocks = re.findall(r"```text\n(.*?)```", page, flags=re.S)
    assert blocks
    widest = max(len(line) for block in blocks for line in block.splitlines())
    assert widest <= hook.WIDTH + 40  # argparse does not break a long usage line or a choice list


# --- the examples page ----------------------------------------------------------------------------------


def test_examples_page_holds_every_script_and_links_lead_there() -> None:
    hook = _hook()
    page = hook.render_examples()
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f"{{#{script.stem}}}" in page
        assert script.read_text().strip().splitlines()[-1] in page
    fix = hook.repository_links
    assert fix("see [x](../examples/undying_fsdp.py).", 0) == "see [x](examples.md#undying_fsdp)."
    assert fix("[x](../../examples/a_b.py)", 1) == "[x](../examples.md#a_b)"
    assert fix("[`bench/cli.py`](../bench/cli.py)", 0) == "`bench/cli.py`"  # nowhere on the site
    assert fix("[`README`](../../README.md#commands)", 1) == "`README`"
    for inside in ("[x](examples.md)", "[x](../tracing.md)", "[a](#b)"):
        assert fix(inside, 1 if inside.startswith("[x](../") else 0) == inside


def test_tutorial_diffs_are_the_examples() -> None:
    """Each removed line of the tutorial's diffs is in plain_ddp.py, each added line in undying_ddp.py."""
    plain = {line.strip() for line in (ROOT / "examples" / "plain_ddp.py").read_text().splitlines()}
    adapted = {line.strip() for line in (ROOT / "examples" / "undying_ddp.py").read_text().splitlines()}
    diffs = re.findall(r"```diff\n(.*?)```", (DOCS / "tutorial.md").read_text(), flags=re.S)
    assert len(diffs) >= 4
    for diff in diffs:
        for line in diff.splitlines():
            if line.startswith("-"):
                assert line[1:].strip() in plain, f"the tutorial removes {line[1:]!r}, not in plain_ddp.py"
            elif line.startswith("+"):
                assert line[1:].strip() in adapted, f"the tutorial adds {line[1:]!r}, not in undying_ddp.py"


# --- the event names ------------------------------------------------------------------------------------

# Events whose name comes from a message rather than the code that logs it: the manager relays a
# worker's Progress phase and an agent's SpareEvent under their own names. Their names are found
# where those messages are made (below); a new relay must be added here and its names there.
# "what": the manager's on_standby, which logs what manager/standbys/roster.py records (its _record calls).
_RELAYED = {"message.phase", "message.what", "what"}


def _event_names() -> dict[str, str]:
    """Every event name the code can write to the event log -> where it is written."""
    found: dict[str, str] = {}
    relays: set[str] = set()
    for path, _, nodes in _sources():
        where = str(path.relative_to(SRC))
        for node in nodes:
            if not isinstance(node, ast.Call):
                continue
            name, args = _called(node), node.args
            first = args[0] if args else None
            literal = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            if name == "event" and isinstance(node.func, ast.Attribute) and first is not None:
                if literal is None:
                    relays.add(ast.unparse(first))
                else:
                    found.setdefault(literal, f"{where}:{node.lineno}")
            elif name in ("_spare_event", "_report", "_record") and literal is not None:  # spares', standbys' events
                found.setdefault(literal, f"{where}:{node.lineno}")
            elif name == "Progress":  # a worker's milestone: Progress(rank, generation, phase, ...)
                phase = args[2] if len(args) > 2 else next((k.value for k in node.keywords if k.arg == "phase"), None)
                if isinstance(phase, ast.Constant) and isinstance(phase.value, str):
                    found.setdefault(phase.value, f"{where}:{node.lineno}")
            elif literal is not None and literal.startswith("INSERT INTO events") and len(args) > 1:
                row = args[1].elts if isinstance(args[1], ast.Tuple) else []  # (t, generation, rank, kind, data)
                for value in row:  # the row's kind, written without .event()
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        found.setdefault(value.value, f"{where}:{node.lineno}")
    assert relays == _RELAYED, f"events logged under a name from elsewhere: {sorted(relays)}; see _RELAYED"
    return found


def test_every_event_the_code_writes_is_documented() -> None:
    names = _event_names()
    # The scan finds each kind of source: a plain event, a worker's phase, a spare's, a direct row.
    assert {"job_state", "state_restored", "spare_started", "event_log_replaced"} <= set(names)
    page = (DOCS / "events.md").read_text()
    missing = {name: where for name, where in names.items() if f"`{name}`" not in page}
    assert not missing, f"events written by the code but not in docs/events.md: {missing}"


def test_events_page_names_no_event_the_code_does_not_write() -> None:
    page = (DOCS / "events.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", page, flags=re.M))
    assert len(listed) > 40
    names = _event_names()
    not_events = {"events", "incidents", "node_steps", "steps", "ranks", "job",  # the log's tables
                  "kind", "action", "status"}  # an incident's fields
    assert listed - set(names) - not_events == set()


# --- the error messages ---------------------------------------------------------------------------------


def _error_classes() -> set[str]:
    """Our exception classes: UndyingError and everything derived from it, anywhere in the package."""
    bases = {
        node.name: {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                    for b in node.bases}
        for _, _, nodes in _sources() for node in nodes if isinstance(node, ast.ClassDef)
    }
    classes = {"UndyingError"}
    grew = True
    while grew:
        new = {name for name, of in bases.items() if name not in classes and of & classes}
        classes |= new
        grew = bool(new)
    return classes


def _fragments(node: ast.expr) -> list[str] | None:
    """The literal parts of a message (a string or an f-string, pieces joined by +); None if not literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts, current = [], ""
        for value in node.values:
            if isinstance(value, ast.Constant):
                current += str(value.value)
            else:
                parts.append(current)
                current = ""
        return [*parts, current]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _fragments(node.left), _fragments(node.right)
        if left is None or right is None:
            return None
        return [*left[:-1], left[-1] + right[0], *right[1:]]
    return None


def _messages() -> dict[str, list[str]]:
    """Each message an undying error is raised with, as 'file:line' -> its literal fragments."""
    classes = _error_classes()
    assert {"UsageError", "RecoveryError", "CheckpointError", "TraceSwitchError"} <= classes
    found: dict[str, list[str]] = {}
    for path, _, nodes in _sources():
        for node in nodes:
            if isinstance(node, ast.Call) and _called(node) in classes and node.args:
                parts = _fragments(node.args[0])
                if parts is not None:
                    found[f"{path.relative_to(SRC)}:{node.lineno}"] = parts
    return found


def test_every_error_message_is_documented() -> None:
    """Each literal part of each message (3 characters or more) is quoted on the troubleshooting page."""
    page = _flat((DOCS / "troubleshooting.md").read_text())
    messages = _messages()
    assert len(messages) > 150
    missing = {}
    for where, parts in messages.items():
        absent = [p for p in (_flat(part).strip(" ,;:(") for part in parts) if len(p) >= 3 and p not in page]
        if absent:
            missing[where] = absent
    assert not missing, f"error messages not on docs/troubleshooting.md (file:line -> missing text): {missing}"


def test_message_check_sees_a_message_that_is_not_documented() -> None:
    """The check above is not empty: a made-up message's fragments are not on the page."""
    tree = ast.parse('raise UsageError(f"--frobnicate must be blue, got {x}; paint it")')
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call))
    parts = _fragments(call.args[0])
    assert parts == ["--frobnicate must be blue, got ", "; paint it"]
    page = _flat((DOCS / "troubleshooting.md").read_text())
    assert "--frobnicate must be blue, got" not in page


# --- links ----------------------------------------------------------------------------------------------

_LOOPBACK = re.compile(r"https?://(localhost|127\.[0-9.]+|\[::1\])(:[0-9$A-Z_]+)?(/|$)")
# Package indexes that a command in the README installs from (pip's --index-url), not pages to open.
_PACKAGE_INDEXES = {"https://download.pytorch.org/whl/cpu"}
_URL = re.compile(r"\bhttps?://[^\s)\"'`>\]]*")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def test_no_link_leaves_the_repository() -> None:
    """No web address but this machine's own, and every relative link lands on a file of the repository."""
    problems = []
    for page in _pages():
        text = page.read_text()
        name = page.relative_to(ROOT)
        for url in _URL.findall(text):
            if not _LOOPBACK.match(url) and url not in _PACKAGE_INDEXES:
                problems.append(f"{name}: {url}")
        for target in _LINK.findall(text):
            if target.startswith("#") or "://" in target:
                continue  # an anchor on the page; an address is judged above
            path = (page.parent / target.split("#")[0]).resolve()
            if ROOT not in path.parents and path != ROOT:
                problems.append(f"{name}: {target} leaves the repository")
            elif not path.exists() and path.name not in ("cli.md", "examples.md"):  # written at build time
                problems.append(f"{name}: {target} does not exist")
    assert not problems, problems


@pytest.mark.parametrize("text, bad", [
    ("see [design](../shared/DESIGN.md)", True),
    ("see <https://example.org/x>", True),
    ("open http://localhost:29402/?token=$T", False),
    ("see [arch](docs/architecture.md)", False),
])
def test_link_check_tells_in_from_out(text: str, bad: bool) -> None:
    urls = [u for u in _URL.findall(text) if not _LOOPBACK.match(u)]
    outside = [t for t in _LINK.findall(text) if "://" not in t and ROOT not in (ROOT / t).resolve().parents]
    assert bool(urls or outside) is bad


# --- the site's pages -----------------------------------------------------------------------------------


def test_every_page_is_in_the_navigation() -> None:
    nav = set(re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - nav == set(), "pages not in mkdocs.yml's nav"
    assert nav - pages - {"cli.md", "examples.md"} == set(), "nav entries with no page"
    for required in ("index.md", "tutorial.md", "reference/api.md", "cli.md", "events.md", "troubleshooting.md",
                     "benchmarks.md", "architecture.md", "security.md", "kubernetes.md", "diagnosis.md",
                     "tracing.md", "sharded-state.md", "adopting.md", "metrics.md"):
        assert required in nav


def test_ci_builds_the_site_strictly() -> None:
    """CI runs the strict build, and without -q: mkdocs 1.6 quiet counts no warnings, so strict never fails."""
    ci = (ROOT / ".ci" / "run").read_text()
    builds = re.findall(r"mkdocs build[^&\n]*", ci)
    assert builds, ".ci/run does not build the docs"
    for build in builds:
        assert "--strict" in build and not re.search(r"\s-q\b|--quiet", build), build
    assert ".[test,docs]" in ci or "[docs]" in ci


def test_api_page_documents_every_public_name() -> None:
    """Each name ``undying`` and ``undying.worker`` export has its ``:::`` entry on the Python API page."""
    module = ast.parse((SRC / "worker" / "__init__.py").read_text())
    where: dict[str, str] = {}
    exported: set[str] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_WHERE":
                where = ast.literal_eval(node.value)
            elif node.targets[0].id == "__all__":
                exported |= set(ast.literal_eval(node.value))
    top = ast.parse((SRC / "__init__.py").read_text())
    for node in ast.walk(top):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__":
            exported |= set(ast.literal_eval(node.value)) - {"__version__"}
    assert {"init", "Job", "State", "Step"} <= exported
    page = (DOCS / "reference" / "api.md").read_text()
    for name in sorted(exported):
        assert f"::: undying.worker.{where[name]}.{name}\n" in page, f"{name} is not on docs/reference/api.md"


def test_docs_hold_only_small_files() -> None:
    """Raw benchmark output belongs in docs/data/ as one JSON file, never a bench's whole --out folder.

    A recovery run once wrote its logs, event databases and checkpoints (84 MB)
    into a folder named like its JSON file, and that folder was committed.
    """
    large = [
        f"{path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)"
        for path in DOCS.rglob("*")
        if path.is_file() and path.stat().st_size > 512 * 1024
    ]
    assert not large, f"files too large for docs/: {large}"
    folders = [p.relative_to(ROOT) for p in DOCS.rglob("*.json") if not p.is_file()]
    assert not folders, f"JSON names that are folders in docs/: {folders}"


def test_benchmark_output_is_out_of_the_sites_root() -> None:
    """The site's root holds its pages; the benchmarks' raw JSON is in docs/data/, linked from there."""
    at_root = sorted(path.name for path in DOCS.glob("*.json"))
    assert not at_root, f"JSON files at the docs site's root: {at_root}; move them to docs/data/ " \
                        "and link them as data/NAME.json from docs/benchmarks.md"
    data = sorted((DOCS / "data").glob("*.json"))
    assert data, "docs/data/ holds no benchmark output"
    page = (DOCS / "benchmarks.md").read_text()
    unlinked = [path.name for path in data if f"data/{path.name}" not in page]
    assert not unlinked, f"docs/data/ files that docs/benchmarks.md does not name: {unlinked}"
