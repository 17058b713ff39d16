"""The job's persistent checkpoints and tracing: the config sections a rank reads back from its
environment.

``CheckpointConfig`` and ``TraceConfig`` are sections of ``JobConfig`` (``--keep`` is
``checkpoint.keep``, ``--trace-dir`` is ``trace.trace_dir``); each says, as environment
variables, what a rank needs of it (``env``), and ``checkpoint_from_env``/``trace_from_env``
read them back in the rank, each variable by its one reader (``undying.inputs.env_value``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from undying.config.timeouts import MAX_TIMEOUT_S
from undying.errors import UsageError
from undying.inputs import check_finite, env_value
from undying.protocol.env import (
    CHECKPOINT_DIR_ENV,
    KEEP_ENV,
    REPLICATE_ENV,
    REPLICATE_EVERY_ENV,
    SAVE_EVERY_ENV,
    SAVE_INTERVAL_ENV,
    TRACE_DIR_ENV,
    TRACE_MAX_DIR_MB_ENV,
    TRACE_MAX_FILE_MB_ENV,
)

__all__ = ["CheckpointConfig", "checkpoint_from_env", "TraceConfig", "TRACE_INITIAL",
           "trace_from_env"]


@dataclass(frozen=True)
class CheckpointConfig:
    """Persistent checkpoints: where, how often, how many; and the dying gasp on SIGTERM."""

    # A folder or fsspec URL; "" means <job dir>/checkpoints.
    checkpoint_dir: str = ""
    # Save after every N committed steps (0: not by steps).
    save_every: int = 0
    # Save when this many seconds passed since the last save (0: not by time).
    save_interval: float = 0.0
    # Checkpoints kept (the latest valid one is always kept).
    keep: int = 3
    # Seconds from SIGTERM to every process gone; 0: sized from the measured checkpoint.
    grace_period: float = 0.0
    # A second SIGTERM within this many seconds of a dying gasp reuses it.
    gasp_reuse_within: float = 60.0
    # Sharded state: "ring" keeps a copy of each rank's shard on its ring successor
    # (worker.replica).
    replicate: str = "off"
    # With replicate="ring": replicate every this many steps (a fault re-runs up to K-1 steps).
    replicate_every: int = 1

    def validate(self) -> None:
        for option, value in (("--save-interval", self.save_interval),
                              ("--grace-period", self.grace_period),
                              ("--gasp-reuse-within", self.gasp_reuse_within)):
            check_finite(option, value)
        if self.save_every < 0:
            raise UsageError(f"--save-every must be >= 0 steps, got {self.save_every}")
        if self.save_interval < 0:
            raise UsageError(f"--save-interval must be >= 0 seconds, got {self.save_interval}")
        if self.keep < 1:
            raise UsageError(f"--keep must be at least 1, got {self.keep}")
        if self.grace_period < 0 or self.grace_period > MAX_TIMEOUT_S:
            raise UsageError(f"--grace-period must be between 0 (auto) and {MAX_TIMEOUT_S:.0f}, "
                             f"got {self.grace_period}")
        if self.gasp_reuse_within < 0:
            raise UsageError(f"--gasp-reuse-within must be >= 0 seconds, "
                             f"got {self.gasp_reuse_within}")
        if self.replicate not in ("off", "ring"):
            raise UsageError(f"--replicate must be off or ring, got {self.replicate!r}")
        if self.replicate_every < 1:
            raise UsageError(f"--replicate-every must be at least 1 step, "
                             f"got {self.replicate_every}")

    def env(self, job_dir: str) -> dict[str, str]:
        return {
            CHECKPOINT_DIR_ENV: self.resolved_dir(job_dir),
            SAVE_EVERY_ENV: str(self.save_every),
            SAVE_INTERVAL_ENV: repr(self.save_interval),
            KEEP_ENV: str(self.keep),
            REPLICATE_ENV: self.replicate,  # read by undying.worker.replica.ReplicationConfig
            REPLICATE_EVERY_ENV: str(self.replicate_every),
        }

    def resolved_dir(self, job_dir: str) -> str:
        if self.checkpoint_dir:
            if "://" in self.checkpoint_dir:
                return self.checkpoint_dir
            return os.path.abspath(self.checkpoint_dir)
        return os.path.join(os.path.abspath(job_dir), "checkpoints")


def checkpoint_from_env(env: os._Environ[str] | dict[str, str] | None = None) -> CheckpointConfig:
    env = os.environ if env is None else env
    given = _given(env, save_every=SAVE_EVERY_ENV, save_interval=SAVE_INTERVAL_ENV, keep=KEEP_ENV)
    return CheckpointConfig(checkpoint_dir=env.get(CHECKPOINT_DIR_ENV, ""), **given)


def _given(env: Mapping[str, str], **names: str) -> dict[str, Any]:
    """The fields whose variable (``names``: field=variable) is set in ``env``, each read by its one
    reader.

    A field left out keeps its dataclass default: each default is written once, on its field.
    """
    return {field: value for field, name in names.items()
            if (value := env_value(name, env)) is not None}


@dataclass(frozen=True)
class TraceConfig:
    """Lightweight tracing (undying.trace): where records go, how big they may grow, the first
    setting."""

    # A folder; "" means <job dir>/traces. Records go to <dir>/<job id>/<rank>/.
    trace_dir: str = ""
    # A new record file when the newest passes this size.
    trace_max_file_mb: float = 10.0
    # The oldest 20% of the trace files are deleted when the folder passes this size.
    trace_max_dir_mb: float = 1000.0
    # The switch at start: off, on (step, ckpt, fp and data markers) or comm (those and
    # collectives).
    trace: str = "off"
    # A JSON file watched for the switch (a mounted Kubernetes ConfigMap), e.g. {"step": "on",
    # "comm": "off"}.
    trace_switch_file: str = ""

    def validate(self) -> None:
        check_finite("--trace-max-file-mb", self.trace_max_file_mb)
        check_finite("--trace-max-dir-mb", self.trace_max_dir_mb)
        if self.trace not in TRACE_INITIAL:
            raise UsageError(f"--trace must be one of {', '.join(TRACE_INITIAL)}, "
                             f"got {self.trace!r}")
        if not 0 < self.trace_max_file_mb <= 100_000:
            raise UsageError(f"--trace-max-file-mb must be > 0, got {self.trace_max_file_mb}")
        if not 0 < self.trace_max_dir_mb <= 100_000_000:
            raise UsageError(f"--trace-max-dir-mb must be > 0, got {self.trace_max_dir_mb}")
        if self.trace_max_dir_mb < self.trace_max_file_mb:
            raise UsageError(
                f"--trace-max-dir-mb ({self.trace_max_dir_mb}) must be at least "
                f"--trace-max-file-mb ({self.trace_max_file_mb})"
            )

    def resolved_dir(self, job_dir: str) -> str:
        if self.trace_dir:
            return os.path.abspath(self.trace_dir)
        return os.path.join(os.path.abspath(job_dir), "traces")

    def env(self, job_dir: str) -> dict[str, str]:
        return {
            TRACE_DIR_ENV: self.resolved_dir(job_dir),
            TRACE_MAX_FILE_MB_ENV: repr(self.trace_max_file_mb),
            TRACE_MAX_DIR_MB_ENV: repr(self.trace_max_dir_mb),
        }


TRACE_INITIAL = ("off", "on", "comm")


def trace_from_env(env: os._Environ[str] | dict[str, str] | None = None) -> TraceConfig:
    env = os.environ if env is None else env
    given = _given(env, trace_max_file_mb=TRACE_MAX_FILE_MB_ENV,
                   trace_max_dir_mb=TRACE_MAX_DIR_MB_ENV)
    return TraceConfig(trace_dir=env.get(TRACE_DIR_ENV, ""), **given)
