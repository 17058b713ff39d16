"""Sharded state (FSDP2 ``fully_shard``, DTensor parameters): what each rank holds, and keeping
it usable.

Under DDP every rank holds the whole state, so any survivor can hand it to a
replacement. A sharded model's rank holds only its slices (the local tensors
of its DTensors), so this module gives the two views undying needs of such a
state:

- the **shard** view, ``shard_bytes`` / ``load_shard_bytes``: this rank's own
  slices serialized, bit for bit, for the in-memory snapshot and the ring
  replica (``worker.replica``); loading puts them back into the live DTensors
  of a model laid out the same way (same world size, same mesh);
- the **checkpoint** view, ``dcp_state_dict`` / ``load_dcp_state_dict``:
  the state keyed by parameter name (optimizer state too), which is what
  torch.distributed.checkpoint needs to reshard a save of N ranks onto M.

And two repairs a recovery needs, because FSDP2 binds to the process group of
the generation it was built in and keeps per-iteration state:
``reset_after_failure`` (a step that failed mid-forward or mid-backward left
parameters unsharded and hooks half-run) and ``rebind_groups`` (after a new
generation, point FSDP at the new default group).
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from undying.checkpoint.safe_load import load_state_bytes
from undying.errors import RecoveryError, UsageError
from undying.worker.dtensor import is_dtensor

if TYPE_CHECKING:
    from undying.worker.state import State

__all__ = [
    "shard_bytes",
    "load_shard_bytes",
    "dcp_state_dict",
    "load_dcp_state_dict",
    "full_digest",
    "reset_after_failure",
    "rebind_groups",
]

log = logging.getLogger("undying.worker")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _locals(obj: Any) -> Any:
    """The same structure with every DTensor replaced by this rank's local tensor (no copy)."""
    if isinstance(obj, torch.Tensor):
        return _local(obj).detach()
    if isinstance(obj, dict):
        return {k: _locals(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_locals(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_locals(v) for v in obj)
    return obj


def _extras_state(state: State) -> dict[str, Any]:
    return {name: value.state_dict() if hasattr(value, "state_dict") else dict(value)
            for name, value in state.extras.items()}


def shard_bytes(state: State, extra: dict[str, Any] | None = None) -> bytes:
    """This rank's part of the state, serialized: model and optimizer as local tensors, the rest
    whole.

    Serializing is the copy: the bytes do not change when training mutates the
    live tensors afterwards. ``extra`` travels beside the state (the job's
    data origin, for a replacement that gets its shard from a replica).
    """
    payload = {
        "model": _locals(state.model.state_dict()) if state.model is not None else None,
        "optimizer": _locals(state.optimizer.state_dict()) if state.optimizer is not None else None,
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
        "extras": _extras_state(state),
        "_undying": dict(extra or {}),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def load_shard_bytes(state: State, data: bytes) -> dict[str, Any]:
    """Put a ``shard_bytes`` payload back into the live state, in place; returns its ``extra``.

    The model's local tensors are copied into the live DTensors' local
    tensors (so parameters keep their identity and the optimizer stays bound
    to them). Optimizer state is rebuilt as DTensors laid out like the
    parameter it belongs to, then loaded the optimizer's own way.
    """
    payload = load_state_bytes(data, source="a replica")
    if state.model is not None:
        live = state.model.state_dict()
        saved = payload["model"]
        missing = sorted(set(live) - set(saved))
        if missing:
            raise RecoveryError(f"the shard received lacks model entries {missing[:5]}; was it "
                                "saved by another model?")
        with torch.no_grad():
            for name, tensor in live.items():
                target = _local(tensor)
                source = saved[name]
                if tuple(source.shape) != tuple(target.shape):
                    raise RecoveryError(
                        f"the shard received has {name} of local shape {list(source.shape)}, this "
                        f"rank holds {list(target.shape)}: shards move only between jobs of the "
                        "same world size and mesh"
                    )
                target.copy_(source)
    if state.optimizer is not None:
        state.optimizer.load_state_dict(_as_dtensors(state.optimizer, payload["optimizer"]))
    if state.scheduler is not None:
        state.scheduler.load_state_dict(payload["scheduler"])
    _load_extras(state, payload["extras"])
    return dict(payload.get("_undying") or {})


def _as_dtensors(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state whose local tensors become DTensors shaped like their parameter's shard."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, Any] = {}
    for index, entries in saved["state"].items():
        param = params[index]
        if not is_dtensor(param):
            state[index] = entries
            continue
        local_shape = tuple(param.to_local().shape)
        rebuilt: dict[str, Any] = {}
        for key, value in entries.items():
            if (isinstance(value, torch.Tensor) and value.dim() > 0
                    and tuple(value.shape) == local_shape):
                from torch.distributed.tensor import DTensor

                rebuilt[key] = DTensor.from_local(value, param.device_mesh, param.placements,
                                                  run_check=False, shape=param.shape,
                                                  stride=param.stride())
            else:
                # a scalar (Adam's step), or state not laid out like the parameter
                rebuilt[key] = value
        state[index] = rebuilt
    return {"state": state, "param_groups": saved["param_groups"]}


def _load_extras(state: State, saved: dict[str, Any]) -> None:
    for name, value in state.extras.items():
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(saved[name])
        else:
            value.clear()
            value.update(saved[name])


def dcp_state_dict(state: State) -> dict[str, Any]:
    """The state keyed by parameter name, for torch.distributed.checkpoint (no collective).

    Optimizer state keyed by name instead of by position is what lets DCP map
    it onto another world size. A fresh optimizer has no state yet; torch's
    ``get_optimizer_state_dict`` creates it by an optimizer step with zero
    gradients and zero learning rate (the values are then overwritten by a
    load, or are the real ones after the first step).
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    sd: dict[str, Any] = {}
    if state.model is not None:
        sd["model"] = get_model_state_dict(state.model)
        if state.optimizer is not None:
            sd["optimizer"] = get_optimizer_state_dict(state.model, state.optimizer)
    elif state.optimizer is not None:
        raise UsageError("sharded state needs State(model=...) beside the optimizer: its state "
                         "is keyed by the model's parameter names")
    if state.scheduler is not None:
        sd["scheduler"] = state.scheduler.state_dict()
    if state.extras:
        sd["extras"] = _extras_state(state)
    return sd


def load_dcp_state_dict(state: State, sd: dict[str, Any]) -> None:
    """After ``load_sharded`` filled ``sd`` (a ``dcp_state_dict`` of this state): apply it."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if state.model is not None:
        set_model_state_dict(state.model, sd["model"])
        if state.optimizer is not None:
            set_optimizer_state_dict(state.model, state.optimizer, sd["optimizer"])
    if state.scheduler is not None:
        state.scheduler.load_state_dict(sd["scheduler"])
    if state.extras:
        _load_extras(state, sd["extras"])


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _walk(obj[key], f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{prefix}/{i}" if prefix else str(i))


def full_digest(obj: Any) -> str:
    """A fingerprint of every tensor of a (nested) state dict, whole: equal across world sizes
    iff bit-equal.

    A DTensor is gathered to its full value first (a collective: every rank
    calls this at the same point, and each gets the same digest), one tensor
    at a time, so memory grows by the largest tensor, not the model.
    """
    h = hashlib.sha256()
    for name, tensor in _walk(obj, ""):
        full = tensor.full_tensor() if is_dtensor(tensor) else tensor
        full = full.detach().cpu().contiguous()
        h.update(f"{name}:{str(full.dtype).removeprefix('torch.')}:{list(full.shape)}".encode())
        h.update(full.reshape(-1).view(torch.uint8).numpy().tobytes() if full.numel() else b"")
    return h.hexdigest()


def _fsdp_states(model: torch.nn.Module) -> Iterator[Any]:
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is not None:
            yield module, get_state()


def reset_after_failure(model: torch.nn.Module | None) -> None:
    """Undo a step that failed inside FSDP's forward or backward: reshard, clear per-iteration
    state.

    Torch's own ``reset_iter_state`` (2.13+) on every root FSDP module; the
    failed step's gradients are dropped anyway. Without it, a recovery of an
    FSDP model is refused by name rather than run on a torn module.
    """
    if model is None:
        return
    for module, fsdp_state in _fsdp_states(model):
        if getattr(fsdp_state, "_is_root", None) is not True:
            continue  # not a root, or never ran a forward: nothing to reset
        reset = getattr(module, "reset_iter_state", None)
        if reset is None:
            raise RecoveryError(
                "this torch has no FSDPModule.reset_iter_state (added in torch 2.13); an FSDP "
                "step that failed midway cannot be undone in place: upgrade torch, or rely on "
                "checkpoints"
            )
        reset()


def rebind_groups(model: torch.nn.Module | None) -> int:
    """Point FSDP's cached process groups at this generation's; returns how many were rebound.

    FSDP2 asks its DeviceMesh for the group once, when it is built, and keeps
    the object. The mesh itself resolves its group by name on every call, and
    undying rebuilds the default group under the same name each generation,
    so asking the mesh again gives the live group. A mesh whose groups were
    sub-groups (HSDP, FSDP with tensor parallel) lost them with the old
    generation: that is refused by name.
    """
    if model is None:
        return 0
    rebound = 0
    for _, fsdp_state in _fsdp_states(model):
        for group in getattr(fsdp_state, "_fsdp_param_groups", []):
            infos = {id(group.mesh_info): group.mesh_info}
            post = getattr(group, "post_forward_mesh_info", None)
            if post is not None:
                infos[id(post)] = post
            for param in group.fsdp_params:
                for attr in ("mesh_info", "post_forward_mesh_info"):
                    info = getattr(param, attr, None)
                    if info is not None:
                        infos[id(info)] = info
            for info in infos.values():
                rebound += _rebind(info)
    return rebound


def _rebind(info: Any) -> int:
    count = 0
    for group_attr, dim_attr in (("shard_process_group", "shard_mesh_dim"),
                                 ("replicate_process_group", "replicate_mesh_dim")):
        if not hasattr(info, group_attr) or getattr(info, dim_attr, None) is None:
            continue
        try:
            group = info.mesh.get_group(getattr(info, dim_attr))
        except Exception as e:
            raise RecoveryError(
                f"the FSDP mesh's {group_attr.removesuffix('_process_group')} group did not "
                f"survive the new process-group generation ({type(e).__name__}: {e}); undying "
                "rebuilds FSDP in place only on a 1-D mesh over every rank "
                "(init_device_mesh(device, (world_size,)))"
            ) from e
        built_for = getattr(info, group_attr.replace("process_group", "mesh_size"), group.size())
        if group.size() != built_for:
            raise RecoveryError(f"the FSDP mesh's group now has {group.size()} ranks; it was built "
                                "for another size")
        setattr(info, group_attr, group)
        count += 1
    if getattr(info, "reduce_scatter_process_group", None) is not None:
        # a separate group of the old generation: fall back to the shard group
        info.reduce_scatter_process_group = None
    return count
