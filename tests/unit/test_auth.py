"""The job's token: how the manager keeps it, how callers find it, how it is compared."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from undying.errors import UsageError
from undying.jobfiles.tokens import (
    TOKEN_ENV,
    TOKEN_FILE,
    auth_headers,
    ensure_token,
    find_token,
)
from undying.manager.http.access import token_from_headers, tokens_match


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts without UNDYING_TOKEN, whatever the shell running pytest has."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    yield


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_token_is_random_and_private(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    token = ensure_token(a)
    assert len(token) >= 40  # 32 random bytes, URL-safe base64
    assert (a / TOKEN_FILE).read_text().strip() == token
    assert mode(a / TOKEN_FILE) == 0o600
    assert ensure_token(b) != token
    assert [p.name for p in a.iterdir()] == [TOKEN_FILE]  # no temporary file left behind


def test_a_loose_umask_does_not_loosen_the_file(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ensure_token(tmp_path)
    finally:
        os.umask(old)
    assert mode(tmp_path / TOKEN_FILE) == 0o600


def test_the_file_is_never_readable_by_others_while_it_is_written(tmp_path: Path) -> None:
    """Watch the folder while tokens are written again and again: no file in it is ever group/other readable."""
    stop = threading.Event()
    loose: list[str] = []

    def watch() -> None:
        while not stop.is_set():
            for entry in os.scandir(tmp_path):
                try:
                    if entry.stat(follow_symlinks=False).st_mode & 0o077:
                        loose.append(entry.name)
                except FileNotFoundError:
                    continue

    watcher = threading.Thread(target=watch)
    old = os.umask(0)
    watcher.start()
    try:
        for i in range(200):
            os.environ[TOKEN_ENV] = f"token-number-{i}"
            ensure_token(tmp_path)
    finally:
        stop.set()
        watcher.join(timeout=10)
        os.umask(old)
        del os.environ[TOKEN_ENV]
    assert not loose
    assert (tmp_path / TOKEN_FILE).read_text().strip() == "token-number-199"


def test_an_existing_token_is_kept(tmp_path: Path) -> None:
    """A restarted manager keeps the token its agents and users already hold."""
    first = ensure_token(tmp_path)
    assert ensure_token(tmp_path) == first


def test_the_env_token_wins_and_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ensure_token(tmp_path)
    monkeypatch.setenv(TOKEN_ENV, "from-the-secret-store")
    assert ensure_token(tmp_path) == "from-the-secret-store"
    assert (tmp_path / TOKEN_FILE).read_text().strip() == "from-the-secret-store"
    assert mode(tmp_path / TOKEN_FILE) == 0o600


def test_an_empty_env_token_means_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "")
    token = ensure_token(tmp_path)
    assert token and token == find_token(tmp_path, None)


def test_an_env_token_that_cannot_go_in_a_header_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "two words")
    with pytest.raises(UsageError, match=f"env {TOKEN_ENV} is not a header-safe token"):
        ensure_token(tmp_path)
    assert not (tmp_path / TOKEN_FILE).exists()


@pytest.mark.parametrize("loose", [0o640, 0o604, 0o644])
def test_a_token_file_others_can_read_is_refused(tmp_path: Path, loose: int) -> None:
    path = tmp_path / TOKEN_FILE
    token = ensure_token(tmp_path)
    path.chmod(loose)
    with pytest.raises(UsageError) as refused:
        ensure_token(tmp_path)
    message = str(refused.value)
    assert str(path) in message and f"{loose:04o}" in message and f"chmod 600 {path}" in message
    with pytest.raises(UsageError, match="readable by group or others"):
        find_token(tmp_path, None)
    assert path.read_text().strip() == token and mode(path) == loose  # refused, not "fixed" behind the user's back


def test_a_symlink_in_place_of_the_token_file_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("planted-token\n")
    elsewhere.chmod(0o600)
    job = tmp_path / "job"
    job.mkdir()
    (job / TOKEN_FILE).symlink_to(elsewhere)
    with pytest.raises(UsageError, match=f"cannot read token file {job / TOKEN_FILE}"):
        ensure_token(job)


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / TOKEN_FILE
    path.touch(mode=0o600)
    with pytest.raises(UsageError, match=f"the token in token file {path} is empty"):
        ensure_token(tmp_path)


def test_find_token_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--token-file, then env UNDYING_TOKEN, then the job dir's file; None when there is none."""
    assert find_token(tmp_path, None) is None
    assert find_token(None, None) is None
    in_dir = ensure_token(tmp_path)
    assert find_token(tmp_path, None) == in_dir
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert find_token(tmp_path, None) == "from-env"
    assert find_token(None, None) == "from-env"
    given = tmp_path / "given"
    given.write_text("from-the-flag\n")
    given.chmod(0o440)  # a Kubernetes Secret mounted with fsGroup: the user's own choice, read as it is
    assert find_token(tmp_path, str(given)) == "from-the-flag"


def test_a_missing_token_file_flag_is_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=f"token file {tmp_path / 'nope'} does not exist"):
        find_token(None, str(tmp_path / "nope"))


def test_tokens_match() -> None:
    assert tokens_match("abc", "abc")
    assert not tokens_match("abd", "abc")
    assert not tokens_match("ab", "abc")
    assert not tokens_match("", "abc")
    assert not tokens_match(None, "abc")
    assert not tokens_match("ab\udcff", "abc")  # a header that is not ASCII is a wrong token, not a crash


def test_headers_both_ways() -> None:
    sent = auth_headers("t0k", "job-1")
    assert sent == {"Authorization": "Bearer t0k", "X-Undying-Job": "job-1"}
    assert token_from_headers(sent) == "t0k"
    assert token_from_headers({"Authorization": "bearer t0k "}) == "t0k"
    assert token_from_headers({"X-Undying-Token": "t0k"}) == "t0k"
    assert token_from_headers({"Authorization": "Basic dXNlcjpwYXNz"}) is None
    assert token_from_headers({}) is None
    assert auth_headers(None) == {}
