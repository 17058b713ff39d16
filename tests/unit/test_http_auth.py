"""The manager's API behind the job's token: a real Manager, served by ``start_http`` on a real socket.

Requests go through the CLI's own client (urllib) and ``undying`` commands, so
both ends are the shipped code. The one stand-in is the node's agent: it
records what the manager asks of it (kill, arm, trace) instead of signalling
processes, because here the question is whether a request reached the
manager at all; the integration tests fault real ranks through the same API.

"Nothing changed" is checked on everything a request could touch: the job's
status (state, trace switch, ranks, incidents), every row of the event log,
and every call the manager made to the agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web

from undying.cli.client import AccessDeniedError, api_get, api_post
from undying.cli.main import main
from undying.config import JobConfig
from undying.errors import UsageError
from undying.jobfiles.events import EventLog
from undying.jobfiles.tokens import TOKEN_ENV, TOKEN_FILE
from undying.manager.http import start_http
from undying.manager.http.server import log as server_log
from undying.manager.manager import Manager
from undying.protocol.codec import Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.worker_wire import ArmFault, TraceSet

T = TypeVar("T")
JOB = "authjob"


class RecordingAgent:
    """The node's agent as the manager sees it, writing down each thing it is asked to do."""

    node = 0

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def spawn(self, rank: int, record: GenerationRecord, *, joining: bool,
              resume_from: str = "", incarnation: int = 0) -> tuple[int, bool]:
        self.calls.append(("spawn", rank))
        return 0, False

    def tell(self, rank: int, message: Message) -> bool:
        self.calls.append(("tell", rank, type(message).__name__))
        return True

    def live_ranks(self) -> list[int]:
        return []

    def kill(self, rank: int, sig: signal.Signals) -> bool:
        self.calls.append(("kill", rank, sig.name))
        return True

    def arm(self, rank: int, fault: ArmFault) -> None:
        self.calls.append(("arm", rank, fault.kind, fault.at_step))

    def abort(self, rank: int, generation: int, reason: str, *, at_step_start: bool = False,
              from_step: int = 0) -> bool:
        self.calls.append(("abort", rank))
        return True

    def keep_spares(self) -> None:
        pass

    attached = True

    def drop_waiting(self) -> None:
        self.calls.append(("drop_waiting",))

    def spares_ready(self) -> int:
        return 0

    async def stop_all(self, grace_s: float) -> None:
        self.calls.append(("stop_all",))

    def set_trace(self, switch: TraceSet) -> None:
        self.calls.append(("set_trace", switch.step, switch.comm))

    def phases(self) -> dict[int, str]:
        return {}

    def view(self) -> dict[str, Any]:
        return {"node": self.node}


class Served:
    """A real Manager and its API, on an event loop of their own in a thread (the test thread is the client)."""

    def __init__(self, job_dir: Path, *, open_status: bool = False, scrape_credential: str | None = None) -> None:
        self.job_dir = job_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.events = EventLog(job_dir / "events.db")
        self.agent = RecordingAgent()

        self.manager = Manager(JobConfig(job_id=JOB, job_dir=str(job_dir), nproc_per_node=2), self.events)
        self.manager.add_agent(self.agent)
        self.manager.ranks[0].pid = 4242

        async def serve() -> tuple[web.AppRunner, str]:
            # The launcher's own call: positional host and port.
            return await start_http(self.manager, "127.0.0.1", 0, open_status=open_status,
                                    scrape_credential=scrape_credential)

        try:
            self.runner, self.url = self.call(serve)
        except BaseException:
            self._stop_loop()
            raise
        self.token = (job_dir / TOKEN_FILE).read_text().strip()

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout=10)

    def snapshot(self) -> dict[str, Any]:
        """Everything a request could change, read on the manager's own thread."""

        async def read() -> dict[str, Any]:
            await asyncio.sleep(0.05)  # let a stop's task (if one was wrongly started) run
            db = self.manager.events.db
            status = self.manager.status()
            # Goodput's seconds are the wall clock's, which moves between two reads; its incidents are state.
            status["goodput"] = status["goodput"]["incidents"]
            return {
                "status": json.dumps(status, default=str, sort_keys=True),
                "events": db.execute("SELECT kind, data FROM events ORDER BY id").fetchall(),
                "job": db.execute("SELECT key, value FROM job ORDER BY key").fetchall(),
                "agent": list(self.agent.calls),
            }

        return self.call(read)

    def close(self) -> None:
        async def teardown() -> None:
            await self.runner.cleanup()
            await asyncio.sleep(0.05)

        self.call(teardown)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self.manager.close()  # closes the event log too
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    yield s
    s.close()


@pytest.fixture
def open_served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path, open_status=True)
    yield s
    s.close()


def raw(url: str, method: str = "GET", body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any] | str]:
    """One request with exactly these headers (no token unless given); the status and the decoded answer."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            code, text, kind = response.status, response.read().decode(), response.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        code, text, kind = e.code, e.read().decode(), e.headers["Content-Type"]
    return code, json.loads(text) if kind.startswith("application/json") else text


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


READS = ["/", "/metrics", "/api/status", "/api/ranks", "/api/incidents", "/api/trace"]
CHANGES = [
    ("POST", "/api/inject", {"kind": "crash", "rank": 0}),
    ("POST", "/api/inject", {"kind": "slow", "rank": 1, "factor": 2.0}),
    ("POST", "/api/stop", {}),
    ("POST", "/api/trace", {"on": True, "comm": True}),
    ("PUT", "/api/trace", {"step": "on", "comm": "on"}),
]


@pytest.mark.parametrize("token", [None, "not-the-token", ""])
def test_every_endpoint_refuses_a_request_without_the_token(served: Served, token: str | None) -> None:
    before = served.snapshot()
    headers = {} if token is None else bearer(token)
    for path in READS:
        code, answer = raw(served.url + path, headers=headers)
        assert code == 401, path
        assert isinstance(answer, dict)
        assert str(served.job_dir / TOKEN_FILE) in answer["error"]
        assert "--token-file" in answer["error"] and TOKEN_ENV in answer["error"]
        assert ("a wrong token" if token else "no token") in answer["error"]
    for method, path, body in CHANGES:
        code, answer = raw(served.url + path, method, json.dumps(body).encode(),
                           {"Content-Type": "application/json", **headers})
        assert code == 401, (method, path)
        assert isinstance(answer, dict) and str(served.job_dir / TOKEN_FILE) in answer["error"]
    assert served.snapshot() == before


def test_a_wrong_token_in_the_other_header_and_in_the_page_address(served: Served) -> None:
    before = served.snapshot()
    assert raw(served.url + "/api/status", headers={"X-Undying-Token": "nope"})[0] == 401
    assert raw(served.url + "/?token=nope")[0] == 401
    # The address takes the token for the page only: the API wants a header.
    assert raw(served.url + f"/api/status?token={served.token}")[0] == 401
    assert raw(served.url + f"/api/inject?token={served.token}", "POST", b'{"rank": 0}')[0] == 401
    assert served.snapshot() == before


def test_the_token_from_the_job_dir_lets_everything_in(served: Served) -> None:
    path = served.job_dir / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for p in READS:
        assert raw(served.url + p, headers=bearer(served.token))[0] == 200, p
    assert raw(served.url + "/api/status", headers={"X-Undying-Token": served.token})[0] == 200
    code, page = raw(served.url + f"/?token={served.token}")
    assert code == 200 and isinstance(page, str) and "<script" in page

    answer = api_post(served.url, "/api/inject", {"kind": "crash", "rank": 0}, token=served.token, job_id=JOB)
    assert answer["pid"] == 4242 and ("kill", 0, "SIGKILL") in served.agent.calls
    api_post(served.url, "/api/inject", {"kind": "slow", "rank": 1, "factor": 1.5, "at_step": 9}, token=served.token)
    assert ("arm", 1, "slow", 9) in served.agent.calls
    switched = api_post(served.url, "/api/trace", {"on": True, "comm": False, "by": "test"}, token=served.token)
    assert switched["step"] is True and switched["by"] == "test"
    assert api_get(served.url, "/api/trace", token=served.token)["step"] is True
    assert api_post(served.url, "/api/stop", {}, token=served.token) == {"stopping": True}
    assert json.loads(served.snapshot()["status"])["state"] in ("stopping", "stopped")


def test_a_request_for_another_job_is_refused_even_with_the_token(served: Served) -> None:
    before = served.snapshot()
    with pytest.raises(AccessDeniedError, match=f"this manager runs job {JOB}, the request is for job other-job"):
        api_post(served.url, "/api/inject", {"kind": "crash", "rank": 0}, token=served.token, job_id="other-job")
    with pytest.raises(AccessDeniedError, match="the request is for job other-job"):
        api_get(served.url, "/api/status", token=served.token, job_id="other-job")
    assert served.snapshot() == before
    assert api_get(served.url, "/api/status", token=served.token, job_id=JOB)["job_id"] == JOB


MALFORMED = [
    ("POST", "/api/inject", b"{not json", "JSON object"),
    ("POST", "/api/inject", b'[{"rank": 0}]', "JSON object"),
    ("POST", "/api/inject", b'{"kind": "crash"}', '"rank"'),
    ("POST", "/api/inject", b'{"rank": "0"}', '"rank" must be a whole number'),
    ("POST", "/api/inject", b'{"rank": 0.5}', '"rank" must be a whole number'),
    ("POST", "/api/inject", b'{"rank": true}', '"rank" must be a whole number'),
    ("POST", "/api/inject", b'{"rank": 0, "at_step": "soon"}', '"at_step" must be a whole number'),
    ("POST", "/api/inject", b'{"rank": 0, "kind": 3}', '"kind" must be a string'),
    ("POST", "/api/inject", b'{"rank": 0, "phase": ["step"]}', '"phase" must be a string'),
    ("POST", "/api/inject", b'{"rank": 1, "kind": "slow", "factor": "2x"}', '"factor" must be a number'),
    ("POST", "/api/inject", b'{"rnak": 0}', 'unknown field "rnak"'),
    ("POST", "/api/inject", b'{"kind": "explode", "rank": 0}', "unknown fault kind"),
    ("POST", "/api/inject", b'{"rank": 7}', "rank 7 does not exist"),
    ("POST", "/api/trace", b'{"comm": true}', 'boolean "on"'),
    ("POST", "/api/trace", b'{"on": "yes"}', 'boolean "on"'),
    ("POST", "/api/trace", b'{"on": true, "comm": "yes"}', '"comm" must be a boolean'),
    ("PUT", "/api/trace", b'{"step": "maybe"}', "step"),
    ("PUT", "/api/trace", b'{"stpe": "on"}', "stpe"),
    ("PUT", "/api/trace", b'"on"', "JSON object"),
]


@pytest.mark.parametrize(("method", "path", "body", "words"), MALFORMED)
def test_a_malformed_body_is_400_naming_the_field_and_changes_nothing(
    served: Served, method: str, path: str, body: bytes, words: str
) -> None:
    before = served.snapshot()
    code, answer = raw(served.url + path, method, body, {"Content-Type": "application/json", **bearer(served.token)})
    assert code == 400
    assert isinstance(answer, dict) and words in answer["error"], answer
    assert served.snapshot() == before


def test_open_status_opens_the_reads_only(open_served: Served) -> None:
    before = open_served.snapshot()
    for path in READS:
        assert raw(open_served.url + path)[0] == 200, path
    for method, path, body in CHANGES:
        code, answer = raw(open_served.url + path, method, json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
        assert code == 401 and isinstance(answer, dict) and "no token" in answer["error"], (method, path)
    # The job check holds for the open reads too.
    assert raw(open_served.url + "/api/status", headers={"X-Undying-Job": "other"})[0] == 401
    assert open_served.snapshot() == before
    api_post(open_served.url, "/api/trace", {"on": True}, token=open_served.token)
    assert open_served.snapshot() != before


def test_a_restarted_manager_keeps_the_token(tmp_path: Path) -> None:
    first = Served(tmp_path)
    token = first.token
    first.close()
    (tmp_path / "events.db").rename(tmp_path / "events.old.db")
    second = Served(tmp_path)
    try:
        assert second.token == token
        assert api_get(second.url, "/api/status", token=token)["job_id"] == JOB
    finally:
        second.close()


def test_a_group_readable_token_file_stops_the_manager_from_serving(tmp_path: Path) -> None:
    (tmp_path / TOKEN_FILE).write_text("leaked-token\n")
    (tmp_path / TOKEN_FILE).chmod(0o644)
    with pytest.raises(UsageError, match=f"token file {tmp_path / TOKEN_FILE} is readable by group or others"):
        Served(tmp_path)


# --- the commands, against the same real server ----------------------------------------


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_commands_without_the_token_say_so_in_one_line(served: Served, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The manager's own log of each refusal goes to its process's output, not the command's: here the two
    # share one process (and its stderr once a command set up the console, as run first in a worker).
    monkeypatch.setattr(server_log, "disabled", True)
    before = served.snapshot()
    address = served.url.removeprefix("http://")
    for argv in (["inject", "crash", "--rank", "0"], ["trace", "on"], ["trace", "show"], ["status"],
                 ["chaos", "--every", "0.01", "--count", "1"]):
        code, out, err = cli([*argv, "--manager", address], capsys)
        assert code == 2, argv
        assert err.count("\n") == 1 and err.startswith("undying: error: "), err
        assert str(served.job_dir / TOKEN_FILE) in err and "Traceback" not in err
    assert served.snapshot() == before


def test_commands_find_the_token(served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    address = served.url.removeprefix("http://")
    token_file = tmp_path / "given-token"
    token_file.write_text(served.token + "\n")
    code, out, _ = cli(["trace", "on", "--manager", address, "--token-file", str(token_file), "--json"], capsys)
    assert code == 0 and json.loads(out)["step"] is True
    monkeypatch.setenv(TOKEN_ENV, served.token)
    code, out, _ = cli(["status", "--manager", address, "--json"], capsys)
    assert code == 0 and json.loads(out)["trace"]["step"] is True
    code, out, _ = cli(["inject", "crash", "--rank", "0", "--manager", address], capsys)
    assert code == 0 and "injected: crash of rank 0 (pid 4242)" in out
    # --token-file comes before env: a wrong file is used, and refused (the manager cannot prove its key, so
    # the wrong token is not even sent).
    token_file.write_text("stale-token\n")
    code, _, err = cli(["trace", "off", "--manager", address, "--token-file", str(token_file)], capsys)
    assert code == 2 and "a wrong token" in err and f"token came from --token-file {token_file}" in err


def test_commands_given_the_job_dir_read_its_token_and_name_the_job(
    served: Served, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --job-dir: the URL from manager.json, the token from <job dir>/token, the job id sent along."""
    info = {"url": served.url, "pid": os.getpid(), "job_id": JOB}
    (served.job_dir / "manager.json").write_text(json.dumps(info))
    code, out, _ = cli(["trace", "on", "--job-dir", str(served.job_dir), "--json"], capsys)
    assert code == 0 and json.loads(out)["step"] is True
    before = served.snapshot()
    # A stale env token comes before the job dir's file; the refusal says that is what was sent.
    monkeypatch.setenv(TOKEN_ENV, "left-over-from-another-job")
    code, _, err = cli(["inject", "crash", "--rank", "0", "--job-dir", str(served.job_dir)], capsys)
    assert code == 2 and "a wrong token" in err and f"token came from env {TOKEN_ENV}" in err
    monkeypatch.delenv(TOKEN_ENV)
    (served.job_dir / "manager.json").write_text(json.dumps(info | {"job_id": "someone-else"}))
    code, _, err = cli(["inject", "crash", "--rank", "0", "--job-dir", str(served.job_dir)], capsys)
    assert code == 2 and f"this manager runs job {JOB}, the request is for job someone-else" in err
    assert served.snapshot() == before


def test_status_of_a_finished_job_needs_no_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = EventLog(tmp_path / "events.db")
    events.set_job("job_id", "done-job")
    events.set_job("state", "succeeded")
    events.close()
    (tmp_path / TOKEN_FILE).write_text("x" * 20)
    (tmp_path / TOKEN_FILE).chmod(0o000)  # unreadable: proves status never reads it for a finished job
    try:
        code, out, err = cli(["status", "--job-dir", str(tmp_path), "--json"], capsys)
    finally:
        (tmp_path / TOKEN_FILE).chmod(0o600)
    assert code == 0, err
    assert json.loads(out)["state"] == "succeeded" and json.loads(out)["live"] is False


def test_a_token_in_a_url_is_refused_and_written_to_no_log(served: Served, caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused (the API takes headers only) and logged without its query; a token that still reaches a line of
    the API's loggers (aiohttp's report of a malformed request line, say) is masked."""
    from undying.manager.conns import QuietLog
    from undying.manager.http.server import HideTokens

    for quiet in logging.getLogger("undying.manager.http").filters:  # (earlier tests' refusals used up the quota)
        if isinstance(quiet, QuietLog):
            monkeypatch.setattr(quiet, "burst", 10**6)
    before = served.snapshot()
    with caplog.at_level("WARNING", logger="undying.manager.http"):
        for path in ("/api/status", "/api/ranks", "/metrics"):
            code, answer = raw(f"{served.url}{path}?x=1&token={served.token}", headers=bearer(served.token))
            assert code == 401 and "token in a URL is refused" in str(answer), (path, answer)
        code, _ = raw(f"{served.url}/?token=wrong-{served.token}")
        assert code == 401
    assert "(query not shown)" in caplog.text and served.token not in caplog.text
    assert served.snapshot() == before
    record = logging.LogRecord("undying.manager.http.requests", logging.WARNING, __file__, 1,
                               "bad request line %r from %s", (f"GET /x?token={served.token} HTTP/1.1", "1.2.3.4"),
                               None)
    HideTokens().filter(record)
    assert served.token not in record.getMessage() and "token=<hidden>" in record.getMessage()
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, f"Authorization: Bearer {served.token}", None, None)
    HideTokens().filter(record)
    assert served.token not in record.getMessage()


def test_the_users_scrape_credential_opens_get_metrics_and_nothing_else(tmp_path: Path) -> None:
    credential = "scrape-credential-of-the-user"
    s = Served(tmp_path, scrape_credential=credential)
    try:
        before = s.snapshot()
        code, text = raw(s.url + "/metrics", headers=bearer(credential))
        assert code == 200 and "undying_step " in str(text)
        assert raw(s.url + "/metrics", "HEAD", headers=bearer(credential))[0] == 200
        assert raw(s.url + "/metrics", headers=bearer(s.token))[0] == 200  # the job's token as before
        for headers in ({}, bearer("a-wrong-one"), {"X-Undying-Token": credential + "x"}):
            assert raw(s.url + "/metrics", headers=headers)[0] == 401, headers
        for path in READS:
            if path != "/metrics":
                assert raw(s.url + path, headers=bearer(credential))[0] == 401, path
        assert raw(s.url + f"/?token={credential}")[0] == 401
        for path, body in (("/api/stop", b"{}"), ("/api/inject", b'{"kind": "crash", "rank": 0}'),
                           ("/api/trace", b'{"on": true}')):
            assert raw(s.url + path, "POST", body, {**bearer(credential), "Content-Type": "application/json"})[0] == 401
        assert s.snapshot() == before
    finally:
        s.close()
