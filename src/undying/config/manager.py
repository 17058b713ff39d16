"""``undying manager``'s options, and the limits of every listening socket of a manager.

``ConnectionLimits`` is a section of both ``JobConfig`` (a standalone job's manager) and
``ManagerOptions`` (``undying manager``), whose fields are its options by the package's rule.
"""

from __future__ import annotations

import dataclasses
import resource
from dataclasses import dataclass, field
from typing import Any

from undying.errors import UsageError
from undying.inputs import check_finite

__all__ = ["DEFAULT_MANAGER_PORT", "PROGRESS_EVERY_S", "MOST_PROGRESS_EVERY_S",
           "check_progress_every", "default_max_connections", "ConnectionLimits", "ManagerOptions"]

# `undying manager`'s agent port; the control store is on the next port, its HTTP API on the one
# after.
DEFAULT_MANAGER_PORT = 29400


# The progress of the process that runs a job (cli/progress_show.py) where its stderr is no
# terminal: a line every this many seconds (--progress-every), at most a day apart; 0: none (nor a
# live line).
PROGRESS_EVERY_S = 30.0
MOST_PROGRESS_EVERY_S = 86400.0


def check_progress_every(value: float) -> float:
    """``value`` when it is 0 (off) to a day, else ``UsageError`` naming ``--progress-every``."""
    if not 0.0 <= value <= MOST_PROGRESS_EVERY_S:  # (NaN fails this too)
        raise UsageError(f"--progress-every must be 0 (off) to {MOST_PROGRESS_EVERY_S:g} seconds, "
                         f"got {value}")
    return value


# A listening socket's header and idle timeouts are tens of seconds at most (undying.manager.conns).
_MAX_CONN_TIMEOUT_S = 60.0


def default_max_connections() -> int:
    """A quarter of this process's descriptor limit (the rest stays for the job), 16 to 1024."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 4))


@dataclass(frozen=True)
class ConnectionLimits:
    """Seconds and counts that bound each listening socket of the manager (HTTP API and agents'
    port)."""

    # From accept (or the end of the previous response) to a request's complete headers; also a
    # body's limit.
    http_header_timeout: float = 10.0
    # A keep-alive connection with no request for this long is closed.
    http_idle_timeout: float = 30.0
    # Open connections per listening socket; 0: a quarter of RLIMIT_NOFILE, 16 to 1024.
    max_connections: int = 0

    def validate(self) -> None:
        for option, value in (("--http-header-timeout", self.http_header_timeout),
                              ("--http-idle-timeout", self.http_idle_timeout)):
            check_finite(option, value)
            if not 0 < value <= _MAX_CONN_TIMEOUT_S:
                raise UsageError(f"{option} must be > 0 and <= {_MAX_CONN_TIMEOUT_S:.0f} seconds, "
                                 f"got {value}")
        if not 0 <= self.max_connections <= 65536:
            raise UsageError(f"--max-connections must be between 0 (auto) and 65536, "
                             f"got {self.max_connections}")

    @property
    def cap(self) -> int:
        return self.max_connections or default_max_connections()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ConnectionLimits:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in known})



@dataclass(frozen=True, kw_only=True)
class ManagerOptions:
    """``undying manager``'s options, each the field of its name by the rule (``--http-port``:
    ``http_port``)."""

    job_id: str
    job_dir: str
    # The address agents join on (and the HTTP API's): this host only by default.
    host: str = "127.0.0.1"
    # Where agents join; the control store is on the next port.
    port: int = DEFAULT_MANAGER_PORT
    # The HTTP API's port (the command's default: --port + 2).
    http_port: int
    open_status: bool = False
    # Its progress on its stderr (cli/progress_show.py): a live line on a terminal, else a line
    # every this many seconds; 0: neither.
    progress_every: float = PROGRESS_EVERY_S
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
