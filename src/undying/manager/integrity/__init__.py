"""Numbers that are wrong: each becomes an incident, never assumed away.

``numerics`` (a worker's numeric-fault verdict, and the nan and bitflip drills); ``verification``
(``--verify-every``: a step that differed from its replay, an ``sdc`` incident); ``divergence`` (a
re-run step's batch, or a state from a peer, that is not the one it replaces).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.integrity.divergence import Divergence
    from undying.manager.integrity.numerics import NUMERIC_PHASE, arm_numeric, on_numeric_fault
    from undying.manager.integrity.verification import (
        SDC_PHASE,
        VERIFIED_PHASE,
        on_sdc,
        on_verified,
    )

__all__ = [
    "NUMERIC_PHASE",
    "arm_numeric",
    "on_numeric_fault",
    "SDC_PHASE",
    "VERIFIED_PHASE",
    "on_sdc",
    "on_verified",
    "Divergence",
]

_WHERE = {
    "NUMERIC_PHASE": "numerics",
    "arm_numeric": "numerics",
    "on_numeric_fault": "numerics",
    "SDC_PHASE": "verification",
    "VERIFIED_PHASE": "verification",
    "on_sdc": "verification",
    "on_verified": "verification",
    "Divergence": "divergence",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
