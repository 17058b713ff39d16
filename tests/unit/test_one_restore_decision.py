"""One restore decision, checked on the code's syntax tree: every path that replaces a rank's state asks the planner.

A function *replaces a rank's state* when it loads one into a rank
(``load_state_dict``, a snapshot ring's or the shards' ``restore``/``rollback``,
a checkpoint's or a shard's load, a verify file's), leaves one waiting for the
State (``ctx.stash``/``ctx.deferred``), or starts ranks on a checkpoint
(``spawn(..., resume_from=...)``, unless it passes its own parameter on). Every such function
of the roles that hold state (``worker``, ``manager``) is named below, in one of
three tables, with the reason:

- ``PATHS`` decide: each calls the one planner (``undying.checkpoint.planner``);
- ``CARRIERS`` carry a plan out: each takes the plan as a parameter;
- ``MECHANISMS`` are the moves themselves (load these bytes into this State),
  with no choice of source in them.

Not counted: undoing a failed attempt of the same step (``NumericsGuard._rewind``
puts the buffers back as they were at the step's start, ``discard_gradients``
drops the gradients): no state comes from anywhere else, so there is nothing to
decide.

A new function that replaces state fails ``test_every_function_that_replaces_state_is_named``
until it is named, and one named as a path that stops asking the planner fails
``test_each_path_asks_the_planner``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "undying"
ROLES = ("worker", "manager")
PLANNER = "undying.checkpoint.planner"
PLAN_TYPES = {"RestorePlan", "StatePlan"}

# Calls that put a state into a rank.
LOADS = {"load_state_dict", "load_checkpoint", "load_replicated", "load_shard_bytes", "load_dcp_state_dict",
         "load_sharded", "load_sealed"}
# ``<receiver>.<method>(...)``: a snapshot ring's restore, the shards' restore from memory or roll-back to disk.
RECEIVED = {("ring", "restore"), ("shards", "restore"), ("shards", "rollback")}
WAITING = {"stash", "deferred"}  # JobContext's: a state that waits for the script's State

PATHS = {
    # recovery after a fault
    "worker/rejoin.py:Rejoin._restore":
        "recovery, a whole (DDP) state: every rank plans from the statuses all exchanged",
    "worker/rejoin.py:Rejoin._restore_shards":
        "recovery, a sharded state: from memory, or (planned again once read) from the latest checkpoint",
    "manager/recovery/incident_plan.py:plan_after":
        "recovery, the manager's decision: its view of the members; the restart rung carries the plan out",
    # numerics roll-back
    "worker/numerics_guard.py:NumericsGuard.resolve":
        "numerics roll-back: back to the newest pre-step state every rank's snapshot ring holds",
    # verification roll-back
    "worker/verify.py:Verification._roll_back":
        "verification roll-back: the holder's file of the last verified state, never a rank's own memory",
    # resume at start
    "worker/startup.py:resume_at_start":
        "resume at start: a replacement's state from the members, a launch's from its checkpoint",
    "manager/manager.py:Manager.run":
        "resume at start: every rank of generation 0 from the latest valid checkpoint, or fresh",
    # regroup
    "manager/regroup/executor.py:Regrouping.begin":
        "regroup: the members keep and save their newest step, or (sharded) the latest checkpoint",
    "manager/regroup/executor.py:Regrouping.maybe_form_world":
        "regroup: the new world starts from the saved checkpoint, the steps after it re-run",
}

CARRIERS = {
    "worker/rejoin.py:Rejoin._move_whole_state": "sends and receives the whole state the DDP plan names",
    "worker/shards.py:Shards.restore": "every rank's shard from where the plan says (itself, snapshot, replica)",
    "worker/shards.py:Shards.rollback": "every rank loads the checkpoint the plan names",
    "worker/checkpoints.py:Checkpoints.resume": "reads the checkpoint the start's plan names",
    "worker/checkpoints.py:Checkpoints.load_waiting": "loads, once the State exists, what the start's plan left "
                                                      "waiting (a checkpoint, or a peer's state)",
    "manager/recovery/rounds.py:Recoveries._restart_all": "starts every rank on the checkpoint the recovery plan read",
}

MECHANISMS = {
    "worker/state.py:State.load_state_dict": "the State's own load: what every path ends in",
    "worker/snapshots.py:SnapshotRing.restore": "loads the snapshot of the step its caller's plan names",
    "worker/shards.py:Shards.load_checkpoint": "a collective DCP load of the checkpoint its caller's plan names "
                                               "(Shards.rollback, Checkpoints.resume)",
    "worker/shards.py:Shards._apply_shard": "applies the shard bytes Shards.restore received",
    "worker/sharding.py:load_shard_bytes": "a shard's bytes into a sharded State",
    "worker/sharding.py:_load_extras": "the extras of a shard's bytes",
    "worker/sharding.py:load_dcp_state_dict": "a DCP-loaded dict into a sharded State",
    "worker/verifier.py:serve": "the verifier is no rank: it loads the holder's file a request names, replays "
                                "one step and throws the state away",
    "worker/verifier.py:_load_request": "reads a replay request's files for the verifier (no rank's state)",
}


def _qualified(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, ``Class.method`` or ``function`` (nested functions belong to their outer one)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield f"{node.name}.{item.name}", item


def _last_name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _replaces_state(function: ast.AST) -> list[str]:
    """What in ``function`` replaces a rank's state (empty: nothing)."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            name = _last_name(node.func)
            if name in LOADS:
                found.append(f"{name}()")
            if isinstance(node.func, ast.Attribute) and (_last_name(node.func.value), name) in RECEIVED:
                found.append(f"{_last_name(node.func.value)}.{name}()")
            for keyword in node.keywords if name == "spawn" else ():
                value = keyword.value
                if keyword.arg == "resume_from" and not (isinstance(value, ast.Name) and value.id == "resume_from") \
                        and not (isinstance(value, ast.Constant) and not value.value):
                    found.append("resume_from=")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr in WAITING \
                        and not (isinstance(node.value, ast.Constant) and node.value.value is None):
                    found.append(f".{target.attr} =")
    return found


def _trees() -> dict[str, ast.Module]:
    return {_qualified(path): ast.parse(path.read_text(), str(path))
            for role in ROLES for path in sorted((SRC / role).rglob("*.py"))}


TREES = _trees()
FUNCTIONS = {f"{module}:{name}": node for module, tree in TREES.items() for name, node in _functions(tree)}


def _planner_names(tree: ast.Module) -> set[str]:
    """Names a module imported from the planner package (``plan``, ``plan_start``, ..., or ``planner`` itself)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PLANNER):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "undying.checkpoint":
            names.update(alias.asname or alias.name for alias in node.names if alias.name == "planner")
    return names


def _asks_planner(function: ast.AST, imported: set[str]) -> bool:
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in imported and func.id.startswith("plan"):
            return True
        if isinstance(func, ast.Attribute) and func.attr.startswith("plan") and isinstance(func.value, ast.Name) \
                and func.value.id == "planner" and "planner" in imported:
            return True
    return False


def _takes_plan(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    return any(arg.annotation is not None and _last_name(arg.annotation) in PLAN_TYPES for arg in args)


def test_the_tables_do_not_overlap_and_name_existing_functions() -> None:
    named = [*PATHS, *CARRIERS, *MECHANISMS]
    assert len(named) == len(set(named)), "a function is named in two tables"
    missing = [name for name in named if name not in FUNCTIONS]
    assert not missing, f"named but not found (renamed or moved? update this test): {missing}"


def test_every_function_that_replaces_state_is_named() -> None:
    named = {*PATHS, *CARRIERS, *MECHANISMS}
    unnamed = {name: what for name, node in FUNCTIONS.items() if (what := _replaces_state(node)) and name not in named}
    assert not unnamed, (
        "these replace a rank's state but are not named in this test: ask the planner "
        f"(undying.checkpoint.planner) and name them in PATHS, or take its plan (CARRIERS): {unnamed}")


@pytest.mark.parametrize("name", sorted(PATHS))
def test_each_path_asks_the_planner(name: str) -> None:
    module = name.split(":")[0]
    assert _asks_planner(FUNCTIONS[name], _planner_names(TREES[module])), \
        f"{name} ({PATHS[name]}) replaces state without asking the planner"


@pytest.mark.parametrize("name", sorted(CARRIERS))
def test_each_carrier_is_given_a_plan(name: str) -> None:
    assert _takes_plan(FUNCTIONS[name]), f"{name} ({CARRIERS[name]}) carries out no plan it is given"


def test_the_five_paths_of_the_issue_are_all_here() -> None:
    """Recovery, numerics roll-back, verification roll-back, resume at start, regroup: each has its path."""
    reasons = " ".join(PATHS.values())
    for path in ("recovery", "numerics roll-back", "verification roll-back", "resume at start", "regroup"):
        assert f"{path}:" in reasons or f"{path}," in reasons, path


def test_the_check_sees_a_path_that_decides_alone() -> None:
    """The checks above can fail: a function that loads a snapshot it picked itself, and one that asks."""
    alone = ast.parse("def roll(ring, state):\n    ring.restore(3, state)\n")
    asks = ast.parse("from undying.checkpoint.planner import plan_numerics_rollback\n"
                     "def roll(ring, state):\n    p = plan_numerics_rollback(step=4, rollback_steps=2, oldest=[3])\n"
                     "    ring.restore(p.step + 1, state)\n")
    (_, alone_fn), = _functions(alone)
    (_, asks_fn), = _functions(asks)
    assert _replaces_state(alone_fn) == ["ring.restore()"]
    assert not _asks_planner(alone_fn, _planner_names(alone))
    assert _asks_planner(asks_fn, _planner_names(asks))
    carrier = ast.parse("def carry(plan: RestorePlan, state):\n    state.load_state_dict({})\n")
    (_, carrier_fn), = _functions(carrier)
    assert _takes_plan(carrier_fn) and _replaces_state(carrier_fn) == ["load_state_dict()"]
