"""The job's trace switch, and slow ranks the traces find made incidents.

``control`` (``TraceControl``: one switch every rank follows, the comm switch's agreed step,
findings).

Names are imported on first use (PEP 562): importing one module of this package, a pure decision
above all, must not pay for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import undying.manager

if TYPE_CHECKING:
    from undying.manager.tracing.control import TraceControl

__all__ = ["TraceControl"]

_WHERE = {
    "TraceControl": "control",
}


__getattr__ = undying.manager.lazy_surface(__name__, _WHERE)
