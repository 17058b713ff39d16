"""The owner lock of a checkpoint dir or job dir (checkpoint/lock.py), against what a lock must face.

Real processes hold it (a small Python program, no torch), real signals hit
them, real files: the holder SIGKILLed lets the next one in at once, SIGSTOPped
still refuses it, a stranger who writes or replaces the lock file gets nothing,
a full disk under it changes nothing (a real tmpfs, as test_f6_full_disk does),
and the lease an fsspec URL gets follows the same rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from undying.checkpoint import lock
from undying.checkpoint.lock import (
    LOCK_NAME,
    DirInUseError,
    hold,
    read_holder,
    release,
)
from undying.checkpoint.lock_holder import Holder, stale_reason
from undying.checkpoint.store import Store
from undying.config import CheckpointConfig, JobConfig
from undying.jobfiles.events import EventLog, LogReader
from undying.manager.manager import Manager

HOLDER = """
import sys, time
from undying.checkpoint import lock
lock.BEAT_S = 0.2
lock.hold(sys.argv[1], job_id=sys.argv[2], on_lost=lambda reason: print("LOST " + reason, flush=True))
print("HELD", flush=True)
time.sleep(120)
"""


STRANGER = """
import fcntl, os, sys, time
planted = os.path.join(sys.argv[1], "planted")
fd = os.open(planted, os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.replace(planted, os.path.join(sys.argv[1], "undying.lock"))
print("PLANTED", flush=True)
time.sleep(120)
"""


def _line(process: subprocess.Popen[str], timeout: float = 30) -> str:
    """The holder's next line of output, within ``timeout``."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no line from the holder within {timeout}s")
    return process.stdout.readline().strip()


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait(timeout=10)


def _hold_in(root: str, holders: list[subprocess.Popen[str]], job_id: str = "first") -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, root, job_id], stdout=subprocess.PIPE, text=True)
    holders.append(p)
    assert _line(p) == "HELD"
    return p


def _refused(root: str) -> str:
    with pytest.raises(DirInUseError) as e:
        hold(root, job_id="second")
    message = str(e.value)
    assert "\n" not in message and "is in use by" in message and "one job at a time" in message
    return message


def test_the_stale_rule_of_a_url_lease() -> None:
    now = 1000.0
    me = Holder("j", "checkpoint dir", "h1", "boot", 42, 777, "n", 0.0, now - 5)
    alive = {42: 777}

    def started(pid: int) -> int:
        return alive.get(pid, 0)

    def rule(holder: Holder | None, *, age: float | None = 1.0, host: str = "h1", boot: str = "boot") -> str | None:
        return stale_reason(holder, now=now, record_age_s=age, host=host, boot_id=boot, pid_start_here=started)

    assert rule(me) is None  # renewed 5 s ago, its process alive here
    assert rule(me, host="h2") is None  # another host: the beat alone says, and it is fresh
    assert "is gone" in str(rule(Holder("j", "c", "h1", "boot", 43, 1, "n", 0.0, now)))  # SIGKILLed here: at once
    assert "another process" in str(rule(Holder("j", "c", "h1", "boot", 42, 1, "n", 0.0, now)))  # a reused pid
    assert "is gone" not in str(rule(Holder("j", "c", "h1", "old-boot", 43, 1, "n", 0.0, now)))  # (another boot)
    old = Holder("j", "c", "h2", "boot", 42, 777, "n", 0.0, now - lock.STALE_S - 1)
    assert "last renewed" in str(rule(old, host="h1"))  # stopped or gone on another host, past the bound
    assert rule(old, host="h2") is None  # its process exists here (a stopped one too): live, as a local lock
    assert rule(None, age=5.0) is None  # a stranger's bytes over a live lease: its owner writes it again
    assert "unreadable" in str(rule(None, age=lock.STALE_S + 1))


def test_a_live_holder_refuses_even_stopped_and_its_sigkill_lets_the_next_in_at_once(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    root = str(tmp_path / "ckpts")
    first = _hold_in(root, holders)
    assert f"job first (pid {first.pid} on host" in _refused(root)
    first.send_signal(signal.SIGSTOP)  # a paused owner still owns: it may wake up and write
    try:
        assert f"pid {first.pid}" in _refused(root)
    finally:
        first.kill()  # (SIGKILL while stopped)
    first.wait(timeout=10)
    t0 = time.monotonic()
    held = hold(root, job_id="second")  # the kernel dropped the dead holder's lock: no wait, no stale bound
    try:
        assert time.monotonic() - t0 < 2
        assert held.fd is not None and os.pread(held.fd, 4096, 0) == held.holder.to_bytes()
    finally:
        release(root)
    assert not (Path(root) / LOCK_NAME).exists()  # released: the file goes with it


def test_a_stranger_writing_or_replacing_the_lock_file_gets_nothing(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    root = tmp_path / "ckpts"
    first = _hold_in(str(root), holders)
    path = root / LOCK_NAME
    path.write_bytes(b"{not a record")  # scribbled over: the lock is the kernel's, not the words
    assert "another process" in _refused(str(root))
    deadline = time.monotonic() + 10
    while (read_holder(Store.open(str(root))) is None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"job first (pid {first.pid}" in _refused(str(root)), "the holder did not write its record again"

    # Replaced by a file nobody holds: the holder takes the new one (and still refuses the next).
    spare = root / "planted"
    spare.write_bytes(b"")
    os.replace(spare, path)
    deadline = time.monotonic() + 10
    while read_holder(Store.open(str(root))) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"pid {first.pid}" in _refused(str(root))

    # Replaced by one another process holds: the holder has lost the folder, and says so (the job fails).
    spare.write_bytes(b"")
    fd = os.open(spare, os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(spare, path)
        lost = _line(first, timeout=10)
        assert lost.startswith("LOST ") and "was replaced" in lost, lost
    finally:
        os.close(fd)


def test_a_full_disk_under_the_lock_changes_nothing(tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount (a real full filesystem, not a mock)")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        root = disk / "ckpts"
        root.mkdir()
        fd = os.open(disk / "fill", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        first = _hold_in(str(root), holders)  # its record cannot be written: the lock holds without it
        assert (root / LOCK_NAME).stat().st_size == 0
        assert "its lock record is unreadable" in _refused(str(root))
        first.kill()
        first.wait(timeout=10)
        hold(str(root), job_id="second")
        release(str(root))
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_url_lease_refuses_a_second_owner_and_a_killed_owner_on_this_host_is_stale_at_once(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    url = f"local://{tmp_path}/bucket"  # fsspec's local filesystem: a URL store, without a lock primitive
    first = _hold_in(url, holders)
    assert f"job first (pid {first.pid}" in _refused(url)
    first.send_signal(signal.SIGSTOP)
    assert f"pid {first.pid}" in _refused(url)  # its beat is fresh and its process exists
    first.kill()
    first.wait(timeout=10)
    held = hold(url, job_id="second")  # its pid is gone on this host: stale without waiting for the bound
    try:
        # The lease lost: another owner's record where ours was (ours ran out while we were stopped).
        store = held.store
        taker = Holder("third", "checkpoint dir", "elsewhere", "", 1, 1, "other", time.time(), time.time())
        store.write_atomic(store.join(LOCK_NAME), taker.to_bytes())
        assert "was taken by job third" in held.keep()
    finally:
        release(url)
    assert read_holder(Store.open(url)) is not None, "a lease that is not ours any more is not removed"


def test_a_job_whose_checkpoint_dir_is_taken_from_it_fails_with_the_reason(tmp_path: Path) -> None:
    """The manager's side: the lock lost (its file replaced, the new one held by another process) fails the job
    before it saves again, with the reason in its exit and its log."""
    ckpts = tmp_path / "ckpts"
    config = JobConfig(job_id="t", job_dir=str(tmp_path / "job"), nproc_per_node=1,
                       checkpoint=CheckpointConfig(checkpoint_dir=str(ckpts)))
    manager = Manager(config, EventLog(tmp_path / "events.db"))

    async def scenario() -> None:
        assert await manager.checkpoints.find_resume_point() is None
        # Another process plants a lock file of its own in place of the job's, and holds it.
        stranger = subprocess.Popen([sys.executable, "-c", STRANGER, str(ckpts)], stdout=subprocess.PIPE, text=True)
        try:
            assert _line(stranger) == "PLANTED"
            hold(str(ckpts), job_id="t").check()  # the keeper's beat, now
            for _ in range(100):
                await asyncio.sleep(0.05)
                if manager.state.value == "failed":
                    break
        finally:
            stranger.kill()
            stranger.wait(timeout=10)

    try:
        asyncio.run(scenario())
        assert manager.state.value == "failed"
        assert manager.core.exit_reason.startswith(f"checkpoint dir {ckpts} lost: its lock file")
        manager.events.flush()
        with LogReader(tmp_path / "events.db") as reader:
            assert [e.data["path"] for e in reader.events("checkpoint_dir_lost")] == [str(ckpts)]
    finally:
        release(str(ckpts))
        manager.close()


def test_a_relaunch_of_the_same_job_waits_for_a_lease_from_another_host_to_go_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rescheduled pod of the same job (another host: no pid to check) waits out the dead one's lease; another
    job is refused at once. Bounds shortened here (the defaults: renewed every 5 s, stale after 60 s)."""
    monkeypatch.setattr(lock, "STALE_S", 1.0)
    monkeypatch.setattr(lock, "BEAT_S", 0.2)
    url = f"local://{tmp_path}/bucket"
    store = Store.open(url)
    store.makedirs(store.root)
    now = time.time()
    store.write_atomic(store.join(LOCK_NAME), Holder("same", "checkpoint dir", "gone-host", "b", 7, 7, "old", now,
                                                     now).to_bytes())
    t0 = time.monotonic()
    with pytest.raises(DirInUseError, match="in use by job same"):
        hold(url, job_id="other")
    assert time.monotonic() - t0 < 0.9
    held = hold(url, job_id="same")
    try:
        assert time.monotonic() - t0 > 1.0  # (it waited for the lease to go stale)
        assert read_holder(store) == held.holder
    finally:
        release(url)


def test_a_child_forked_by_the_holder_that_exits_leaves_the_lock_alone(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    """A process forked without exec carries the holder's objects and exit handlers: its exit must not remove
    the lock file its parent holds (a second job would then lock a new file beside the live one)."""
    forker = ("import os, sys, time\nfrom undying.checkpoint import lock\nlock.hold(sys.argv[1], job_id='first')\n"
              "pid = os.fork()\nif pid == 0:\n    sys.exit(0)\nos.waitpid(pid, 0)\nprint('HELD', flush=True)\n"
              "time.sleep(120)\n")
    root = tmp_path / "ckpts"
    p = subprocess.Popen([sys.executable, "-c", forker, str(root)], stdout=subprocess.PIPE, text=True)
    holders.append(p)
    assert _line(p) == "HELD"
    assert (root / LOCK_NAME).exists()
    assert f"job first (pid {p.pid}" in _refused(str(root))


def test_a_restarted_manager_takes_its_checkpoint_dir_back_or_fails_if_another_job_has_it(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    """``undying manager`` carrying a job on from its log: it holds the checkpoint dir again, or fails when
    another job took it while it was down (in the background: the agents reconnect meanwhile)."""
    ckpts = tmp_path / "ckpts"
    intruder = _hold_in(str(ckpts), holders, job_id="intruder")  # took the folder while the manager was down

    def restarted(name: str) -> Manager:
        config = JobConfig(job_id="t", job_dir=str(tmp_path / name), nproc_per_node=1,
                           checkpoint=CheckpointConfig(checkpoint_dir=str(ckpts)))
        return Manager(config, EventLog(tmp_path / f"{name}.db"))

    async def reown(manager: Manager) -> None:
        manager.checkpoints.reown()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if manager.state.value == "failed" or manager.checkpoints.owned:
                break

    refused = restarted("a")
    asyncio.run(reown(refused))
    assert refused.state.value == "failed" and "is in use by job intruder" in refused.core.exit_reason
    refused.close()
    intruder.kill()
    intruder.wait(timeout=10)
    again = restarted("b")
    try:
        asyncio.run(reown(again))
        assert again.checkpoints.owned and again.state.value == "starting"
    finally:
        release(str(ckpts))
        again.close()


def test_a_launch_of_the_same_job_waits_for_a_local_lock_another_host_holds(
    tmp_path: Path, holders: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared folder (NFS) locked from another host by the same job: its relaunch here waits for the lock to
    go (the server drops a dead client's locks when its lease ends) instead of failing; another job does not
    wait. The other host is a process whose record names another hostname; bounds shortened."""
    monkeypatch.setattr(lock, "STALE_S", 5.0)
    monkeypatch.setattr(lock, "BEAT_S", 0.2)
    root = str(tmp_path / "shared")
    elsewhere = subprocess.Popen([sys.executable, "-c", "import socket\nsocket.gethostname = lambda: 'otherhost'\n"
                                  + HOLDER, root, "same"], stdout=subprocess.PIPE, text=True)
    holders.append(elsewhere)
    assert _line(elsewhere) == "HELD"
    t0 = time.monotonic()
    with pytest.raises(DirInUseError, match="in use by job same .* on host otherhost"):
        hold(root, job_id="other")
    assert time.monotonic() - t0 < 1
    killer = threading.Timer(1.0, elsewhere.kill)
    killer.start()
    try:
        held = hold(root, job_id="same")
        assert 0.9 < time.monotonic() - t0 < 5, "it did not wait for the lock, or waited past its release"
        assert held.fd is not None
    finally:
        killer.join()
        release(root)


def test_a_zombie_launcher_holds_no_job_dir(tmp_path: Path) -> None:
    """A launcher SIGKILLed with its parent stays a zombie until whoever adopts it collects it
    (seen on a Slurm node lost: its launcher's pid still answered 20 s later). It exited and holds
    nothing: its job dir is free for the next launch, as a gone one's is."""
    from undying.checkpoint.lock import release_all
    from undying.errors import UsageError
    from undying.jobfiles.jobdir import JobDir, pid_alive
    from undying.procfs import is_zombie

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        job_dir = JobDir(tmp_path / "job")
        job_dir.path.mkdir(mode=0o700)
        job_dir.manager_file.write_text(json.dumps({"pid": child.pid}))
        with pytest.raises(UsageError, match="belongs to a running job"):
            job_dir.prepare()  # (its launcher runs)
        release_all()
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not is_zombie(child.pid) and time.monotonic() < deadline:  # (not collected: a zombie)
            time.sleep(0.01)
        assert is_zombie(child.pid)
        os.kill(child.pid, 0)  # its pid still answers
        assert not pid_alive(child.pid)
        job_dir.prepare()  # the next launch takes the job dir
    finally:
        release_all()
        child.kill()
        child.wait(timeout=10)
