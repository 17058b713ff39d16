"""One name per value, checked on the code's syntax tree: the environment's variables.

Every ``UNDYING_`` variable is one constant of ``undying.protocol.env``, named
by rule (``UNDYING_X`` is ``X_ENV``), and every other module imports it: no
module of ``src/undying`` but that one spells an ``UNDYING_`` name (a string
literal, or a part of an f-string, that starts with it; docstrings and comments
aside) or builds one from the prefix. Each constant there is used outside it
(directly, or through a table of it that is), so none is a dead name. A
timeout's default is written once: on its field of ``Timeouts``, and the
heartbeat's as one constant that ``Timeouts`` and the spare's beat both take.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from undying.config import JobConfig, Timeouts
from undying.inputs import ENV_VARS, TIMEOUT_NAMES
from undying.protocol import env as names

SRC = Path(__file__).resolve().parents[2] / "src" / "undying"
ENV_MODULE = SRC / "protocol" / "env.py"
PREFIX = "UNDYING_"
HEARTBEAT_DEFAULT = "DEFAULT_HEARTBEAT_TIMEOUT_S"
TREES = {path: ast.parse(path.read_text(), str(path)) for path in sorted(SRC.rglob("*.py"))}
OTHERS = {path: tree for path, tree in TREES.items() if path != ENV_MODULE}
VARIABLES = {name: value for name, value in vars(names).items() if name.endswith("_ENV")}


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(SRC.parent)}:{getattr(node, 'lineno', '?')}"


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def _named(node: ast.AST, name: str) -> bool:
    """``node`` is ``name`` or ``<something>.name``."""
    return (isinstance(node, ast.Name) and node.id == name) \
        or (isinstance(node, ast.Attribute) and node.attr == name)


def _constants() -> dict[str, ast.expr]:
    """protocol/env.py's module-level constants (``__all__`` aside), each with its value."""
    found = {}
    for node in TREES[ENV_MODULE].body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id != "__all__":
            found[target.id] = value
    return found


CONSTANTS = _constants()


def _used_names(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.ImportFrom):
            yield from (alias.name for alias in node.names)


def test_no_module_but_protocol_env_spells_an_undying_name() -> None:
    wrong = []
    for path, tree in OTHERS.items():
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith(PREFIX) and id(node) not in docs:
                wrong.append(f"{_where(path, node)} spells {node.value!r}")
    assert not wrong, "import its constant from undying.protocol.env:\n" + "\n".join(wrong)


def test_no_module_but_protocol_env_builds_a_name_from_the_prefix() -> None:
    wrong = []
    for path, tree in OTHERS.items():
        for node in ast.walk(tree):
            formatted = isinstance(node, ast.JoinedStr) and bool(node.values) \
                and isinstance(node.values[0], ast.FormattedValue) \
                and _named(node.values[0].value, "ENV_PREFIX")
            added = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) \
                and _named(node.left, "ENV_PREFIX")
            if formatted or added:
                wrong.append(f"{_where(path, node)} builds a name from ENV_PREFIX")
    assert not wrong, "name it in undying.protocol.env and import it:\n" + "\n".join(wrong)


def test_each_variable_is_one_constant_named_by_the_rule() -> None:
    wrong = [f"{name} = {value!r}: expected {PREFIX}{name.removesuffix('_ENV')}"
             for name, value in VARIABLES.items() if value != PREFIX + name.removesuffix("_ENV")]
    assert not wrong, "\n".join(wrong)
    built = [name for name in VARIABLES if not isinstance(CONSTANTS.get(name), ast.Constant)]
    assert not built, f"spell each name out (grep finds it): {built}"
    assert set(names.__all__) == set(CONSTANTS), "protocol/env.py's __all__: exactly its constants"


def test_each_constant_of_protocol_env_is_used_outside_it() -> None:
    used = {name for tree in OTHERS.values() for name in _used_names(tree)} & set(CONSTANTS)
    todo = list(used)
    while todo:  # a constant a used one is made of (a table's members) is used too
        for name in _used_names(CONSTANTS[todo.pop()]):
            if name in CONSTANTS and name not in used:
                used.add(name)
                todo.append(name)
    dead = sorted(set(CONSTANTS) - used)
    assert not dead, f"defined in protocol/env.py and read nowhere in src/undying: {dead}"


def test_the_timeouts_table_is_timeouts_fields_by_the_rule() -> None:
    fields = [f.name for f in dataclasses.fields(Timeouts)]
    assert list(names.TIMEOUT_ENVS) == fields
    assert all(name == f"{PREFIX}TIMEOUT_{field.upper()}"
               for field, name in names.TIMEOUT_ENVS.items())
    assert tuple(field.upper() for field in fields) == TIMEOUT_NAMES
    assert set(names.TIMEOUT_ENVS.values()) <= set(ENV_VARS) <= set(VARIABLES.values())


def test_the_step_timeout_is_not_shipped_to_workers() -> None:
    """No worker reads it: the agent judges a step's stall from its own config."""
    shipped = JobConfig(job_id="j", job_dir="d", timeouts=Timeouts(step=12.0)).timeout_env()
    assert names.TIMEOUT_STEP_ENV not in shipped
    assert set(shipped) == set(names.TIMEOUT_ENVS.values()) - {names.TIMEOUT_STEP_ENV}


def _number(node: ast.AST) -> bool:
    """A literal number, or a literal string of one ("30")."""
    if not isinstance(node, ast.Constant) or isinstance(node.value, bool):
        return False
    if isinstance(node.value, int | float):
        return True
    try:
        float(node.value)
    except (TypeError, ValueError):
        return False
    return True


def _of_timeouts(call: ast.Call) -> bool:
    """``call`` is ``<...>.get("timeouts", ...).get(...)``: a stored config's timeout."""
    inner = call.func.value if isinstance(call.func, ast.Attribute) else None
    return isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) \
        and inner.func.attr == "get" and bool(inner.args) \
        and isinstance(inner.args[0], ast.Constant) and inner.args[0].value == "timeouts"


def test_a_timeouts_default_is_written_once() -> None:
    """A reader of a timeout's variable, or of a stored config's, has no default of its own."""
    timeouts = [name for name in VARIABLES if name.startswith("TIMEOUT_")]
    wrong = []
    for path, tree in OTHERS.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and len(node.args) == 2 and _number(node.args[1])):
                continue
            key = node.args[0]
            if any(_named(key, name) for name in timeouts) or (
                    isinstance(key, ast.Constant) and key.value in names.TIMEOUT_ENVS
                    and _of_timeouts(node)):
                wrong.append(f"{_where(path, node)} reads a timeout with a default of its own")
    assert not wrong, f"take it from Timeouts (or {HEARTBEAT_DEFAULT}):\n" + "\n".join(wrong)


def test_the_heartbeat_timeouts_default_is_one_constant() -> None:
    # Written once: its literal in protocol/env.py ...
    assert isinstance(CONSTANTS[HEARTBEAT_DEFAULT], ast.Constant)
    assert names.DEFAULT_HEARTBEAT_TIMEOUT_S == 30.0
    # ... Timeouts' field takes it ...
    [timeouts] = [node for node in TREES[SRC / "config.py"].body
                  if isinstance(node, ast.ClassDef) and node.name == "Timeouts"]
    [field] = [node for node in timeouts.body
               if isinstance(node, ast.AnnAssign) and _named(node.target, "heartbeat")]
    assert field.value is not None and _named(field.value, HEARTBEAT_DEFAULT), ast.unparse(field)
    # ... and every function that reads the variable takes it, with no number of its own.
    readers = [(path, node) for path, tree in OTHERS.items() for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
               and any(_named(n, "TIMEOUT_HEARTBEAT_ENV") for n in ast.walk(node))]
    assert readers, "the spare's beat reads the heartbeat timeout (protocol/worker_wire.py)"
    for path, function in readers:
        thirty = [n for n in ast.walk(function)
                  if _number(n) and isinstance(n, ast.Constant) and float(n.value) == 30.0]
        takes = any(_named(n, HEARTBEAT_DEFAULT) for n in ast.walk(function))
        assert not thirty and takes, \
            f"{_where(path, function)} {function.name}: the heartbeat timeout without its default"
