"""Bad input, clear errors: is the checkpoint location usable, and does a checkpoint fit this job.

Both are meant for the edges of a run, where a mistake is cheapest to report:
``check_writable`` when the job starts (before any step is trained, so a typo
in ``--checkpoint-dir`` does not surface as a failed save an hour later), and
``check_compatible`` before a checkpoint is loaded (so a checkpoint of another
job or another model is refused by name, not by a torch error deep in
``load_state_dict``). Each raises one error whose one-line message names the
location or checkpoint, the mismatch, and what to do.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from undying.checkpoint.discovery import Checkpoint
from undying.checkpoint.manifest import Manifest
from undying.checkpoint.store import TMP_PREFIX, CheckpointError, Store
from undying.errors import UsageError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointLocationError",
    "IncompatibleCheckpointError",
    "CheckpointOfAnotherJobError",
    "check_same_job",
    "TensorSpec",
    "tensor_specs",
    "tensor_shapes",
    "check_writable",
    "check_compatible",
]

# {"shape": [8, 4], "dtype": "float32"}: what the manifest records per tensor.
TensorSpec = dict[str, Any]

# "s3:/bucket" or "s3:bucket/x": a URL missing a slash. One-letter schemes are Windows drives.
_HALF_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(/?)(?!/)")
_REMOTE_SCHEMES = frozenset({
    "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "webhdfs", "hf",
    "http", "https", "ftp", "sftp", "ssh", "memory", "file",
})
RESHARDABLE_LAYOUTS = ("replicated", "sharded")


class CheckpointLocationError(CheckpointError, UsageError):
    """The checkpoint folder or URL cannot be used: malformed, unknown storage, or not writable."""


class IncompatibleCheckpointError(CheckpointError, UsageError):
    """A checkpoint that does not belong to this job or does not fit this model."""


class CheckpointOfAnotherJobError(IncompatibleCheckpointError):
    """The newest checkpoint was written by another job than the one the user named with
    --job-id."""


def check_same_job(checkpoint: Checkpoint | Manifest, job_id: str, job_id_given: bool, *,
                   path: str = "") -> str | None:
    """May a job starting as ``job_id`` resume ``checkpoint``? Raise if not; else what to log, if
    anything.

    The rule (one folder, two jobs): a user who named the job (``--job-id``,
    ``job_id_given``) and finds another job's checkpoint in the folder has
    most likely pointed two jobs at one folder, and resuming would silently
    continue the other job's training: refuse, naming both ids and the fix.
    Without ``--job-id`` the id is random per launch, so every relaunch of the
    same command is "another job": the checkpoint is resumed, and the line
    returned ("resuming job A's checkpoint at step S ...") is for the log.

    Returns None when the checkpoint is this job's own, or records no job (a
    manifest written outside a job or before job ids were recorded).
    ``path`` names the checkpoint when only a Manifest is given.
    """
    manifest, where = _manifest_of(checkpoint, path)
    theirs = manifest.job_id
    if not theirs or theirs == job_id:
        return None
    if job_id_given:
        raise CheckpointOfAnotherJobError(
            f"checkpoint {where} (step {manifest.step}) belongs to job {theirs!r}, not to this "
            f"job {job_id!r}; pass --job-id {theirs} to resume it, or another --checkpoint-dir "
            "to start fresh"
        )
    return (f"resuming job {theirs}'s checkpoint at step {manifest.step} ({where}) as job "
            f"{job_id} (no --job-id given)")


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    import torch  # here: the manager checks a checkpoint's job id without torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{prefix}/{i}" if prefix else str(i))


def tensor_specs(state: Any) -> dict[str, TensorSpec]:
    """Every tensor of a (nested) state dict by path (``model/fc.weight``,
    ``optimizer/state/0/exp_avg``).

    Shapes are global: a DTensor reports the whole parameter's shape, so a
    sharded save and a replicated one of the same model record the same specs.
    """
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in _walk(state, "")
    }


def tensor_shapes(state: Any) -> dict[str, tuple[int, ...]]:
    """Path -> shape of every tensor of a live state dict: what ``check_compatible`` compares."""
    return {name: tuple(t.shape) for name, t in _walk(state, "")}


def _known_protocol(name: str) -> bool:
    """A storage scheme people type ("s3:bucket" is then a URL typo, not a folder named
    "s3:bucket")."""
    return name.lower() in _REMOTE_SCHEMES


def _location_error(text: str, problem: str, fix: str) -> CheckpointLocationError:
    return CheckpointLocationError(f"checkpoint location {text}: {problem}; {fix}")


def check_writable(url_or_path: str | os.PathLike[str]) -> Store:
    """The Store for ``url_or_path`` once a probe file was written there (and removed); else raise.

    A missing local folder is created (as the first save would). Raises
    CheckpointLocationError for an empty or malformed location, an unknown or
    uninstalled fsspec protocol, a parent that is a file, a read-only or
    unreachable folder, or missing credentials.
    """
    text = os.fspath(url_or_path).strip()
    if not text:
        raise _location_error("''", "empty", "give a folder or an fsspec URL (s3://bucket/path)")
    if text.startswith("://"):
        raise _location_error(text, "the URL has no protocol",
                              "write it as PROTOCOL://PATH, e.g. s3://bucket/path")
    m = _HALF_URL.match(text) if "://" not in text else None
    if m is not None and (m.group(2) or _known_protocol(m.group(1))):
        raise _location_error(
            text, f"looks like a {m.group(1)}:// URL with a slash missing",
            f"write it as {m.group(1)}://{text[m.end():]}",
        )
    if "://" in text and not text.split("://", 1)[1].strip("/"):
        raise _location_error(text, "the URL names no bucket or path",
                              "add one, e.g. s3://bucket/checkpoints")
    try:
        store = Store.open(text)
    except CheckpointError as e:
        raise _location_error(
            text, str(e).removeprefix(f"checkpoint root {text}: "),
            "use a folder, file://, or an fsspec protocol whose package is installed (s3fs for "
            "s3://, gcsfs for gs://)",
        ) from e
    if store.local:
        _probe_local(text, store.root)
    else:
        _probe_remote(text, store)
    return store


def _probe_local(text: str, root: str) -> None:
    # The nearest existing ancestor says best what is wrong (a file where a folder must be).
    probe = root
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if os.path.exists(probe) and not os.path.isdir(probe):
        where = "is a file" if probe == root else f"is inside {probe}, which is a file"
        raise _location_error(text, f"{where}, not a folder",
                              "give a folder path (it is created if missing)")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise _location_error(text, f"cannot be created ({e.strerror or e})",
                              "pick a folder you can write to") from e
    path = os.path.join(root, f"{TMP_PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        with open(path, "wb") as f:
            f.write(b"undying probe\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _location_error(text, f"is not writable ({e.strerror or e})",
                              "pick a folder you can write to") from e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _probe_remote(text: str, store: Store) -> None:
    path = store.join(f"{TMP_PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        store.makedirs(store.root)
        store.fs.pipe_file(path, b"undying probe\n")
        store.fs.rm(path)
    except Exception as e:  # credentials, network, permissions: every client raises its own kind
        raise _location_error(
            text, f"a probe write failed ({type(e).__name__}: {e})",
            "check the URL, the credentials and that the bucket exists",
        ) from e


def _parent(name: str) -> str:
    return name.rsplit("/", 1)[0] if "/" in name else ""


def check_compatible(
    checkpoint: Checkpoint | Manifest,
    *,
    path: str = "",
    job_id: str | None = None,
    world_size: int | None = None,
    state_shapes: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """Raise IncompatibleCheckpointError unless ``checkpoint`` can be loaded into this job.

    - ``job_id``: the checkpoint's job must be this one (a checkpoint without a
      job id, written outside a job, is accepted).
    - ``world_size``: checked only for layouts that cannot be resharded;
      replicated and DCP-sharded checkpoints load on any world size.
    - ``state_shapes`` (from ``tensor_shapes(live_state)``): every tensor both
      have must have the same shape, and a tensor only one side has is a
      mismatch when the other side has tensors in the same container (a fresh
      optimizer with no per-parameter state yet is not compared against a
      trained one's). Manifests written before undying recorded tensor shapes
      skip this check.

    ``path`` names the checkpoint when only a Manifest is given.
    """
    manifest, where = _manifest_of(checkpoint, path)
    if job_id and manifest.job_id and manifest.job_id != job_id:
        raise IncompatibleCheckpointError(
            f"checkpoint {where} belongs to job {manifest.job_id!r}, not {job_id!r}; point "
            f"--checkpoint-dir at this job's own folder, or run with --job-id {manifest.job_id} "
            "to continue that job"
        )
    kind = manifest.layout.get("kind")
    if (world_size is not None and kind not in RESHARDABLE_LAYOUTS
            and manifest.world_size != world_size):
        raise IncompatibleCheckpointError(
            f"checkpoint {where} was written by {manifest.world_size} ranks with layout {kind!r}, "
            f"which cannot be loaded on {world_size}; run with {manifest.world_size} ranks"
        )
    if state_shapes is None or manifest.tensors is None:
        return
    saved = {name: tuple(spec["shape"]) for name, spec in manifest.tensors.items()}
    live = {name: tuple(shape) for name, shape in state_shapes.items()}
    live_parents = {_parent(n) for n in live}
    saved_parents = {_parent(n) for n in saved}
    problems: list[str] = []
    for name in list(live) + [n for n in saved if n not in live]:
        if name in live and name in saved:
            if live[name] != saved[name]:
                problems.append(f"{name} has shape {list(saved[name])} there, "
                                f"{list(live[name])} here")
        elif name in live:
            if _parent(name) in saved_parents:
                problems.append(f"{name} (shape {list(live[name])}) is not in it")
        elif _parent(name) in live_parents:
            problems.append(f"it has {name} (shape {list(saved[name])}), this model does not")
    if problems:
        n = len(problems) - 1
        more = f" (and {n} more mismatch{'es' if n > 1 else ''})" if n else ""
        raise IncompatibleCheckpointError(
            f"checkpoint {where} does not fit this model: {problems[0]}{more}; "
            "load it into the model it was saved from, or start without it (another "
            "--checkpoint-dir)"
        )


def _manifest_of(checkpoint: Checkpoint | Manifest, path: str) -> tuple[Manifest, str]:
    """A checkpoint's manifest and how to name the checkpoint in an error."""
    if isinstance(checkpoint, Checkpoint):
        if checkpoint.manifest is None:
            raise IncompatibleCheckpointError(
                f"checkpoint {checkpoint.url} has no readable manifest; run "
                "`undying checkpoints verify` on it"
            )
        return checkpoint.manifest, checkpoint.url
    return checkpoint, path or f"of step {checkpoint.step}"
