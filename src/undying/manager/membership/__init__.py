"""Who is in the job, and in which process group.

``book`` (``RankBook``: the ranks, their nodes, what each committed); ``generations`` (the numbered
process groups, each with its own store; fencing the superseded one); ``comings`` (``Comings``: the
ranks' and nodes' comings and goings, and the job's end once every rank finished).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.membership.book import RankBook
    from undying.manager.membership.comings import Comings
    from undying.manager.membership.generations import Generations

__all__ = ["RankBook", "Generations", "Comings"]

_WHERE = {
    "RankBook": "book",
    "Generations": "generations",
    "Comings": "comings",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
