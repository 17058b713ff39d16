"""The job's checkpoints as the manager sees them: the folder it owns, and saves that fail.

``folder`` (``Checkpoints``: the checkpoint dir's lock, where to resume, what was saved and how
fast); ``health`` (failed saves as incidents until the next save, and the words a resume's re-run
is told in).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.manager.checkpoints.folder import Checkpoints
    from undying.manager.checkpoints.health import CheckpointHealth, resume_line

__all__ = ["Checkpoints", "CheckpointHealth", "resume_line"]

_WHERE = {
    "Checkpoints": "folder",
    "CheckpointHealth": "health",
    "resume_line": "health",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
