"""The manifest: what a checkpoint claims to hold, written last as its commit marker.

A checkpoint folder without a manifest that parses is, by definition, not a
checkpoint (the write never finished). The manifest lists every file with its
size and checksum so that a reader can tell a torn or bit-rotted checkpoint
from a good one *before* loading it, and fall back to an older one.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Literal

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "KINDS",
    "CHECKSUMS",
    "Checksum",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "Hasher",
    "step_dirname",
    "parse_step_dirname",
    "checksum_stream",
]

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
# "regroup": the survivors' state, saved as the job moves to another set of nodes (see
# undying.protocol.generations).
KINDS = ("periodic", "dying-gasp", "regroup")
CHECKSUMS = ("crc32", "sha256")
Checksum = Literal["crc32", "sha256"]

_STEP_RE = re.compile(r"^step-(\d{9,})$")
_CHUNK = 4 << 20


class ManifestError(ValueError):
    """A manifest that does not parse or does not make sense; the message names the field."""


def step_dirname(step: int) -> str:
    """``step-000000120``: zero-padded so names sort like steps in any listing (S3 included)."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"step-{step:09d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a ``step-NNNNNNNNN`` folder name, None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


class Hasher:
    """Incremental checksum, so a file can be hashed while it is written (no second read)."""

    def __init__(self, algorithm: Checksum = "crc32") -> None:
        if algorithm not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {CHECKSUMS}, got {algorithm!r}")
        self.algorithm: Checksum = algorithm
        self._crc = 0
        self._sha = hashlib.sha256() if algorithm == "sha256" else None
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)
        self.size += len(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def checksum_stream(stream: IO[bytes], algorithm: Checksum = "crc32") -> tuple[int, str]:
    """(size, hex checksum) of everything left in ``stream``, read in 4 MiB chunks."""
    h = Hasher(algorithm)
    while chunk := stream.read(_CHUNK):
        h.update(chunk)
    return h.size, h.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its path relative to the checkpoint folder, size, checksum."""

    path: str
    size: int
    checksum: str
    algorithm: Checksum = "crc32"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, self.algorithm: self.checksum}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FileEntry:
        if not isinstance(d, Mapping):
            raise ManifestError(f"a files entry must be an object, got {d!r}")
        path, size = d.get("path"), d.get("size")
        if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
            raise ManifestError(f"files entry has a bad path {path!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"file {path} has a bad size {size!r}")
        for algorithm in ("crc32", "sha256"):
            value = d.get(algorithm)
            if isinstance(value, str) and value:
                return cls(path, size, value, "crc32" if algorithm == "crc32" else "sha256")
        raise ManifestError(f"file {path} has no checksum (one of {', '.join(CHECKSUMS)})")


def _need(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise ManifestError(f"manifest has no {key!r}")
    value = d[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ManifestError(f"manifest {key!r} must be {kind}, got {value!r}")
    if not isinstance(value, kind):
        raise ManifestError(f"manifest {key!r} has the wrong type: {value!r}")
    return value


def _check_tensors(tensors: Mapping[str, Any]) -> None:
    """Each entry must be {"shape": [ints >= 0], "dtype": str}; the message names the first bad
    one."""
    for name, spec in tensors.items():
        if not isinstance(name, str) or not isinstance(spec, Mapping):
            raise ManifestError(f"manifest tensor {name!r} must map a name to an object, "
                                f"got {spec!r}")
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if not isinstance(shape, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        ):
            raise ManifestError(f"manifest tensor {name!r} has a bad shape {shape!r}")
        if not isinstance(dtype, str):
            raise ManifestError(f"manifest tensor {name!r} has a bad dtype {dtype!r}")


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds. Immutable: a checkpoint is never edited in place.

    ``layout`` says how to read the files back: ``{"kind": "replicated", "file": "state.pt"}``
    for a DDP-style state that every rank holds whole, ``{"kind": "sharded", "planner": "dcp"}``
    for torch.distributed.checkpoint (loadable on another world size). ``digest`` is the
    caller's fingerprint of the state (e.g. ``State.digest()``) so a resume can prove it
    restored exactly what was saved. ``meta`` is free-form caller data.

    ``tensors`` maps every tensor of the saved state, by path
    (``model/fc.weight``), to ``{"shape": [...], "dtype": "float32"}``, so a
    load can refuse a checkpoint of another model by name before reading
    gigabytes. Optional: manifests written before it existed have None, and it
    is left out of the JSON when None, so older readers see the old schema.

    ``job_id`` names the job that wrote the checkpoint, so a resume can tell a
    checkpoint of another job (``checks.check_same_job``). "" when unknown: a
    checkpoint written outside a job, or a manifest without the field.

    ``mac`` is the job's HMAC-SHA256 of everything else in the manifest
    (``checkpoint.mac``): None when written outside a job, and then left out
    of the JSON.
    """

    step: int
    world_size: int
    layout: dict[str, Any]
    kind: str
    job_id: str
    generation: int
    created_at: float
    files: tuple[FileEntry, ...]
    digest: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION
    tensors: dict[str, dict[str, Any]] | None = None
    mac: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ManifestError(f"manifest kind must be one of {KINDS}, got {self.kind!r}")
        if self.step < 0:
            raise ManifestError(f"manifest step must be >= 0, got {self.step}")
        if self.world_size < 1:
            raise ManifestError(f"manifest world_size must be >= 1, got {self.world_size}")
        if not isinstance(self.layout.get("kind"), str):
            raise ManifestError(f"manifest layout needs a 'kind', got {self.layout!r}")
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ManifestError("manifest lists a file twice")
        if MANIFEST_NAME in paths:
            raise ManifestError("manifest lists itself")
        if self.tensors is not None:
            _check_tensors(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema": self.schema,
            "step": self.step,
            "world_size": self.world_size,
            "layout": dict(self.layout),
            "kind": self.kind,
            "job_id": self.job_id,
            "generation": self.generation,
            "created_at": self.created_at,
            "digest": self.digest,
            "files": [f.to_dict() for f in self.files],
            "meta": dict(self.meta),
        }
        if self.tensors is not None:
            out["tensors"] = {name: dict(spec) for name, spec in self.tensors.items()}
        if self.mac is not None:
            out["mac"] = self.mac
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        if not isinstance(d, Mapping):
            raise ManifestError(f"a manifest must be a JSON object, got {type(d).__name__}")
        schema = _need(d, "schema", int)
        if schema > SCHEMA_VERSION:
            raise ManifestError(
                f"manifest schema {schema} is newer than this undying understands "
                f"({SCHEMA_VERSION}); upgrade undying"
            )
        files = _need(d, "files", list)
        digest = d.get("digest")
        if digest is not None and not isinstance(digest, str):
            raise ManifestError(f"manifest 'digest' must be a string or null, got {digest!r}")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise ManifestError(f"manifest 'meta' must be an object, got {meta!r}")
        # Absent or null: a manifest that never recorded it; no job to compare
        job_id = d.get("job_id")
        if job_id is None:
            job_id = ""
        elif not isinstance(job_id, str):
            raise ManifestError(f"manifest 'job_id' must be a string, got {job_id!r}")
        mac = d.get("mac")
        if mac is not None and not isinstance(mac, str):
            raise ManifestError(f"manifest 'mac' must be a string or absent, "
                                f"got {type(mac).__name__}")
        tensors = d.get("tensors")
        if tensors is not None and not isinstance(tensors, dict):
            raise ManifestError(f"manifest 'tensors' must be an object or absent, "
                                f"got {type(tensors).__name__}")
        return cls(
            step=_need(d, "step", int),
            world_size=_need(d, "world_size", int),
            layout=dict(_need(d, "layout", dict)),
            kind=_need(d, "kind", str),
            job_id=job_id,
            generation=_need(d, "generation", int),
            created_at=float(_need(d, "created_at", (int, float))),
            files=tuple(FileEntry.from_dict(f) for f in files),
            digest=digest,
            meta=dict(meta),
            schema=schema,
            tensors=None if tensors is None else {
                k: dict(v) if isinstance(v, dict) else v for k, v in tensors.items()
            },
            mac=mac,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON ({e})") from e
        return cls.from_dict(data)
