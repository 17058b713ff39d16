"""What the manager shows: the status every reader reads, the run's history, the Prometheus metrics.

``status`` (``job_status``: one JSON object for the API, the page, the CLI and the metrics);
``history`` (``RunHistory``: the whole run in bounded memory, the page's charts and the metrics'
histograms); ``metrics`` (the exposition, read from the status on every scrape).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.views.history import RunHistory
    from undying.manager.views.metrics import CONTENT_TYPE, exposition, new_registry
    from undying.manager.views.status import job_status

__all__ = ["job_status", "RunHistory", "CONTENT_TYPE", "exposition", "new_registry"]

_WHERE = {
    "job_status": "status",
    "RunHistory": "history",
    "CONTENT_TYPE": "metrics",
    "exposition": "metrics",
    "new_registry": "metrics",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
