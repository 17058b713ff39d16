"""The architecture, checked by numbers: the folders are the layers and the rules below hold.

Layers, lowest first (a module imports from its own layer or a lower one):

0. the contract floor: ``protocol`` (the codec, the messages, generations, the
   stores' wire), with ``errors``, ``inputs``, ``user_files`` and ``procfs``;
1. libraries every role may use: ``checkpoint``, ``trace``, ``config``, and
   ``jobfiles`` (the job dir and what it holds: its layout and lock, the
   token's file, the event log and the records it stores), which imports no role;
2. the roles: ``worker``, ``agent``, ``manager``; none imports another (they
   meet only over the protocol);
3. what assembles them: ``launch`` (the composition roots: ``undying run`` on
   one node with its in-process line, ``undying manager``, and what both build
   alike; the one place a manager and an agent are built together), ``cli``,
   ``demo``, ``k8s``, ``oracle``. The assembly passes each part what it needs at
   construction: it sets no attribute of a part it built (one allowed, with its reason).

Besides: no import circle, no module over 600 lines (none over 450 outside the roles and the
launch layer, whose modules are capped by their own steps; in the manager, the worker, the agent and
the launch layer, none over 450 and no class over 25 methods, properties counted), no import of another
module's private name, each package's ``__all__`` at most 15 names, and the
manager's decision modules (pure functions of the job's facts) import neither
asyncio, sqlite3 nor torch.

The manager's folders are its concerns (``manager/recovery/``, ``regroup/``, ``preemption/``...).
Each subpackage's ``__init__`` is its surface: its public names in ``__all__``, imported on
first use. Code outside a subpackage imports from that surface, never from its modules
(tests may: a unit test reads the module it tests), every name a surface exports is there,
and the subpackages import one another without a circle. The manager's top modules
(``core``, ``manager``, the nodes' and stores' ports, ``restoring``) are no
subpackage: ``core`` is the hub the parts share (it holds the membership book, the hosts,
the step clock and the checkpoints' health), so an import through a surface is followed
to the module that defines the name, and the module graph, so resolved, has no circle.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROLES = ("undying.worker", "undying.agent", "undying.manager")
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (3, ("undying.launch", "undying.cli", "undying.demo", "undying.k8s",
         "undying.__main__")),
    (2, ROLES),
    (1, ("undying.checkpoint", "undying.trace", "undying.config", "undying.jobfiles")),
    (0, ("undying.protocol", "undying.errors", "undying.inputs", "undying.user_files",
         "undying.procfs")),
]
DECISION_MODULES = ("undying.manager.recovery.policy", "undying.manager.regroup.record", "undying.manager.membership.book",
                    "undying.manager.steps.clock", "undying.jobfiles.records", "undying.checkpoint.planner",
                    "undying.jobfiles.progress", "undying.jobfiles.goodput", "undying.jobfiles.reruns", "undying.jobfiles.restarts",
                    "undying.checkpoint.planner.holdings", "undying.checkpoint.planner.paths",
                    "undying.manager.regroup.policy", "undying.manager.preemption.policy", "undying.manager.standbys.policy")
MAX_LINES = 600
# Outside these, a module of one concern fits in 450 lines: one near the cap usually holds two.
MAX_LINES_OUTSIDE_ROLES = 450
CAPPED_APART = ("undying.manager", "undying.agent", "undying.launch", "undying.worker")
MAX_EXPORTS = 15
MANAGER = "undying.manager"
# In the manager, a smell detector rather than a target: a module of one concern, a class of one job.
MAX_MANAGER_LINES = 450  # (and the worker's, the agent's, the launch layer's: CAPPED_PACKAGES)
MAX_MANAGER_METHODS = 25


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "undying").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    for layer, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS in this test (and to the docs)")


def _role(module: str) -> str:
    return next((r for r in ROLES if module == r or module.startswith(r + ".")), "")


def _nodes(tree: ast.AST, *, runtime_only: bool) -> Iterator[ast.AST]:
    """Every node; with ``runtime_only``, not those under ``if TYPE_CHECKING:`` (never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if runtime_only and isinstance(child, ast.If) and isinstance(child.test, ast.Name) \
                    and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(module: str, *, runtime_only: bool = False) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every import in ``module``, typing-only ones too
    unless ``runtime_only``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _nodes(ast.parse(path.read_text()), runtime_only=runtime_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            for sub in submodules:
                yield sub, [], node.lineno
            yield target, [n for n in names if f"{target}.{n}" not in MODULES], node.lineno


def _ours(target: str) -> bool:
    return target == "undying" or target.startswith("undying.")


def _surface(package: str) -> dict[str, str]:
    """Name -> the module it comes from, for each name a package's ``__init__`` imports (typing-only ones
    too: a lazy surface names its modules there)."""
    if package not in MODULES or MODULES[package].name != "__init__.py":
        return {}
    return {name: target for target, names, _ in _imports(package) if _ours(target) for name in names}


def _defining(target: str, names: list[str]) -> set[str]:
    """The modules an import of ``names`` from ``target`` reaches: through a package's surface, the module
    each name is defined in (followed from surface to surface); else ``target`` itself."""
    surface = _surface(target)
    if not surface or not names:
        return {target}
    found = set()
    for name in names:
        source = surface.get(name)
        found |= _defining(source, [name]) if source else {target}
    return found


def _edges(module: str, *, runtime_only: bool = False) -> Iterator[tuple[str, int]]:
    """(module reached, line) for every import of ``module``, through surfaces to the defining modules."""
    for target, names, line in _imports(module, runtime_only=runtime_only):
        for reached in _defining(target, names):
            yield reached, line


def _parents(module: str) -> list[str]:
    """The packages Python runs before ``module``: ``undying``, ``undying.manager``..."""
    parts = module.split(".")
    return [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in MODULES]


MANAGER_PARTS = sorted(m for m, p in MODULES.items()
                       if m.startswith(MANAGER + ".") and m.count(".") == 2 and p.name == "__init__.py")


def _part(module: str) -> str:
    """The manager subpackage ``module`` is in (the subpackage's own name for its ``__init__``), or ''."""
    return next((p for p in MANAGER_PARTS if module == p or module.startswith(p + ".")), "")


def test_every_import_goes_to_the_same_layer_or_a_lower_one_and_roles_meet_only_over_the_protocol() -> None:
    wrong = []
    for module in MODULES:
        if module == "undying":
            continue  # the package's lazy front door names what users import
        for target, _, line in _imports(module):
            if not _ours(target) or target == "undying" or target not in MODULES:
                continue
            if _layer(target) > _layer(module):
                wrong.append(f"{module}:{line} imports {target} (layer {_layer(target)} > {_layer(module)})")
            elif _layer(module) == 2 and _role(target) and _role(target) != _role(module):
                wrong.append(f"{module}:{line} imports {target}: roles meet only over undying.protocol")
    assert not wrong, "\n".join(wrong)


def test_a_manager_and_an_agent_are_assembled_together_only_in_the_launch_layer() -> None:
    """Outside ``undying.launch``, no module imports both the manager's and the agent's code."""
    wrong = []
    for module in MODULES:
        roles = {_role(target) for target, _, _ in _imports(module) if _ours(target)}
        if {"undying.agent", "undying.manager"} <= roles and not module.startswith("undying.launch"):
            wrong.append(module)
    assert not wrong, f"these assemble a manager with an agent outside undying.launch: {wrong}"


def test_the_job_files_import_no_role() -> None:
    """Every role reads the job dir, its token and its log through ``undying.jobfiles``: it imports none of them."""
    wrong = [f"{module}:{line} imports {target}"
             for module in MODULES if module == "undying.jobfiles" or module.startswith("undying.jobfiles.")
             for target, _, line in _imports(module) if _role(target)]
    assert not wrong, "\n".join(wrong)


def test_there_is_no_import_circle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            continue  # a package's front door imports its own modules lazily
        graph[module] = {t for t, _ in _edges(module) if t in MODULES and t != module
                         and MODULES[t].name != "__init__.py"}  # (a name from a surface: its module)
    circles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_no_module_is_over_600_lines() -> None:
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


def test_no_module_outside_the_roles_and_the_launch_layer_is_over_450_lines() -> None:
    big = {m: n for m, p in MODULES.items()
           if not any(m == c or m.startswith(c + ".") for c in CAPPED_APART)
           and (n := len(p.read_text().splitlines())) > MAX_LINES_OUTSIDE_ROLES}
    assert not big, f"split these by concern: {big}"


# Capped by their own steps of issue #26 (the rest is capped above): a module of one concern, a class of one job.
CAPPED_PACKAGES = ("undying.manager", "undying.worker", "undying.agent", "undying.launch")


def _in(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("package", CAPPED_PACKAGES)
def test_no_module_of_a_capped_package_is_over_450_lines(package: str) -> None:
    big = {m: n for m, p in MODULES.items()
           if _in(package, m) and (n := len(p.read_text().splitlines())) > MAX_MANAGER_LINES}
    assert not big, f"split these by concern: {big}"


@pytest.mark.parametrize("package", CAPPED_PACKAGES)
def test_no_class_of_a_capped_package_has_over_25_methods(package: str) -> None:
    """A main class is a router over named parts it builds or is given; no part is a god class either."""
    big = {}
    for module, path in MODULES.items():
        if not _in(package, module):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [f for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
                if len(methods) > MAX_MANAGER_METHODS:
                    big[f"{module}.{node.name}"] = len(methods)
    assert not big, f"these classes do more than one job: {big}"


def test_no_module_imports_another_modules_private_name() -> None:
    private = [f"{module}:{line} imports {target}.{name}"
               for module in MODULES for target, names, line in _imports(module) if _ours(target)
               for name in names if name.startswith("_") and not name.startswith("__")]
    assert not private, "\n".join(private)


def _exports(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_a_package_exports_at_most_15_names(package: str) -> None:
    exports = _exports(MODULES[package])
    assert len(exports) <= MAX_EXPORTS, f"{package} exports {len(exports)} names: {exports}"


@pytest.mark.parametrize("module", DECISION_MODULES)
def test_a_decision_module_imports_neither_asyncio_sqlite3_nor_torch(module: str) -> None:
    def heavy(target: str) -> bool:
        return target.split(".")[0] in ("asyncio", "sqlite3", "torch")

    def reaches(start: str) -> list[str]:
        """The heavy imports ``start`` makes, itself or through our modules it imports (a name from a
        package's surface: the module that defines it; and the packages Python runs first)."""
        seen, todo, found = {start}, [start], []
        while todo:
            current = todo.pop()
            for target, line in [*_edges(current, runtime_only=True), *((p, 0) for p in _parents(current))]:
                if heavy(target):
                    found.append(f"{current}:{line} imports {target}")
                elif target in MODULES and target not in seen and _ours(target):
                    seen.add(target)
                    todo.append(target)
        return found

    assert not reaches(module), reaches(module)


def test_the_manager_is_split_into_subpackages_by_concern() -> None:
    """The folders say the concerns; the flat folder of near-twin names (regroup, regrouping,
    regroup_policy; standby, standbys) is gone."""
    expected = {"checkpoints", "http", "injection", "integrity", "membership", "placement", "preemption",
                "recovery", "regroup", "standbys", "steps", "tracing", "trackers", "views"}
    assert {p.rpartition(".")[2] for p in MANAGER_PARTS} == expected
    top = sorted(m for m in MODULES if m.startswith(MANAGER + ".") and m.count(".") == 2 and not _part(m))
    assert len(top) <= 9, f"the manager's top folder holds {top}: does a new module belong to a concern's folder?"


def test_code_outside_a_manager_subpackage_imports_it_only_through_its_surface() -> None:
    wrong = []
    for module in MODULES:
        for target, names, line in _imports(module):
            part = _part(target)
            if not part or _part(module) == part:
                continue
            if target != part:
                wrong.append(f"{module}:{line} imports {target}: import from its surface, {part}")
            elif missing := [n for n in names if n not in _exports(MODULES[part])]:
                wrong.append(f"{module}:{line} imports {missing} from {part}, which does not export them")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", [MANAGER, *MANAGER_PARTS])
def test_every_name_a_manager_surface_exports_is_there(package: str) -> None:
    """A lazy surface (names imported on first use) names each name's module twice: once for the type
    checker, once for the import. Both agree, and every name in ``__all__`` is there at run time."""
    exports = _exports(MODULES[package])
    assert exports and set(exports) == set(_surface(package)), (exports, _surface(package))
    loaded = importlib.import_module(package)
    absent = [name for name in exports if getattr(loaded, name, None) is None]
    assert not absent, f"{package} exports {absent} but has none of them"


def test_the_managers_subpackages_import_one_another_without_a_circle() -> None:
    graph: dict[str, set[str]] = {p: set() for p in MANAGER_PARTS}
    for module in MODULES:
        if part := _part(module):
            graph[part] |= {_part(t) for t, _ in _edges(module)} - {"", part}
    circles = []
    for start in MANAGER_PARTS:
        todo, seen = [(start, [start])], set()
        while todo:
            current, path = todo.pop()
            for target in sorted(graph[current]):
                if target == start:
                    circles.append(" -> ".join([*path, target]))
                elif target not in seen:
                    seen.add(target)
                    todo.append((target, [*path, target]))
    assert not circles, "\n".join(sorted(set(circles)))


# The assembly builds each part with what it needs (constructor arguments, or one typed bind call for
# the facts that exist only later); it never wires a part by setting its attributes afterwards.
ASSEMBLY = ("undying.launch", "undying.agent.remote")
# (module, "object.attribute") written anyway, each with its reason.
WIRED_AFTER_THE_FACT = {
    # Migrations (manager/placement) takes the agents' server at no constructor argument yet, and the
    # Manager builds it before the server is known to it: the one wire left, until placement takes it.
    ("undying.launch.manager_service", "manager.migrations.server"),
}


def _written_objects(target: ast.expr) -> Iterator[ast.Attribute]:
    """The attributes an assignment to ``target`` writes (``x.y = ``, ``x.y[k] = ``, in tuples too)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _written_objects(element)
    elif isinstance(target, ast.Starred):
        yield from _written_objects(target.value)
    elif isinstance(target, ast.Subscript):
        if isinstance(target.value, ast.Attribute):
            yield target.value
    elif isinstance(target, ast.Attribute):
        yield target


def test_the_assembly_sets_no_attribute_of_a_part_it_built() -> None:
    """In the launch layer and the remote agent's runner, only ``self``/``cls`` have attributes assigned:
    every other part gets its facts at construction, or in one bind call that says why they come late."""
    wrong = []
    for module, path in MODULES.items():
        if not any(module == m or module.startswith(m + ".") for m in ASSEMBLY):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                wrong.append(f"{module}:{node.lineno} calls setattr")
            for target in targets:
                for written in _written_objects(target):
                    owner = written.value
                    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                        continue
                    name = ast.unparse(written)
                    if (module, name) not in WIRED_AFTER_THE_FACT:
                        wrong.append(f"{module}:{node.lineno} assigns {name}")
    assert not wrong, "pass these at construction (or in a bind call):\n" + "\n".join(wrong)
