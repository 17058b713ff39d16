"""One name per value, checked on the code's syntax tree: the options, the config, the environment.

Every ``UNDYING_`` variable is one constant of ``undying.protocol.env``, named
by rule (``UNDYING_X`` is ``X_ENV``), and every other module imports it: no
module of ``src/undying`` but that one spells an ``UNDYING_`` name (a string
literal, or a part of an f-string, that starts with it; docstrings and comments
aside) or builds one from the prefix. Each constant there is used outside it
(directly, or through a table of it that is), so none is a dead name. A
timeout's default is written once: on its field of ``Timeouts``, and the
heartbeat's as one constant that ``Timeouts`` and the spare's beat both take.

The options of ``undying run`` and ``undying manager`` map to config fields by
the rule of ``undying.config``: ``--a-b`` is the field ``a_b`` of ``JobConfig``
(or ``ManagerOptions``) or of exactly one of its sections, and each field is
read somewhere outside the config package. An option of a field takes its
default from the field (``cli/settings.add_setting``) and its help shows it
with ``%(default)``, never as a number of its own. A rank is sent exactly the
timeouts its code reads.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from undying.config import JobConfig, Timeouts
from undying.inputs import ENV_VARS
from undying.protocol import env as names

SRC = Path(__file__).resolve().parents[2] / "src" / "undying"
ENV_MODULE = SRC / "protocol" / "env.py"
PREFIX = "UNDYING_"
HEARTBEAT_DEFAULT = "DEFAULT_HEARTBEAT_TIMEOUT_S"
TREES = {path: ast.parse(path.read_text(), str(path)) for path in sorted(SRC.rglob("*.py"))}
OTHERS = {path: tree for path, tree in TREES.items() if path != ENV_MODULE}
VARIABLES = {name: value for name, value in vars(names).items() if name.endswith("_ENV")}
TIMEOUT_FIELDS = {f.name for f in dataclasses.fields(Timeouts)}


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
    # Each a field of Timeouts; its variable is UNDYING_TIMEOUT_<the option's words less the last>.
    assert set(names.TIMEOUT_ENVS) <= TIMEOUT_FIELDS
    assert all(name == f"{PREFIX}TIMEOUT_{field.removesuffix('_timeout').removesuffix('_grace').upper()}"
               for field, name in names.TIMEOUT_ENVS.items())
    assert set(names.TIMEOUT_ENVS.values()) <= set(ENV_VARS) <= set(VARIABLES.values())


def test_a_rank_is_sent_exactly_the_timeouts_its_code_reads() -> None:
    """Each timeout sent (``TIMEOUT_ENVS``) is read by a rank's code (``worker/``, or the spare's beat in
    ``protocol/worker_wire.py``), by its field or its variable; and no rank's code reads a timeout it
    is not sent (that would be the default, silently, not the launcher's value)."""
    shipped = JobConfig(job_id="j", job_dir="d", timeouts=Timeouts(step_timeout=12.0)).timeout_env()
    assert set(shipped) == set(names.TIMEOUT_ENVS.values())
    rank_code = {path: tree for path, tree in OTHERS.items()
                 if "worker" in path.relative_to(SRC).parts or path.name == "worker_wire.py"}
    used = {name for tree in rank_code.values() for name in _used_names(tree)}
    constant = {value: name for name, value in VARIABLES.items()}
    unread = [f for f, env in names.TIMEOUT_ENVS.items() if f not in used and constant[env] not in used]
    assert not unread, f"sent to every rank and read by none: {unread}"
    fields = {f.name for f in dataclasses.fields(Timeouts)}
    unsent = sorted((used & fields) - set(names.TIMEOUT_ENVS))
    assert not unsent, f"read by a rank but not sent to it (TIMEOUT_ENVS): {unsent}"


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
                    isinstance(key, ast.Constant) and key.value in TIMEOUT_FIELDS
                    and _of_timeouts(node)):
                wrong.append(f"{_where(path, node)} reads a timeout with a default of its own")
    assert not wrong, f"take it from Timeouts (or {HEARTBEAT_DEFAULT}):\n" + "\n".join(wrong)


def test_the_heartbeat_timeouts_default_is_one_constant() -> None:
    # Written once: its literal in protocol/env.py ...
    assert isinstance(CONSTANTS[HEARTBEAT_DEFAULT], ast.Constant)
    assert names.DEFAULT_HEARTBEAT_TIMEOUT_S == 30.0
    # ... Timeouts' field takes it ...
    [timeouts] = [node for node in TREES[SRC / "config" / "timeouts.py"].body
                  if isinstance(node, ast.ClassDef) and node.name == "Timeouts"]
    [field] = [node for node in timeouts.body
               if isinstance(node, ast.AnnAssign) and _named(node.target, "heartbeat_timeout")]
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


# --- options and config fields --------------------------------------------------------------------
CLI = SRC / "cli"
# The modules that declare each command's options (cli/limits.py: both commands' connection options).
COMMANDS = {"run": ("run.py", "torchrun_flags.py", "limits.py"), "manager": ("manager.py", "limits.py")}
# The options of `undying run` that are no field of the job's config, each for its reason.
NOT_FIELDS = {
    # How this launcher joins a job, not what the job is (given to the agent beside its JobConfig).
    "--manager", "--standby", "--token-file",
    # The script's own settings, given to every rank as a variable it reads (protocol/env.py says which).
    "--virtual-ranks", "--verify-every", "--numerics", "--spike-factor", "--rollback-steps",
    "--max-skips-in-a-row", "--max-skipped-share",
    # torchrun's spellings: mapped onto undying's own options (cli/torchrun_flags.py) or accepted and ignored.
    "--standalone", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--monitor-interval",
    "--start-method", "--run-path", "--local-addr",
}


def _leaves(section: type) -> Iterator[tuple[str, type]]:
    """Every field of ``section`` and of its sections (a field that is itself a dataclass), with its class."""
    for f in dataclasses.fields(section):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            yield from _leaves(type(default))
        else:
            yield f.name, section


def _options(command: str) -> list[tuple[Path, ast.Call, str]]:
    """Each option a command declares: (module, the call, its long option)."""
    found = []
    for module in COMMANDS[command]:
        path = CLI / module
        for node in ast.walk(TREES[path]):
            if isinstance(node, ast.Call) and (_named(node.func, "add_argument") or _named(node.func, "add_setting")):
                spelled = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                long = next((o for o in spelled if o.startswith("--")), None)
                if long is not None and long != "--help":
                    found.append((path, node, long))
    return found


def _config(command: str) -> type:
    from undying.config import ManagerOptions

    return JobConfig if command == "run" else ManagerOptions


def test_each_field_name_is_one_value() -> None:
    """A field's name is unique over the whole config (its sections' fields included): an option names one."""
    for command in COMMANDS:
        names_ = [name for name, _ in _leaves(_config(command))]
        assert len(names_) == len(set(names_)), sorted(n for n in names_ if names_.count(n) > 1)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_option_is_the_config_field_of_its_name(command: str) -> None:
    """``--a-b`` is the field ``a_b`` (dashes to underscores, the same words), of the section it names."""
    fields = dict(_leaves(_config(command)))
    wrong = []
    for path, call, option in _options(command):
        field = option.removeprefix("--").replace("-", "_")
        if option in NOT_FIELDS and command == "run":
            if field in fields:
                wrong.append(f"{_where(path, call)} {option} is a field ({field}): take it off NOT_FIELDS")
            continue
        if field not in fields:
            wrong.append(f"{_where(path, call)} {option}: no config field {field!r} (rename the field to the "
                         "option's words, or list the option in NOT_FIELDS with its reason)")
        elif _named(call.func, "add_setting"):
            section = call.args[1]
            if not _named(section, fields[field].__name__):
                wrong.append(f"{_where(path, call)} {option}: its field is {fields[field].__name__}.{field}, "
                             f"not {ast.unparse(section)}'s")
    assert not wrong, "\n".join(wrong)


def _default(call: ast.Call) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == "default"), None)


def required(call: ast.Call) -> bool:
    return any(k.arg == "required" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def _help_text(call: ast.Call) -> str:
    """The literal parts of an option's help."""
    value = next((k.value for k in call.keywords if k.arg == "help"), None)
    if value is None:
        return ""
    return " ".join(n.value for n in ast.walk(value) if isinstance(n, ast.Constant) and isinstance(n.value, str))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_options_default_is_its_fields(command: str) -> None:
    """An option of a field takes the field's default (add_setting), or None (its absence, which the
    command resolves from the field, e.g. ``JobConfig.max_restarts``) or an expression of the field
    (or it is required):
    never a literal of its own; its help shows the default by ``%(default)`` or from the field."""
    import re

    fields = dict(_leaves(_config(command)))
    wrong = []
    for path, call, option in _options(command):
        field = option.removeprefix("--").replace("-", "_")
        if field not in fields or (command == "run" and option in NOT_FIELDS):
            continue
        default = _default(call)
        if _named(call.func, "add_setting"):
            if default is not None:
                wrong.append(f"{_where(path, call)} {option}: add_setting takes the field's default; drop default=")
        elif required(call):
            continue  # (no default at all)
        elif default is None or (isinstance(default, ast.Constant) and default.value is not None):
            wrong.append(f"{_where(path, call)} {option}: a default of its own ({ast.unparse(default or call)}); "
                         "declare it with add_setting, or default=None and the field's default where it is read")
        if re.search(r"default:? [-+]?\d[\d.]*(?=[),;:])", _help_text(call)):
            wrong.append(f"{_where(path, call)} {option}: its help writes a default number: use %(default)")
    assert not wrong, "\n".join(wrong)


def _attributes_read(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            yield node.attr


def test_each_config_field_is_read_outside_the_config_module() -> None:
    from undying.config import ManagerOptions

    config_package = SRC / "config"
    read = {name for path, tree in TREES.items() if config_package not in path.parents
            for name in _attributes_read(tree)}
    unread = sorted({name for section in (JobConfig, ManagerOptions) for name, _ in _leaves(section)} - read)
    assert not unread, f"config fields nothing outside undying/config/ reads: {unread}"
