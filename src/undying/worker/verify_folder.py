"""The ``verify/`` folder of one ``--verify-every`` loop: its files' names, writes and clean-up.

Split from ``worker.verify``, which decides what is written and read, and when: this module
knows where each file lies (named by rank 0's PID, the round and the step), how it is written
(from a thread, sealed under the job's MAC by ``worker.verify_files``, whole when it appears)
and which files a loop removes (an earlier loop's at the start, older pre-step states once a
newer one is verified, a stale round's requests, its own at the end).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any

from undying.protocol.verify_wire import file_name
from undying.worker.verify_files import save_sealed, seal

__all__ = ["VerifyFolder"]

log = logging.getLogger("undying.worker")


class VerifyFolder:
    """One loop's files in the job dir's ``verify/`` folder."""

    def __init__(self, job_dir: str, key: bytes) -> None:
        self.path = Path(job_dir) / "verify"
        self._key = key  # the job's verify key: every file here is sealed with it
        self.owner = 0  # rank 0's PID: with the round number, what names this loop's files
        self._writes: list[threading.Thread] = []

    def clear_stale(self) -> None:
        """Rank 0 at the start: the folder, without an earlier launch's or an earlier rank 0's
        files (never answered now); the verifier's log is kept."""
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.iterdir():
            if stale.name != "verifier.log":
                with contextlib.suppress(OSError):
                    stale.unlink()

    def round(self, round_no: int) -> str:
        return f"{self.owner}r{round_no:04d}"

    def file(self, kind: str, round_no: int, step: int, suffix: str) -> Path:
        return self.path / file_name(kind, self.round(round_no), step, suffix)

    def answered(self, round_no: int) -> set[int]:
        """The steps of a round whose answers are in the folder (not read)."""
        return {int(p.name.rsplit("-", 1)[1].split(".")[0])
                for p in self.path.glob(f"res-{self.round(round_no)}-*.json")}

    def in_background(self, path: Path, obj: Any, then: tuple[Path, bytes] | None = None) -> None:
        """Written from a thread: the step goes on (the files are whole when they appear)."""
        def write() -> None:
            try:
                save_sealed(path, obj, self._key)
                if then is not None:
                    seal(*then, self._key)
            except OSError as e:  # a full disk: this verification is not done (the book says so)
                log.info("verification file %s not written: %s", path, e)

        self._writes = [t for t in self._writes if t.is_alive()]
        thread = threading.Thread(target=write, name="undying-verify-write", daemon=True)
        thread.start()
        self._writes.append(thread)

    def join_writes(self, timeout: float) -> None:
        """The writes still running, waited for (each at most ``timeout`` seconds)."""
        for thread in self._writes:
            thread.join(timeout=timeout)
        self._writes = []

    def forget_older_states(self, step: int) -> None:
        for path in self.path.glob(f"pre-{self.owner}r*-*.pt"):
            with contextlib.suppress(ValueError, OSError):
                if int(path.name.rsplit("-", 1)[1].split(".")[0]) < step:
                    path.unlink()

    def drop_requests(self, round_no: int) -> None:
        """A round's requests the verifier has not taken yet: they would be answered for
        nothing."""
        for stale in self.path.glob(f"req-{self.round(round_no)}-*.json"):
            with contextlib.suppress(OSError):
                stale.unlink()

    def remove_own(self) -> None:
        """The loop ended: its files, and the verifiers' ready marks, removed."""
        for path in [*self.path.glob(f"*-{self.owner}r*"), *self.path.glob("ready-*")]:
            with contextlib.suppress(OSError):
                path.unlink()
