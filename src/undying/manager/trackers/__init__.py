"""The experiment trackers (``--trackers tensorboard,wandb,mlflow``): each committed step's
``step.log`` values, sent once per tracker, from the manager.

``feed`` (``Trackers``: a bounded thread per tracker, a tracker that fails or hangs dropped and
reported once), ``cursor`` (the last step each tracker took, durable in the job dir), ``sinks``
(the three libraries behind one interface, each imported only when asked for; ``missing_library``
says what to install).

Names are imported on first use (PEP 562): importing one module of this package must not pay for
the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.trackers.cursor import CURSOR_FILE, Cursor
    from undying.manager.trackers.feed import Trackers
    from undying.manager.trackers.sinks import TRACKERS, missing_library

__all__ = ["Trackers", "Cursor", "CURSOR_FILE", "TRACKERS", "missing_library"]

_WHERE = {
    "Trackers": "feed",
    "Cursor": "cursor",
    "CURSOR_FILE": "cursor",
    "TRACKERS": "sinks",
    "missing_library": "sinks",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
