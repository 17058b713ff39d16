"""Persistent checkpoints: atomic, checksummed, discoverable; replicated (DDP) or sharded (DCP).

The storage layer only: the job loop decides when to save (periodic, dying
gasp) and what to restore; it calls this API. See DESIGN.md §4.

- ``save_replicated`` / ``load_replicated``: one rank writes the whole state.
- ``save_sharded`` / ``load_sharded``: every rank writes its shard through
  torch.distributed.checkpoint; a save on N ranks loads on M.
- ``AsyncCheckpointer``: blocks only for the CPU copy, writes in a thread.
- ``latest_valid``, ``verify``, ``scan``, ``prune``: discovery and retention.
- ``measure``, ``recent_dying_gasp``: sizing and reusing a dying gasp.
- ``check_writable``, ``check_compatible``, ``check_same_job``: refuse a bad
  location or a checkpoint of another job or model up front, by name.
- ``plan_restore``, ``plan_for_ddp``: where every rank's state comes from
  after a fault (self, a peer, a ring replica, or the checkpoint).

Names are imported on first use (PEP 562): reading a manifest or checking a
MAC (the command-line tools) must not import torch with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from undying.checkpoint.checks import (
        CheckpointLocationError,
        CheckpointOfAnotherJobError,
        IncompatibleCheckpointError,
        check_compatible,
        check_same_job,
        check_writable,
        tensor_shapes,
        tensor_specs,
    )
    from undying.checkpoint.gasp import (
        Measurement,
        measure,
        measure_write_speed,
        recent_dying_gasp,
        state_nbytes,
    )
    from undying.checkpoint.manifest import (
        KINDS,
        MANIFEST_NAME,
        SCHEMA_VERSION,
        FileEntry,
        Manifest,
        ManifestError,
        parse_step_dirname,
        step_dirname,
    )
    from undying.checkpoint.planner import (
        Layout,
        LayoutError,
        MissingShardsError,
        PersistedState,
        RestorePlan,
        Shard,
        Source,
        plan_for_ddp,
        plan_restore,
    )
    from undying.checkpoint.sharded import latest_valid_shared, load_sharded, save_sharded
    from undying.checkpoint.store import (
        Checkpoint,
        CheckpointError,
        CheckpointExistsError,
        Latest,
        PendingCheckpoint,
        Store,
        latest_valid,
        prune,
        scan,
        verify,
    )
    from undying.checkpoint.writer import (
        AsyncCheckpointer,
        CheckpointWriteError,
        SaveResult,
        SaveTicket,
        cpu_copy,
        load_replicated,
        save_replicated,
    )

__all__ = [
    "AsyncCheckpointer",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLocationError",
    "CheckpointOfAnotherJobError",
    "CheckpointWriteError",
    "FileEntry",
    "IncompatibleCheckpointError",
    "KINDS",
    "Latest",
    "Layout",
    "LayoutError",
    "MANIFEST_NAME",
    "Manifest",
    "ManifestError",
    "Measurement",
    "MissingShardsError",
    "PendingCheckpoint",
    "PersistedState",
    "RestorePlan",
    "SCHEMA_VERSION",
    "SaveResult",
    "SaveTicket",
    "Shard",
    "Source",
    "Store",
    "check_compatible",
    "check_same_job",
    "check_writable",
    "cpu_copy",
    "latest_valid",
    "latest_valid_shared",
    "load_replicated",
    "load_sharded",
    "measure",
    "measure_write_speed",
    "parse_step_dirname",
    "plan_for_ddp",
    "plan_restore",
    "prune",
    "recent_dying_gasp",
    "save_replicated",
    "save_sharded",
    "scan",
    "state_nbytes",
    "step_dirname",
    "tensor_shapes",
    "tensor_specs",
    "verify",
]

_WHERE = {
    "CheckpointLocationError": "checks",
    "CheckpointOfAnotherJobError": "checks",
    "IncompatibleCheckpointError": "checks",
    "check_compatible": "checks",
    "check_same_job": "checks",
    "check_writable": "checks",
    "tensor_shapes": "checks",
    "tensor_specs": "checks",
    "Measurement": "gasp",
    "measure": "gasp",
    "measure_write_speed": "gasp",
    "recent_dying_gasp": "gasp",
    "state_nbytes": "gasp",
    "KINDS": "manifest",
    "MANIFEST_NAME": "manifest",
    "SCHEMA_VERSION": "manifest",
    "FileEntry": "manifest",
    "Manifest": "manifest",
    "ManifestError": "manifest",
    "parse_step_dirname": "manifest",
    "step_dirname": "manifest",
    "Layout": "planner",
    "LayoutError": "planner",
    "MissingShardsError": "planner",
    "PersistedState": "planner",
    "RestorePlan": "planner",
    "Shard": "planner",
    "Source": "planner",
    "plan_for_ddp": "planner",
    "plan_restore": "planner",
    "latest_valid_shared": "sharded",
    "load_sharded": "sharded",
    "save_sharded": "sharded",
    "Checkpoint": "store",
    "CheckpointError": "store",
    "CheckpointExistsError": "store",
    "Latest": "store",
    "PendingCheckpoint": "store",
    "Store": "store",
    "latest_valid": "store",
    "prune": "store",
    "scan": "store",
    "verify": "store",
    "AsyncCheckpointer": "writer",
    "CheckpointWriteError": "writer",
    "SaveResult": "writer",
    "SaveTicket": "writer",
    "cpu_copy": "writer",
    "load_replicated": "writer",
    "save_replicated": "writer",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"undying.checkpoint.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'undying.checkpoint' has no attribute {name!r}")
