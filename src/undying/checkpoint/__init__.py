"""Persistent checkpoints: atomic, checksummed, discoverable; replicated (DDP) or sharded (DCP).

The storage layer only: the job loop decides when to save (periodic, dying
gasp) and what to restore; it calls this API (docs/architecture.md).

The package's own names are the ones a saver or a loader needs:

- ``save_replicated`` / ``load_replicated``: one rank writes the whole state.
- ``save_sharded`` / ``load_sharded`` / ``latest_valid_shared``: every rank
  writes its shard through torch.distributed.checkpoint; a save on N ranks
  loads on M.
- ``AsyncCheckpointer``: blocks only for the CPU copy, writes in a thread.
- ``latest_valid``, ``verify``, ``scan``: discovery; ``Store``, ``Checkpoint``,
  ``Manifest``, ``SaveResult`` and the errors they come with.

The rest is imported from the module that owns it, one concern each:
``store`` (local folder or fsspec URL), ``commit`` (the atomic commit),
``discovery`` (what can be trusted, retention), ``manifest`` (the format),
``replicated`` and ``sharded`` (the two formats), ``writer`` (the async
writer), ``room`` (a full disk), ``checks`` (refusing a bad location or
another job's or model's checkpoint up front), ``gasp`` (sizing a dying gasp),
``mac`` (signing), ``safe_load`` (unpickling state from a peer),
``lock`` (one owner per checkpoint dir and job dir), ``aside`` (rejected
checkpoints moved out of the way, whole) and ``planner`` (where every rank's
state comes from, on every path that replaces it: recovery, start, roll-backs, regroup).

Names are imported on first use (PEP 562): reading a manifest or checking a
MAC (the command-line tools) must not import torch with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.checkpoint.commit import SaveResult
    from undying.checkpoint.discovery import Checkpoint, latest_valid, scan, verify
    from undying.checkpoint.manifest import Manifest
    from undying.checkpoint.replicated import load_replicated, save_replicated
    from undying.checkpoint.sharded import latest_valid_shared, load_sharded, save_sharded
    from undying.checkpoint.store import CheckpointError, Store
    from undying.checkpoint.writer import AsyncCheckpointer, CheckpointWriteError

__all__ = [
    "AsyncCheckpointer",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWriteError",
    "Manifest",
    "SaveResult",
    "Store",
    "latest_valid",
    "latest_valid_shared",
    "load_replicated",
    "load_sharded",
    "save_replicated",
    "save_sharded",
    "scan",
    "verify",
]

_WHERE = {
    "AsyncCheckpointer": "writer",
    "Checkpoint": "discovery",
    "CheckpointError": "store",
    "CheckpointWriteError": "writer",
    "Manifest": "manifest",
    "SaveResult": "commit",
    "Store": "store",
    "latest_valid": "discovery",
    "latest_valid_shared": "sharded",
    "load_replicated": "replicated",
    "load_sharded": "sharded",
    "save_replicated": "replicated",
    "save_sharded": "sharded",
    "scan": "discovery",
    "verify": "discovery",
}

def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"undying.checkpoint.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'undying.checkpoint' has no attribute {name!r}")
