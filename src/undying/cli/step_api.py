"""Whether a script uses undying's step API: it decides how a fault is recovered, and the banner
says which.

A script that imports ``undying`` (anywhere in its file) is taken to use the
step API: a dead rank is replaced and its state comes from a peer. One that
does not (a torchrun script run unchanged, a module that does not, a program
under --no-python) gets torchrun's recovery: the whole group restarts, with no
init or step timeout (the script never speaks to undying). A script that does
not import undying but calls it through a module of its own is seen as it
runs: its first rank to say hello turns the job to the step API's recovery.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

from undying.errors import UsageError
from undying.user_files import open_user_file

__all__ = ["uses_step_api"]


def _imports_undying(path: Path) -> bool:
    try:  # (opened as every file the user names is: a FIFO or a folder is refused, never waited on)
        with os.fdopen(open_user_file(path, "training script", ""), "rb") as f:
            tree = ast.parse(f.read(), str(path))
    except (OSError, SyntaxError, ValueError, UsageError):
        # (cannot tell: as before, the step API's recovery; the script's own error speaks)
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "undying"
                                                for a in node.names):
            return True
        if (isinstance(node, ast.ImportFrom) and node.level == 0
                and (node.module or "").split(".")[0] == "undying"):
            return True
    return False


def uses_step_api(script: str, *, module: bool = False, no_python: bool = False) -> bool:
    """Whether ``script`` (a path, or with ``module`` a module name) imports undying."""
    if no_python:
        return False
    if not module:
        return _imports_undying(Path(script))
    sys.path.insert(0, os.getcwd())  # (where `python -m` looks first)
    try:
        spec = importlib.util.find_spec(script)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.pop(0)
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return True
    if spec.submodule_search_locations:  # a package: `python -m pkg` runs pkg/__main__.py
        main = Path(spec.origin).parent / "__main__.py"
        return _imports_undying(main) if main.is_file() else True
    return _imports_undying(Path(spec.origin))
