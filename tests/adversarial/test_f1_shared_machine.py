"""Finding 1 on a shared machine: another local user gets nothing from a running job.

One real job, started under umask 000 (the loosest a user can have) in a folder
every user may enter, with its token given in env ``UNDYING_TOKEN`` (as a
Kubernetes pod gets it). While it trains and after it ends:

- no rank, spare or zygote has the token in its environment, and each has the
  checkpoint and store keys derived from it (not others);
- ``undying`` commands reach the real manager, and a stranger's listener named
  in ``manager.json`` (posing as a manager, or relaying to the real one) gets a
  nonce and never the token; one that another user planted is refused before
  any connection;
- a token sent in a URL query is refused and written to no log;
- the job dir is ``0700``, undying's files in it ``0600``, and a real second
  uid (65534, where the test runs as root) can open no file and list no
  folder in it: log, checkpoints, traces, token, workers' files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.adversarial.fake_manager import serve
from tests.adversarial.test_f1_listening import _descendants
from tests.integration.jobs import manager_url, start_job, wait_running
from undying.checkpoint.mac import key_from_token
from undying.cli.main import main
from undying.jobfiles.tokens import TOKEN_FILE
from undying.protocol.env import CHECKPOINT_KEY_ENV, STORE_KEY_ENV, TOKEN_ENV
from undying.protocol.store_wire import store_key_from_token

NOBODY = 65534
AS_ROOT = os.geteuid() == 0


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder any user may enter, as a shared machine's /scratch (tmp_path's parents are root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="undying-shared-"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode(errors="replace").split("=", 1) for item in f.read().split(b"\0") if b"=" in item)


class Fake:
    """A stranger's listener (a forked child that became uid 65534 where the test is root), recording all it is sent."""

    def __init__(self, job_id: str, relay_to: str | None = None) -> None:
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            try:
                os.close(read)
                if AS_ROOT:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                serve(job_id, relay_to, write)
            finally:
                os._exit(0)
        os.close(write)
        self.out = os.fdopen(read, "r")
        self.port = int(self.out.readline())

    def received(self) -> str:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        out = self.out.read()
        self.out.close()
        return "".join(json.loads(line)["data"] for line in out.splitlines())


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def as_nobody_opens(paths: list[Path]) -> list[str]:
    """What uid 65534, in a forked child, could open (files) or list (folders) among ``paths``."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        opened = []
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for path in paths:
                try:
                    if path.is_dir():
                        os.listdir(path)
                    else:
                        os.close(os.open(path, os.O_RDONLY))
                    opened.append(str(path))
                except OSError:
                    pass
        except BaseException as e:
            opened.append(f"setuid failed: {e}")
        os.write(write, json.dumps(opened).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = f.read()
    os.waitpid(pid, 0)
    return list(json.loads(out))


def test_a_job_on_a_shared_machine_gives_another_user_nothing(
        shared: Path, reap: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    token = os.environ[TOKEN_ENV]  # the suite's: the launcher is given it in its environment
    job_dir = shared / "job"
    old = os.umask(0)
    try:
        job = start_job(job_dir, ["--epochs", "2", "--step-seconds", "0.05"], ranks=2, reap=reap,
                        run_args=["--spares", "1", "--save-every", "8", "--trace", "on"])
    finally:
        os.umask(old)
    url = manager_url(job_dir)
    wait_running(url, min_step=2)
    info = json.loads((job_dir / "manager.json").read_text())

    # The job's processes: the keys derived from the token, never the token (ranks, the spare, the zygote).
    keyed = 0
    for pid in _descendants(job.pid) - {job.pid}:
        env = environ(pid)
        assert TOKEN_ENV not in env, f"pid {pid} has the token in its environment"
        if CHECKPOINT_KEY_ENV in env:
            keyed += 1
            assert env[CHECKPOINT_KEY_ENV] == key_from_token(token).hex()
            assert env[STORE_KEY_ENV] == store_key_from_token(token).hex()
    assert keyed >= 4, keyed  # two ranks, a spare, the zygote

    # The real manager proves itself: commands work as before.
    code, err = cli(["trace", "on", "--comm", "--job-dir", str(job_dir)], capsys)
    assert code == 0, err

    # A stale or planted manager.json of the user's own naming a stranger's listener: no token reaches it.
    stale = shared / "stale"
    stale.mkdir(mode=0o700)
    shutil.copy(job_dir / TOKEN_FILE, stale / TOKEN_FILE)
    for relay_to, why in [(None, "does not match the key"), (url.removeprefix("http://"), "another connection")]:
        fake = Fake(info["job_id"], relay_to)
        (stale / "manager.json").write_text(json.dumps(info | {"url": f"http://127.0.0.1:{fake.port}"}))
        code, err = cli(["inject", "crash", "--rank", "0", "--job-dir", str(stale)], capsys)
        seen = fake.received()
        assert code == 2 and err.count("\n") == 1 and why in err and "the token was not sent" in err, err
        assert "/api/hello" in seen and token not in seen and "authorization" not in seen.lower(), seen
    if AS_ROOT:  # planted by another user: refused before any connection
        fake = Fake(info["job_id"])
        (stale / "manager.json").write_text(json.dumps(info | {"url": f"http://127.0.0.1:{fake.port}"}))
        os.chown(stale / "manager.json", NOBODY, NOBODY)
        code, err = cli(["status", "--job-dir", str(stale)], capsys)
        assert code == 2 and err.count("\n") == 1 and f"uid {NOBODY}" in err, err
        assert fake.received() == ""

    # A token in a URL query: refused, and written to no log (checked below with every file of the job).
    for path in ("/api/status", "/api/inject"):
        try:
            urllib.request.urlopen(f"{url}{path}?token={token}", timeout=10)
            raise AssertionError(f"{path} took a token in its query")
        except urllib.error.HTTPError as e:
            assert e.code in (401, 405), e.code

    assert job.wait(timeout=120) == 0, (shared / "job.log").read_text()[-3000:]
    launcher_log = (shared / "job.log").read_text()
    # The start line names the source (wrapped at 80 columns: read across its lines).
    assert f"started, 2 ranks, token from env {TOKEN_ENV}" in " ".join(launcher_log.split())
    assert "(query not shown)" in launcher_log  # the refused query was logged, without its token

    # Private whatever the umask: the folder 0700, undying's own files 0600.
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    for name in (TOKEN_FILE, "events.db"):
        assert stat.S_IMODE((job_dir / name).stat().st_mode) == 0o600, name
    everything = sorted(job_dir.rglob("*"))
    names = {p.relative_to(job_dir).parts[0] for p in everything}
    assert {"checkpoints", "traces", "events.db", TOKEN_FILE} <= names, names
    # No log or file of the job holds the token (but the token file).
    files = [p for p in everything if p.is_file() and p.name != TOKEN_FILE] + [shared / "job.log"]
    holding: list[Any] = [str(p) for p in files if token.encode() in p.read_bytes()]
    assert not holding, holding
    if AS_ROOT:
        assert as_nobody_opens([job_dir, *everything]) == []
        # (and it can open what is not the job's: the check would see a leak)
        assert as_nobody_opens([shared]) == [str(shared)]
