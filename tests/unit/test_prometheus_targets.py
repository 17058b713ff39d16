"""The user's Prometheus folder: each job's file_sd target file and the scrape credential.

Real files, real processes: a job's writer SIGKILLed leaves a stale file that the
next job removes; a stranger's file, a link and a file of another name are left
alone; a real full filesystem (a tmpfs of 64 KiB) costs a warning, never the job.
Also the ports a job on one node takes: a free one by default, side by side.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from undying.errors import UsageError
from undying.jobfiles.prometheus import (
    CREDENTIAL_FILE,
    DEFAULT_FOLDER,
    Publisher,
    TargetFile,
    folder,
    scrape_credential,
    sweep,
    target_address,
)
from undying.manager.membership.generations import Generations
from undying.protocol.env import PROMETHEUS_DIR_ENV

STRANGER = 54321  # a uid that is not ours (the tests that need it run as root)
URL = "http://127.0.0.1:41234"


def test_the_folder_its_default_an_env_and_off() -> None:
    assert folder({}) == Path(os.path.expanduser(DEFAULT_FOLDER))
    assert folder({PROMETHEUS_DIR_ENV: "  "}) == Path(os.path.expanduser(DEFAULT_FOLDER))
    assert folder({PROMETHEUS_DIR_ENV: "/srv/prom/alice"}) == Path("/srv/prom/alice")
    assert folder({PROMETHEUS_DIR_ENV: "rel"}) == Path(os.getcwd()) / "rel"
    assert folder({PROMETHEUS_DIR_ENV: "off"}) is None and Publisher(env={PROMETHEUS_DIR_ENV: "OFF"}).folder is None
    assert Publisher(env={PROMETHEUS_DIR_ENV: "off"}).publish(URL, "j", "/x") is None


def test_addresses_as_a_scraper_on_this_machine_reaches_them() -> None:
    assert target_address("http://127.0.0.1:8080") == "127.0.0.1:8080"
    assert target_address("http://0.0.0.0:29402") == "127.0.0.1:29402"
    assert target_address("http://[::]:29402") == "[::1]:29402"
    assert target_address("http://10.1.2.3:7") == "10.1.2.3:7"


def test_a_target_file_in_prometheus_file_sd_form_written_whole_and_removed_at_the_end(tmp_path: Path) -> None:
    where = tmp_path / "prom"
    publisher = Publisher(where)
    path = publisher.publish(URL, "job-a", str(tmp_path / "job"))
    assert path == where / f"undying-job-a-{os.getpid()}.json"
    # file_sd's JSON: a list of groups, each with string targets and string labels.
    group = json.loads(path.read_text())
    assert isinstance(group, list) and len(group) == 1 and group[0]["targets"] == ["127.0.0.1:41234"]
    labels = group[0]["labels"]
    assert all(isinstance(v, str) for v in labels.values())
    assert labels["undying_job"] == "job-a" and labels["undying_job_dir"] == str(tmp_path / "job")
    # (who wrote it travels in __meta_ labels only: Prometheus drops them from the series)
    assert {k for k in labels if not k.startswith("__meta_")} == {"undying_job", "undying_job_dir"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and stat.S_IMODE(where.stat().st_mode) == 0o755
    assert sorted(p.name for p in where.iterdir()) == [path.name]  # nothing written aside is left
    target = TargetFile.parse(group)
    assert target is not None and not target.stale()  # this process wrote it
    assert sweep(where) == [] and path.exists()
    publisher.withdraw()
    assert list(where.iterdir()) == []


def _writer(where: Path) -> subprocess.Popen[str]:
    code = ("import sys, time; from pathlib import Path; from undying.jobfiles.prometheus import Publisher; "
            f"print(Publisher(Path({str(where)!r})).publish({URL!r}, 'killed', '/j'), flush=True); time.sleep(60)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_sigkilled_jobs_file_is_recognised_stale_and_the_next_job_removes_it(tmp_path: Path) -> None:
    where = tmp_path / "prom"
    writer = _writer(where)
    try:
        assert writer.stdout is not None
        stale = Path(writer.stdout.readline().strip())
        target = TargetFile.parse(json.loads(stale.read_text()))
        assert target is not None and target.pid == writer.pid and not target.stale()
        assert sweep(where) == []  # alive: kept
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
    assert stale.exists() and target.stale()  # no one removed it: it names a dead process
    mine = Publisher(where).publish(URL, "next", "/n")
    assert mine is not None and not stale.exists() and mine.exists()
    # Another process under a dead writer's PID (a PID reused) does not keep a file alive.
    reused = TargetFile(target.address, "x", "/x", os.getpid(), "1", target.boot)
    assert reused.stale()
    assert TargetFile(target.address, "x", "/x", os.getpid(), target.since, "another-boot").stale()


@pytest.fixture
def root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")


def test_a_strangers_file_a_link_and_a_file_of_another_name_are_never_trusted_or_removed(
        tmp_path: Path, root_only: None) -> None:
    where = tmp_path / "prom"
    where.mkdir()
    dead = TargetFile("127.0.0.1:1", "gone", "/g", 2**22 + 7, "", "").group()  # (no such PID)
    strangers = where / "undying-gone-1.json"
    strangers.write_text(json.dumps(dead))
    os.chown(strangers, STRANGER, STRANGER)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(dead))
    (where / "undying-link-2.json").symlink_to(elsewhere)
    hand_written = where / "my-exporter.json"
    hand_written.write_text(json.dumps(dead))
    ours = where / "undying-ours-3.json"
    ours.write_text(json.dumps(dead))
    assert sweep(where) == [ours]
    assert strangers.exists() and (where / "undying-link-2.json").is_symlink() and elsewhere.exists()
    assert hand_written.exists()
    # A stranger's credential file in the folder is refused, not used.
    (where / CREDENTIAL_FILE).write_text("planted-by-someone-else\n")
    os.chmod(where / CREDENTIAL_FILE, 0o600)
    os.chown(where / CREDENTIAL_FILE, STRANGER, STRANGER)
    with pytest.raises(UsageError, match="another user made it"):
        scrape_credential(where)


def test_a_folder_that_is_not_the_users_alone_gets_no_file_and_gives_no_credential(
        tmp_path: Path, root_only: None, caplog: pytest.LogCaptureFixture) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, STRANGER, STRANGER)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    for where, why in ((theirs, "belongs to"), (shared, "writable by group and others")):
        caplog.clear()
        publisher = Publisher(where)
        with caplog.at_level(logging.WARNING, "undying.prometheus"):
            assert publisher.publish(URL, "j", "/j") is None and publisher.credential() is None
        assert list(where.iterdir()) == []
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and all(why in line and "\n" not in line for line in lines), lines
        assert PROMETHEUS_DIR_ENV in lines[0]


def test_the_scrape_credential_made_once_0600_and_kept(tmp_path: Path) -> None:
    where = tmp_path / "prom"
    first = scrape_credential(where)
    path = where / CREDENTIAL_FILE
    assert len(first) >= 40 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert scrape_credential(where) == first and Publisher(where).credential() == first
    assert sorted(p.name for p in where.iterdir()) == [CREDENTIAL_FILE]
    # One that others can read is known to others: refused (one warning), the job's token only.
    os.chmod(path, 0o644)
    with pytest.raises(UsageError, match="readable by group or others"):
        scrape_credential(where)
    assert Publisher(where).credential() is None


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of 64 KiB, filled to the last byte."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount (a real full filesystem, not a mock)")
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_costs_a_warning_and_leaves_nothing_half_written(
        full_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    publisher = Publisher(full_disk)
    with caplog.at_level(logging.WARNING, "undying.prometheus"):
        assert publisher.publish(URL, "j", "/j") is None
        assert publisher.credential() is None
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("ENOSPC: No space left on device" in line for line in lines), lines
    publisher.withdraw()  # (nothing to remove: no error)


def test_one_node_jobs_side_by_side_each_get_a_free_port_and_a_fixed_one_in_use_is_named() -> None:
    first, second = Generations("a", "127.0.0.1"), Generations("b", "127.0.0.1")
    try:
        ports = {first.serve(0, b"k" * 32), second.serve(0, b"k" * 32)}
        assert len(ports) == 2 and 0 not in ports
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            busy = held.getsockname()[1]
            with pytest.raises(UsageError, match=f"port {busy} is in use; pass --port with a free port, or "
                                                 "drop --port"):
                Generations("c", "127.0.0.1").serve(busy, b"k" * 32)
    finally:
        first.close()
        second.close()
