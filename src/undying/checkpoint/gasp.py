"""Helpers for the dying gasp: how long a checkpoint takes, and whether a recent one can be reused.

Kubernetes sends SIGKILL ``terminationGracePeriodSeconds`` after SIGTERM, so the
grace period must be sized from the state: bytes over observed write speed,
with a margin. ``measure`` gives both numbers from the last real save when
there is one (the truest figure), else from a short probe write on the root.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from undying.checkpoint.discovery import Checkpoint, inspect
from undying.checkpoint.manifest import parse_step_dirname
from undying.checkpoint.store import TMP_PREFIX, Store

if TYPE_CHECKING:
    from undying.checkpoint.writer import SaveResult  # its writer imports torch

__all__ = ["Measurement", "state_nbytes", "measure_write_speed", "measure", "recent_dying_gasp"]


def state_nbytes(obj: Any) -> int:
    """Bytes of tensor data in a state dict (what dominates the checkpoint's size)."""
    import torch  # here, not at the top: sizing a grace period from a job dir needs no torch

    seen: set[int] = set()
    total = 0

    def walk(o: Any) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v)

    walk(obj)
    return total


@dataclass(frozen=True)
class Measurement:
    """A checkpoint's size and the speed it can be written at; ``source`` says where the speed came
    from."""

    bytes: int
    write_bytes_per_s: float
    source: str

    @property
    def write_s(self) -> float:
        return self.bytes / self.write_bytes_per_s if self.write_bytes_per_s > 0 else float("inf")

    def grace_period_s(self, margin: float = 2.0, minimum_s: float = 5.0) -> float:
        """Seconds to allow for a dying gasp: write time times ``margin``, never under
        ``minimum_s``."""
        return max(minimum_s, self.write_s * margin)


def measure_write_speed(root: str | os.PathLike[str] | Store, nbytes: int = 8 << 20) -> float:
    """Bytes per second of writing (and fsyncing) ``nbytes`` under ``root``; the probe file is
    removed."""
    store = root if isinstance(root, Store) else Store.open(root)
    store.makedirs(store.root)
    path = store.join(f"{TMP_PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}")
    block = os.urandom(min(nbytes, 1 << 20))
    written = 0
    t0 = time.perf_counter()
    try:
        with store.open_write(path) as f:
            while written < nbytes:
                chunk = block[: nbytes - written]
                f.write(chunk)
                written += len(chunk)
        elapsed = time.perf_counter() - t0
    finally:
        store.remove(path)
    return written / elapsed if elapsed > 0 else float("inf")


def measure(
    state_dict: Any = None,
    root: str | os.PathLike[str] | Store | None = None,
    *,
    nbytes: int | None = None,
    last: SaveResult | None = None,
    probe_bytes: int = 8 << 20,
) -> Measurement:
    """Size (``nbytes``, or the state's tensor bytes, or the last save's) and write speed.

    Speed comes from ``last`` (a real save of this state) when given, otherwise
    from a probe write under ``root``.
    """
    if nbytes is None:
        if state_dict is not None:
            nbytes = state_nbytes(state_dict)
        elif last is not None:
            nbytes = last.bytes
        else:
            raise ValueError("measure needs a state_dict, nbytes or a last SaveResult")
    if last is not None and last.write_s > 0:
        return Measurement(nbytes, last.write_bytes_per_s, f"save of step {last.step}")
    if root is None:
        raise ValueError("measure needs a root to probe, or a last SaveResult")
    return Measurement(nbytes, measure_write_speed(root, probe_bytes),
                       f"probe of {probe_bytes} bytes")


def recent_dying_gasp(
    root: str | os.PathLike[str] | Store,
    *,
    within_s: float,
    step: int | None = None,
    job_id: str | None = None,
    now: float | None = None,
) -> Checkpoint | None:
    """The newest valid dying-gasp checkpoint written in the last ``within_s`` seconds (at ``step``
    if given).

    A second SIGTERM shortly after a first must not write the same state again:
    when this returns a checkpoint, reuse it.
    """
    store = root if isinstance(root, Store) else Store.open(root)
    now = time.time() if now is None else now
    names = [n for n in store.names() if parse_step_dirname(n) is not None]
    names.sort(key=lambda n: parse_step_dirname(n) or 0, reverse=True)
    for name in names:
        if step is not None and parse_step_dirname(name) != step:
            continue
        quick = inspect(store, name, checksums=False)
        m = quick.manifest
        if m is None or quick.problems or m.kind != "dying-gasp" or now - m.created_at > within_s:
            continue
        if job_id is not None and m.job_id != job_id:
            continue
        full = inspect(store, name, checksums=True)
        if full.valid:
            return full
    return None
