"""Rejected checkpoints set aside: moved whole out of the job's way, and never touched again.

A job must never overwrite nor prune a checkpoint its own key did not sign
(another job's, a stranger's, one altered since): ``--start-fresh`` once wrote
its new steps over the rejected ones and pruned the rest. What a job cannot
use but must not destroy goes to ``<root>/rejected/<time>/step-*``: out of
discovery (it lists ``step-*`` directly under the root only) and of retention
(which only deletes ``step-*`` and ``.tmp-step-*`` there), still a checkpoint
folder that ``undying checkpoints list <root>/rejected/<time>`` reads, and
moved back with one ``mv``. Locally a move is a rename; on an object store,
a copy then a delete of the original (fsspec's ``mv``).
"""

from __future__ import annotations

import logging
import secrets
import time

from undying.checkpoint.store import Store

__all__ = ["REJECTED_DIR", "batch_name", "set_aside", "batches"]

log = logging.getLogger("undying.checkpoint")

REJECTED_DIR = "rejected"


def batch_name(now: float | None = None) -> str:
    """A new folder name under ``rejected/``: the UTC time, and a suffix that keeps two batches
    apart."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(2)}"


def set_aside(store: Store, name: str, reason: str, *, batch: str | None = None) -> str:
    """Move the checkpoint folder ``name`` to ``rejected/<batch>/name``; its new URL. Raises
    OSError."""
    batch = batch or batch_name()
    folder = store.join(REJECTED_DIR, batch)
    store.makedirs(folder)
    source, target = store.join(name), store.join(REJECTED_DIR, batch, name)
    if store.local:
        store.rename(source, target)
    else:
        store.fs.mv(source, target, recursive=True)
    url = store.url_of(target)
    log.warning("checkpoint %s set aside as %s (%s): kept whole, never touched again",
                store.url_of(source), url, reason)
    return url


def batches(store: Store) -> list[tuple[str, int]]:
    """Each ``rejected/<batch>`` folder under the root (its URL) and how many checkpoint folders it
    holds."""
    if not store.isdir(store.join(REJECTED_DIR)):
        return []
    out = []
    for batch in Store.open(store.url_of(store.join(REJECTED_DIR))).names():
        inner = Store.open(store.url_of(store.join(REJECTED_DIR, batch)))
        held = sum(1 for n in inner.names() if n.startswith("step-"))
        out.append((inner.url_of(inner.root), held))
    return out
