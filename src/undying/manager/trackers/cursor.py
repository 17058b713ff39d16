"""The trackers' durable cursor: the last committed step each tracker was sent, in the job dir.

``<job dir>/trackers.json`` holds, per tracker, the last step it took (and
what it needs to find its run again: MLflow's run id). A tracker's thread
advances it only after the tracker flushed that step, so a manager that
restarts, or a relaunch of the job, sends each tracker the steps after it and
none before: a step re-run after a recovery or a resume is never sent twice.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from undying.jobfiles.ownership import write_private

__all__ = ["Cursor", "CURSOR_FILE"]

CURSOR_FILE = "trackers.json"
# A cursor file larger than this is not ours (a handful of trackers, a step and a run id each).
_MAX_BYTES = 64 * 1024

log = logging.getLogger("undying.manager")


class Cursor:
    """Per tracker: the last step sent (``step``) and its own resume facts; written whole and
    atomically, by any tracker's thread (one lock)."""

    def __init__(self, job_dir: Path) -> None:
        self.path = Path(job_dir) / CURSOR_FILE
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            raw = self.path.read_bytes()[: _MAX_BYTES + 1]
        except FileNotFoundError:
            return {}
        except OSError as e:
            log.warning("trackers: cannot read %s (%s): every tracker starts from the job's next "
                        "step", self.path, e.strerror or e)
            return {}
        try:
            if len(raw) > _MAX_BYTES:
                raise ValueError(f"over {_MAX_BYTES} bytes")
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            entries = {str(name): dict(entry) for name, entry in data.items()
                       if isinstance(entry, dict)}
            for entry in entries.values():
                step = entry.get("step", 0)
                if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                    raise ValueError(f"step {step!r} is not a step number")
            return entries
        except ValueError as e:
            log.warning("trackers: %s is damaged (%s): remove it to send every step again; "
                        "until then every tracker starts from step 0", self.path, e)
            return {}

    def last(self, name: str) -> int:
        """The last step tracker ``name`` took (0: none)."""
        with self._lock:
            return int(self._entries.get(name, {}).get("step", 0))

    def facts(self, name: str) -> dict[str, Any]:
        """What tracker ``name`` wrote of its own to find its run again (e.g. ``run_id``)."""
        with self._lock:
            return {k: v for k, v in self._entries.get(name, {}).items() if k != "step"}

    def advance(self, name: str, step: int | None = None, **facts: Any) -> None:
        """Tracker ``name`` took every step up to ``step`` (and its ``facts``): written at once."""
        with self._lock:
            entry = dict(self._entries.get(name, {}))
            entry.update(facts)
            if step is not None:
                entry["step"] = max(int(entry.get("step", 0)), step)
            entry.setdefault("step", 0)
            self._entries[name] = entry
            write_private(self.path, json.dumps(self._entries, sort_keys=True).encode())
