"""What both composition roots build alike: a job's manager with its files, its control store and
its API.

``undying run`` on one node (``standalone``) and ``undying manager``
(``manager_service``) each host a job's manager the same way: the job dir
prepared and its token read (the checkpoints' key from it), the SQLite event
log opened, the manager built on it, its control store serving the job's
stores, and its HTTP API announced in the job dir (and to Prometheus, by a
target file in the user's folder, ``undying.jobfiles.prometheus``). What differs between them
(the agents' server, the agent in the launcher's own process) is theirs.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from undying.checkpoint.mac import key_from_token, set_key
from undying.config import EXIT_PREEMPTED, EXIT_PREEMPTED_BEHIND, JobConfig
from undying.jobfiles.events import EventLog
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.prometheus import Publisher
from undying.jobfiles.records import JobState
from undying.jobfiles.tokens import ensure_token_with_source
from undying.manager.http import start_http
from undying.manager.manager import Manager
from undying.protocol.store_wire import store_key_from_token

__all__ = ["JobFiles", "ManagerHost", "exit_code"]

_EXIT_CODES = {JobState.SUCCEEDED: 0, JobState.FAILED: 1, JobState.STOPPED: 130}


def exit_code(manager: Manager, final: JobState, interrupted_by: signal.Signals | None) -> int:
    """The launcher's (and every agent's) exit code for how the job ended."""
    if final is JobState.PREEMPTED:
        preemption = manager.preemption or {}
        if preemption.get("checkpoint_step", -1) < 0:
            return 143
        # 75 promises a resume loses nothing; a checkpoint older than the stop step makes it re-run
        # steps.
        return EXIT_PREEMPTED if not preemption.get("resume_reruns", 0) else EXIT_PREEMPTED_BEHIND
    if final is JobState.STOPPED and interrupted_by in (signal.SIGTERM, signal.SIGHUP,
                                                        signal.SIGQUIT):
        # (a preempting signal that found nothing to preempt: 143, 129 or 131)
        return 128 + int(interrupted_by)
    return _EXIT_CODES.get(final, 1)


@dataclass(frozen=True)
class JobFiles:
    """A job dir made ready for a manager: its token (and where it came from), its key in force."""

    job_dir: JobDir
    token: str
    token_from: str

    @classmethod
    def open(cls, path: Path, *, token_file: str | None = None, keep_log: bool = False) -> JobFiles:
        """Prepare the job dir (``keep_log``: a restarted manager carries its log on), read or make
        the token, and check every checkpoint the manager resumes from under the job's key."""
        job_dir = JobDir(path)
        job_dir.prepare(keep_log=keep_log)
        token, token_from = ensure_token_with_source(job_dir.path, token_file)
        set_key(key_from_token(token))
        return cls(job_dir, token, token_from)

    def event_log(self) -> EventLog:
        """The job's SQLite event log, readable by its owner only."""
        self.job_dir.private_log()
        return EventLog(self.job_dir.events_db)


class ManagerHost:
    """A job's manager, built and served: its control store on ``control_port``, then its HTTP API.

    ``restoring``: a restarted manager reads the job back from its log first
    (``known_sessions``: the sessions its agents may resume) and opens the
    generation it left again once its control store serves.
    """

    def __init__(self, config: JobConfig, files: JobFiles, events: EventLog, *,
                 restoring: bool = False) -> None:
        self.config = config
        self.files = files
        self.events = events
        self.manager = Manager(config, events, restoring=restoring)
        self.known_sessions: dict[int, str] = {}
        self._runner: web.AppRunner | None = None
        # Its Prometheus target file and the user's scrape credential (jobfiles/prometheus.py).
        self._prometheus = Publisher()
        try:
            if restoring:
                self.known_sessions = self.manager.restore()
                # (its checkpoint dir's owner lock again, in the background)
                self.manager.checkpoints.reown()
            self.control_port = self.manager.start_control_store(store_key_from_token(files.token))
            if restoring:
                self.manager.reopen_generation()
        except BaseException:
            self.manager.close()
            raise

    async def serve_api(self, *, open_status: bool, **facts: object) -> str:
        """Start the HTTP API and say where it is in the job dir (``facts``: what else the file
        tells); returns its URL. ``open_status``: the status page is served without the token."""
        config = self.config
        self._runner, url = await start_http(self.manager, config.host, config.http_port,
                                             open_status=open_status,
                                             scrape_credential=self._prometheus.credential())
        self.files.job_dir.write_manager({"url": url, "pid": os.getpid(), "job_id": config.job_id,
                                          **facts, "control_port": self.control_port,
                                          "started_at": time.time()})
        self.events.set_job("url", url, flush=True)
        # (after manager.json: a scraper that finds the target finds a job dir that names it)
        self._prometheus.publish(url, config.job_id, config.job_dir)
        return url

    async def close(self) -> None:
        """The API stops, the job dir forgets this manager, the manager closes its stores and
        log."""
        try:
            self._prometheus.withdraw()
            if self._runner is not None:
                await self._runner.cleanup()
            self.files.job_dir.clear_manager()
        finally:
            self.manager.close()
