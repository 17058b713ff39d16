"""The trace switch file: reading and watching the JSON that sets which markers are on.

The switch changes while the job runs: from the API, the CLI, or a watched
JSON file such as a mounted Kubernetes ConfigMap (``SwitchFileWatcher``). Its
value and rules (comm needs step) are the contract's:
``undying.protocol.trace_switch``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from undying.protocol.trace_switch import SWITCH_EXAMPLE, TraceSwitch, TraceSwitchError
from undying.user_files import open_regular

__all__ = ["read_switch_file", "SwitchFileWatcher"]

log = logging.getLogger("undying.trace")

# A switch file is a few dozen bytes; anything far larger is not one.
_MAX_FILE_BYTES = 64 * 1024


def read_switch_file(path: str | os.PathLike[str], *, t: float | None = None) -> TraceSwitch:
    """The switch a JSON file sets (``by`` is ``"file <path>"``).

    Raises ``TraceSwitchError`` naming the file when it cannot be read, is not
    JSON, or holds a bad setting.
    """
    switch, _ = _read(Path(path), time.time() if t is None else t)
    return switch


def _read(path: Path, t: float) -> tuple[TraceSwitch, bytes]:
    """The switch and the raw content it was parsed from (the watcher compares content)."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:  # (a FIFO: refused, never waited on)
            data = f.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError as e:
        raise TraceSwitchError(
            f"trace switch file {path} does not exist; write {SWITCH_EXAMPLE} there"
        ) from e
    except OSError as e:
        raise TraceSwitchError(f"cannot read trace switch file {path}: {e.strerror or e}") from e
    return _parse_bytes(path, data, t), data


def _parse_bytes(path: Path, data: bytes, t: float) -> TraceSwitch:
    if len(data) > _MAX_FILE_BYTES:
        raise TraceSwitchError(
            f"trace switch file {path} is larger than {_MAX_FILE_BYTES} bytes: "
            f"it should hold one small JSON object like {SWITCH_EXAMPLE}"
        )
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TraceSwitchError(f"trace switch file {path} is not UTF-8 text: {e}") from e
    except json.JSONDecodeError as e:
        raise TraceSwitchError(
            f"trace switch file {path} is not valid JSON ({e.msg} at line {e.lineno} "
            f"column {e.colno}); write an object like {SWITCH_EXAMPLE}"
        ) from e
    try:
        return TraceSwitch.parse(obj, by=f"file {path}", t=t)
    except TraceSwitchError as e:
        raise TraceSwitchError(f"trace switch file {path}: {e}") from e


class SwitchFileWatcher:
    """Polls a JSON switch file and reports each new setting, like a ConfigMap mount.

    Kubernetes updates a mounted ConfigMap by swapping a symlink to a new
    directory, so the file's own mtime may not change; the watcher compares
    the bytes read. A change is reported only when the content parses to
    markers different from the last good setting, so rewriting the same
    setting, or a CLI change made meanwhile, is not overridden by an
    unchanged file. Bad content is reported once per distinct content and the
    last good setting stays; a missing file is reported once until it returns.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_change: Callable[[TraceSwitch], None],
        on_error: Callable[[str], None],
        interval_s: float = 0.2,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self._on_change = on_change
        self._on_error = on_error
        self._content: bytes | None = None  # the last content read (good or bad)
        self._last_good: TraceSwitch | None = None
        self._reported: str | None = None  # the last error reported, not repeated

    @property
    def last_good(self) -> TraceSwitch | None:
        """The last setting read from the file, or None if none was good yet."""
        return self._last_good

    def poll_once(self) -> TraceSwitch | None:
        """Read the file once; the new switch if its markers changed, else None."""
        try:
            with os.fdopen(open_regular(self.path), "rb") as f:
                data = f.read(_MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            # Forget the content so the file is read afresh when it returns.
            self._content = None
            self._error(
                f"trace switch file {self.path} is missing; keeping the last setting"
                + (f" ({self._last_good.describe()})" if self._last_good else "")
            )
            return None
        except OSError as e:
            self._content = None
            self._error(f"cannot read trace switch file {self.path}: {e.strerror or e}")
            return None
        if data == self._content:
            return None
        self._content = data
        try:
            switch = _parse_bytes(self.path, data, time.time())
        except TraceSwitchError as e:
            # Content is parsed only when it changes, so each distinct bad
            # content is reported exactly once, even two with the same message.
            kept = f" ({self._last_good.describe()})" if self._last_good else ""
            self._reported = f"{e}; keeping the last setting{kept}"
            self._on_error(self._reported)
            return None
        self._reported = None
        if self._last_good is not None and switch.same_markers(self._last_good):
            return None
        self._last_good = switch
        self._on_change(switch)
        return switch

    async def run(self) -> None:
        """Poll every ``interval_s`` until cancelled; a failing callback is logged, not fatal."""
        while True:
            try:
                self.poll_once()
            except Exception:
                log.exception("trace switch watcher for %s: a callback failed", self.path)
            await asyncio.sleep(self.interval_s)

    def _error(self, message: str) -> None:
        """Report a missing or unreadable file once, not on every poll."""
        if message == self._reported:
            return
        self._reported = message
        self._on_error(message)


