"""The job's checkpoints as the manager sees them: the folder it owns, and saves that fail.

``folder`` (``Checkpoints``: the checkpoint dir's lock, where to resume, what was saved and how
fast); ``health`` (failed saves as incidents until the next save, and the words a resume's re-run
is told in).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.checkpoints.folder import Checkpoints
    from undying.manager.checkpoints.health import CheckpointHealth, resume_line

__all__ = ["Checkpoints", "CheckpointHealth", "resume_line"]

_WHERE = {
    "Checkpoints": "folder",
    "CheckpointHealth": "health",
    "resume_line": "health",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
