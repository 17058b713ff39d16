"""Whose job dir, token and manager.json undying trusts, and its own files private whatever the umask.

The rules are a pure decision (``owner_problem``) checked by table; then the
real thing on real files: a second uid made with ``chown`` (root only), a
non-root user's view in a forked child that ``setuid``s to that uid, and the
job dir's files created under umask 022 and 000.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from undying.errors import UsageError
from undying.jobfiles.events import EventLog
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.ownership import owner_problem
from undying.jobfiles.tokens import (
    TOKEN_ENV,
    TOKEN_FILE,
    ensure_token,
    ensure_token_with_source,
    find_token,
)

ME, OTHER, THIRD = 1000, 1001, 1002
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root (chown, setuid)")


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)  # (the suite sets one for its jobs; here the files decide)


def st(uid: int, mode: int, *, directory: bool = False) -> os.stat_result:
    kind = stat.S_IFDIR if directory else stat.S_IFREG
    return os.stat_result((kind | mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(("euid", "uid", "mode", "is_dir", "dir_uid", "trusted"), [
    (ME, ME, 0o700, True, None, True),        # my job dir
    (ME, ME, 0o755, True, None, True),        # mine, readable: made 0700 on use
    (ME, ME, 0o775, True, None, False),       # group may have planted files in it
    (ME, ME, 0o777, True, None, False),
    (ME, OTHER, 0o700, True, None, False),    # another user's folder
    (ME, 0, 0o755, True, None, True),         # root's (the user cannot write it anyway)
    (ME, ME, 0o600, False, ME, True),         # my token
    (ME, OTHER, 0o600, False, ME, False),     # a token another user pre-created
    (ME, ME, 0o622, False, ME, False),        # a manager.json others can write
    (ME, OTHER, 0o644, False, OTHER, False),  # a non-root user never trusts another's files
    (0, OTHER, 0o777, True, None, True),      # root: a container's volume, any owner and mode
    (0, OTHER, 0o600, False, OTHER, True),    # root: a file of the volume's owner
    (0, THIRD, 0o600, False, OTHER, False),   # root: not a third user's
    (0, 0, 0o666, False, OTHER, False),       # root: never a file others can write
    (0, OTHER, 0o600, False, None, False),    # root: a --token-file of another user
])
def test_whose_files_are_trusted(euid: int, uid: int, mode: int, is_dir: bool, dir_uid: int | None,
                                 trusted: bool) -> None:
    problem = owner_problem(st(uid, mode, directory=is_dir), "/x", euid=euid, dir_uid=dir_uid, is_dir=is_dir)
    assert (problem is None) == trusted, problem
    if problem is not None:
        assert "\n" not in problem and "/x" in problem


def modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.iterdir()]}


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_the_job_dir_and_undyings_files_in_it_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        jd = JobDir(tmp_path / "deep" / "job")
        jd.prepare()
        ensure_token(jd.path)
        jd.private_log()
        log = EventLog(jd.events_db)  # as the launcher and `undying manager` open it
        log.set_job("state", "running", flush=True)
        jd.write_manager({"url": "http://127.0.0.1:1", "pid": 0, "job_id": "j"})
        found = modes(jd.path)
        log.close()
    finally:
        os.umask(old)
    assert found == {"job": 0o700, "events.db": 0o600, "events.db-wal": 0o600, "events.db-shm": 0o600,
                     TOKEN_FILE: 0o600, "manager.json": 0o600, "undying.lock": 0o600}, found


def test_an_existing_job_dir_of_mine_is_made_private(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir(mode=0o755)
    os.chmod(tmp_path / "job", 0o755)
    JobDir(tmp_path / "job").prepare()
    assert stat.S_IMODE((tmp_path / "job").stat().st_mode) == 0o700


def test_a_job_dir_others_can_write_is_refused_for_a_user(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root accepts a volume of any mode (a user's view is test_a_users_view_of_another_users_files)")
    (tmp_path / "job").mkdir()
    os.chmod(tmp_path / "job", 0o777)
    with pytest.raises(UsageError, match="writable by group and others"):
        JobDir(tmp_path / "job").prepare()


@root_only
def test_a_token_file_another_user_made_is_not_adopted(tmp_path: Path) -> None:
    """Root's own job dir, a 0600 token in it that uid 65534 made: its owner is checked, not just its mode."""
    job = tmp_path / "job"
    ensure_token(job)
    (job / TOKEN_FILE).write_text("stranger-knows-this\n")
    os.chown(job / TOKEN_FILE, NOBODY, NOBODY)
    for read in (lambda: ensure_token(job), lambda: find_token(job, None)):
        with pytest.raises(UsageError, match=f"uid {NOBODY}.*not to you"):
            read()
    # Named by --token-file, it is refused too: root trusts only its own token files, or a volume owner's in the
    # job dir.
    with pytest.raises(UsageError, match="not to you"):
        ensure_token_with_source(tmp_path / "other", str(job / TOKEN_FILE))


@root_only
def test_a_planted_manager_json_is_refused(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.prepare()
    jd.manager_file.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": os.getpid(), "job_id": "j"}))
    os.chown(jd.manager_file, NOBODY, NOBODY)
    with pytest.raises(UsageError, match="manager.json belongs to"):
        jd.running_manager_url()
    with pytest.raises(UsageError, match="manager.json belongs to"):
        JobDir(jd.path).prepare()


@root_only
def test_root_uses_a_volume_of_another_uid_and_makes_it_private(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    os.chmod(volume, 0o777)  # an emptyDir
    os.chown(volume, NOBODY, NOBODY)
    JobDir(volume).prepare()
    token = ensure_token(volume)
    assert stat.S_IMODE(volume.stat().st_mode) == 0o700 and volume.stat().st_uid == NOBODY
    os.chown(volume / TOKEN_FILE, NOBODY, NOBODY)  # a token the volume's owner wrote is the job's
    assert find_token(volume, None) == token


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder any user may enter (tmp_path's parents are root's alone), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="undying-shared-"))
    os.chmod(base, 0o755)
    yield base
    import shutil

    shutil.rmtree(base, ignore_errors=True)


def as_user(uid: int, fn: Callable[[], str]) -> str:
    """``fn()`` in a forked child running as ``uid`` (a real second user); its result, or the error it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            result = fn()
        except BaseException as e:
            result = f"{type(e).__name__}: {e}"
        os.write(write, result.encode()[:60000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


@root_only
def test_a_users_view_of_another_users_files(shared: Path) -> None:
    """uid 65534 running undying: a job dir, token or manager.json of root's making, or open to writes, is refused."""
    theirs = shared / "theirs"
    theirs.mkdir(mode=0o755)  # root's job dir, readable by all
    (theirs / "events.db").touch()
    os.chmod(theirs, 0o777)  # and writable by all: another user may plant files there
    result = as_user(NOBODY, lambda: str(JobDir(theirs).prepare()))
    assert result.startswith("UsageError") and "writable by group and others" in result, result

    mine = shared / "mine"
    mine.mkdir(mode=0o700)
    os.chown(mine, NOBODY, NOBODY)
    (mine / TOKEN_FILE).write_text("planted\n")
    os.chmod(mine / TOKEN_FILE, 0o644)  # readable: so the user could adopt it, and its maker knows it
    os.chown(mine / TOKEN_FILE, 1, 1)  # uid 1 (daemon): neither the user nor root
    result = as_user(NOBODY, lambda: ensure_token(mine))
    assert result.startswith("UsageError") and "uid 1), not to you" in result, result
    # The same file named with --token-file (whose mode is the user's business): its owner is checked too.
    result = as_user(NOBODY, lambda: ensure_token_with_source(mine / "sub", str(mine / TOKEN_FILE))[0])
    assert result.startswith("UsageError") and "not to you" in result, result

    planted = {"url": "http://127.0.0.1:9", "pid": 1, "job_id": "j"}
    (mine / "manager.json").write_text(json.dumps(planted))
    os.chown(mine / "manager.json", 1, 1)
    result = as_user(NOBODY, lambda: JobDir(mine).running_manager_url())
    assert result.startswith("UsageError") and "manager.json belongs to" in result, result


def test_the_token_source_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    given = tmp_path / "given"
    given.write_text("from-a-file\n")
    assert ensure_token_with_source(tmp_path / "a", str(given)) == ("from-a-file", f"--token-file {given}")
    assert (tmp_path / "a" / TOKEN_FILE).read_text().strip() == "from-a-file"  # commands given the job dir find it
    assert ensure_token_with_source(tmp_path / "a") == ("from-a-file", str(tmp_path / "a" / TOKEN_FILE))
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert ensure_token_with_source(tmp_path / "a") == ("from-env", f"env {TOKEN_ENV}")
    monkeypatch.delenv(TOKEN_ENV)
    token, source = ensure_token_with_source(tmp_path / "b")
    assert source == f"{tmp_path / 'b' / TOKEN_FILE} (new)" and len(token) >= 40
