"""Loading state without running code: ``torch.load(weights_only=True)`` everywhere, and saying why
not.

A pickle can name any function to call when it is loaded, so state read from
disk (checkpoints, dying gasps) or the network (a peer's state, a replica's
shard) is loaded with ``weights_only=True``: tensors, numbers, strings and
containers, plus the few globals torch allows or a user registered with
``torch.serialization.add_safe_globals``. Nothing else is ever unpickled.

A user's state that cannot be loaded that way must fail early and by name,
not at the first recovery: ``check_state_loadable`` round-trips a skeleton of
the state (every tensor replaced by an empty one, so it costs next to nothing)
through ``weights_only=True`` at the job's first committed step, and names the
object that would be refused.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from undying.errors import RecoveryError, UsageError

__all__ = ["load_state_bytes", "check_state_loadable", "refused_global"]

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_PLAIN = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


def refused_global(error: BaseException) -> str:
    """The ``module.name`` a weights_only load refused, from torch's message ("" when it names
    none)."""
    m = _GLOBAL.search(str(error))
    return m.group(1) if m else ""


def load_state_bytes(raw: bytes, *, source: str) -> Any:
    """A state payload that arrived from ``source`` (a peer rank, a replica), loaded without running
    code."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except pickle.UnpicklingError as e:
        name = refused_global(e) or "an object that is not plain data"
        raise RecoveryError(
            f"the state from {source} holds {name}, which undying refuses to unpickle "
            "(weights_only=True: nothing received may run code); the sending process is not "
            "this job's or its state changed type"
        ) from e


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor replaced by an empty one of its dtype: what weights_only judges,
    minus the bytes."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype)
    if type(obj) in (dict, OrderedDict):  # a subclass is kept whole: it is what weights_only judges
        return type(obj)((k, _skeleton(v)) for k, v in obj.items())
    if type(obj) is list:
        return [_skeleton(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_skeleton(v) for v in obj)
    return obj


def _objects(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _objects(v, f"{path}/{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _objects(v, f"{path}/{i}")


def _culprit(state: Any, refused: str) -> tuple[str, str]:
    """(path, type name) of the object that weights_only refused, best effort."""
    for path, value in _objects(state, ""):
        kind = type(value)
        qualified = f"{kind.__module__}.{kind.__qualname__}"
        if refused and (qualified == refused or refused.endswith(f".{kind.__qualname__}")):
            return path.lstrip("/") or "(the state itself)", qualified
    for path, value in _objects(state, ""):
        if not isinstance(value, _PLAIN | dict | list | tuple | torch.Tensor):
            kind = type(value)
            return (path.lstrip("/") or "(the state itself)",
                    f"{kind.__module__}.{kind.__qualname__}")
    return "(somewhere in the state)", refused or "an object that is not plain data"


def check_state_loadable(state: Any, *, what: str = "the training state") -> None:
    """Raise UsageError naming the object of ``state`` that a ``weights_only=True`` load would
    refuse."""
    skeleton = _skeleton(state)
    buffer = io.BytesIO()
    try:
        torch.save(skeleton, buffer)
    except Exception as e:  # a lambda, a lock, an open file: it cannot even be saved
        raise UsageError(f"{what} cannot be saved: {e}; make every state_dict() return plain data "
                         "(tensors, numbers, strings, lists, dicts)") from e
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as e:
        path, kind = _culprit(skeleton, refused_global(e))
        raise UsageError(
            f"{what} cannot be checkpointed or sent to a peer safely: {path} is a {kind}, which "
            "undying will not unpickle (state is loaded with weights_only=True, so a checkpoint "
            "or a peer cannot run code). Make that state_dict() return plain data (tensors, "
            "numbers, strings, lists, dicts), or, if the class is yours and safe to rebuild, call "
            f"torch.serialization.add_safe_globals([{kind}]) in the script before undying.init()"
        ) from e
