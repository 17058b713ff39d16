"""Checks of what a user types: job ids and numbers, one rule each, used by the CLI and the config.

A job id names a folder (``./undying-jobs/<id>``), a trace folder, checkpoint
manifests, HTTP headers (``X-Undying-Job``) and Kubernetes objects. So it is
held to a small alphabet that is safe in all of them: ASCII letters, digits,
``.``, ``_`` and ``-``, 1 to 64 characters, not starting with ``.`` (no hidden
folder, no ``..``) nor ``-`` (no id read as an option). ``str.isalnum`` is not
that check: it accepts any Unicode letter, and a non-ASCII id broke every
command on its job (a header must be Latin-1).

A number option is a finite float: ``float("nan")`` and ``float("inf")`` parse,
and then pass every ``x < 0`` check, so they are refused here by name.

Both raise ``UsageError``, which the CLI prints as one line and exits 2; as an
argparse ``type=`` they run while the arguments are parsed, before anything
is created.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from undying.errors import UsageError

__all__ = ["JOB_ID_RULE", "JOB_ID_MAX", "is_job_id", "check_job_id", "job_id_arg", "finite_arg", "check_finite"]

JOB_ID_MAX = 64
JOB_ID_RULE = (f"1 to {JOB_ID_MAX} ASCII letters, digits, '.', '_' or '-', not starting with '.' or '-' "
               "(e.g. my-job-1)")
_JOB_ID = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{JOB_ID_MAX - 1}}}")


def _shown(value: str) -> str:
    """``value`` as the error line shows it: ASCII only, escapes visible, never longer than 80."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_job_id(value: object) -> bool:
    """Whether ``value`` is a job id of the safe alphabet."""
    return isinstance(value, str) and _JOB_ID.fullmatch(value) is not None


def check_job_id(value: str, what: str = "--job-id") -> str:
    """``value`` when it is a safe job id (see the module's rule), else ``UsageError`` naming ``what``."""
    if not isinstance(value, str) or _JOB_ID.fullmatch(value) is None:
        shown = _shown(value) if isinstance(value, str) else type(value).__name__
        raise UsageError(f"{what} {shown} is not a valid job id: use {JOB_ID_RULE}")
    return value


def job_id_arg(value: str) -> str:
    """argparse ``type=`` for ``--job-id``."""
    return check_job_id(value)


def check_finite(option: str, value: float) -> float:
    """``value`` when it is a finite number, else ``UsageError`` naming ``option``."""
    if not math.isfinite(value):
        raise UsageError(f"{option} must be a finite number, got {value}")
    return value


def finite_arg(option: str) -> Callable[[str], float]:
    """argparse ``type=`` for the float option ``option``: a finite number, or one line naming it."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{option} expects a number, got {_shown(text)}") from None
        return check_finite(option, value)

    parse.__name__ = "number"  # argparse names the type in some messages
    return parse
