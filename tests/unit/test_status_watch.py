"""``undying status --watch`` against a scripted manager API, and the shared view."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from undying.cli.main import main
from undying.cli.status import watch
from undying.cli.status_view import render
from undying.jobfiles.events import EventLog
from undying.jobfiles.tokens import TOKEN_ENV
from undying.protocol.api_proof import HELLO_PATH, NONCE_HEADER, peer_name, proof_key, proof_of


def status(state: str, step: int, incidents: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "job_id": "w1", "state": state, "generation": 1 if incidents else 0, "world_size": 2,
        "started_at": None, "step": step, "rerun_steps": [], "exit_reason": "",
        "ranks": [{"rank": r, "node": 0, "pid": 4000 + r, "state": "running", "step": step, "generation": 0,
                   "restarts": 0, "phase": "step"} for r in range(2)],
        "incidents": incidents or [],
        "trace": {"step": True, "comm": False, "by": "alice", "t": 0.0},
        "step_times": [[s, 0.05 + 0.01 * (s % 3)] for s in range(1, step + 1)],
    }


CRASH = {"id": 1, "kind": "crash", "rank": 1, "step": 3, "action": "replace", "status": "recovered",
         "mttr_s": 1.25, "phases": {"detected": 0.01, "first_step_done": 1.25}, "traceback": ""}


class Scripted:
    """A stand-in manager API that answers /api/status from a list, one entry per request."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers = answers
        self.requests = 0
        script = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # (keeps the connection: the proof and the request share it)

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                if self.path == HELLO_PATH:  # prove the job's key as a manager does (the suite's env token)
                    nonce, peer = bytes.fromhex(self.headers[NONCE_HEADER]), peer_name(self.client_address)
                    proof = proof_of(proof_key(os.environ[TOKEN_ENV]), nonce, "w1", peer)
                    body = json.dumps({"job_id": "w1", "peer": peer, "proof": proof}).encode()
                else:
                    body = json.dumps(script.answers[min(script.requests, len(script.answers) - 1)]).encode()
                    script.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted() -> Iterator[list[Scripted]]:
    servers: list[Scripted] = []
    yield servers
    for s in servers:
        s.close()


def console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=160, force_terminal=False, color_system=None), out


def test_watch_follows_the_job_until_it_ends(scripted: list[Scripted]) -> None:
    api = Scripted([status("running", 2), status("recovering", 3, [CRASH]), status("succeeded", 6, [CRASH])])
    scripted.append(api)
    con, out = console()
    assert watch(None, api.url, con, interval=0.01) == 0
    assert api.requests == 3  # it polled until the job's final state, then stopped
    text = out.getvalue()
    assert "job w1: succeeded" in text
    assert "crash" in text and "replace" in text and "1.250" in text  # the incident and its timeline
    assert "first_step_done 1.250" in text
    assert "trace: step markers on, comm markers off (changed by alice" in text
    assert "step time: " in text and "at step 6" in text
    assert "phase" in text and "4001" in text  # ranks with phase and PID


def test_watch_ends_when_the_manager_goes_after_stopping(scripted: list[Scripted]) -> None:
    """The launcher exits right after the job ends, often before a poll sees the final state."""
    api = Scripted([status("running", 2), status("stopping", 4)])
    scripted.append(api)
    con, out = console()

    def vanish_after_stopping() -> None:
        while api.requests < 2:
            threading.Event().wait(0.005)
        api.close()

    closer = threading.Thread(target=vanish_after_stopping)
    closer.start()
    assert watch(None, api.url, con, interval=0.05) == 0
    closer.join()
    scripted.clear()
    assert "stopped answering while the job was stopping" in out.getvalue()


def test_watch_of_a_job_that_is_not_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.db")
    log.set_job("job_id", "old")
    log.set_job("state", "succeeded", flush=True)
    log.close()
    assert main(["status", "--watch", "--job-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, "one line"
    assert "is not running (its log says succeeded)" in err


def test_watch_of_a_manager_that_does_not_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--watch", "--manager", "127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("undying: error: no manager answers") and "\n" not in err


def test_watch_and_json_do_not_mix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--watch", "--json", "--manager", "127.0.0.1:9"]) == 2
    assert "--watch" in capsys.readouterr().err


def test_the_view_prints_job_data_as_text_not_markup() -> None:
    """A traceback or error from the user's script may hold rich markup; it prints as itself."""
    incident = dict(CRASH, traceback="ValueError: [bold]not markup[/bold] [/]")
    con, out = console()
    render(dict(status("failed", 3, [incident]), exit_reason="failed: [red]x[/red]"), con)
    text = out.getvalue()
    assert "[bold]not markup[/bold] [/]" in text
    con, out = console()
    render(dict(status("running", 3), trace={"step": False, "comm": False, "by": "file", "t": 0.0,
                                             "error": "line 1: not JSON"}), con)
    assert "switch file ignored: line 1: not JSON" in out.getvalue()
    assert "failed: [red]x[/red]" in text


def test_the_view_says_what_a_regroup_waits_for() -> None:
    regroup = {"why": "node 1 lost and not replaced within --node-wait 3s", "members": [0, 1], "left": [0, 1],
               "step": 40, "generation": 5, "started": 0.0, "waiting_for_nodes_since": time.time() - 5,
               "checkpoint": "/jobs/j/checkpoints/step-000000040"}
    con, out = console()
    render(dict(status("recovering", 3), regroup=regroup), con)
    text = out.getvalue()
    assert "regrouping: node 1 lost" in text and "step-000000040" in text and "waiting 5s for nodes" in text
