"""Test hosts (tests/netns.py): real separate network hosts on one machine, and gloo across them.

What these pin down for the multi-node tests built on them:
- a process started with ``hosts.popen`` is the program itself (``ip netns exec``
  execs), inside the host's namespace, in a session of its own;
- ``kill_host`` leaves nothing alive in the host, not even a child that left
  its process group, and its processes die as one (none outlives another long
  enough to act on its death, none is woken by a group its parent's death
  orphans); ``close`` deletes every namespace, link and process;
- torch.distributed runs across hosts: a TCPStore in host 0, gloo ranks in
  hosts 1 and 2, when ``GLOO_SOCKET_IFNAME`` names each host's veth (given, or
  found with undying.agent.netif as the agent will). Without it gloo binds to
  the address of the machine's hostname, which every namespace shares and which
  is not on any veth (here ``vm`` -> 127.0.0.1; where it names the machine's own
  address, that address is absent from the namespace and gloo falls back to
  127.0.0.1): each rank advertises 127.0.0.1, its peer dials its own loopback,
  gets "Connection refused", and the group never forms;
- ``cut`` stalls a TCP connection across the host's link without breaking it,
  ``heal`` lets the same connection go on.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.netns import NETNS_DIR, Hosts, netns_pids, our_namespaces, requires_netns

pytestmark = requires_netns

STORE_PORT = 29500  # every set of hosts has its own port space: a fixed port cannot collide

STORE = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("0.0.0.0", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
print("ready", flush=True)
time.sleep(600)
"""

RANK = """
import datetime, os, sys
host, port, rank, world, iface = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if iface == "derive":  # what the agent will do when the user did not set it
    from undying.agent.netif import interface_for, source_address
    iface = interface_for(source_address(host))
    print("derived", iface, flush=True)
if iface != "unset":
    os.environ["GLOO_SOCKET_IFNAME"] = iface
import torch, torch.distributed as dist
store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=20))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=8))
t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
dist.all_reduce(t)
print("result", *t.tolist(), flush=True)
dist.destroy_process_group()
from undying.worker.boot import end_process
end_process()  # as a worker ends, not by the interpreter's teardown of gloo's threads
"""

ECHO_SERVER = """
import socket, sys
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    conn, peer = srv.accept()
    print("accepted", peer[0], peer[1], flush=True)
    while data := conn.recv(4096):
        conn.sendall(data)
"""

# Sends each stdin line and waits for its echo; reports a stall (no echo for 1 s) without giving up.
ECHO_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
print("connected", s.getsockname()[1], flush=True)
s.settimeout(1.0)
for line in sys.stdin:
    s.sendall(line.encode())
    got, stalled, start = b"", False, time.monotonic()
    while not got.endswith(b"\\n"):
        if time.monotonic() - start > 30:
            print("gave up", flush=True); sys.exit(1)
        try:
            chunk = s.recv(4096)
        except TimeoutError:
            if not stalled:
                print("stalled", flush=True)
            stalled = True
            continue
        if not chunk:
            print("closed", flush=True); sys.exit(1)
        got += chunk
    print("echo", got.decode().strip(), "stalled" if stalled else "direct", round(time.monotonic() - start, 2), flush=True)
"""


class Lines:
    """A process's stdout lines, read by a thread, so every wait on them can have a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=self._pump, args=(stdout,), daemon=True).start()

    def _pump(self, stdout: object) -> None:
        for line in stdout:  # type: ignore[attr-defined]
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def expect(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first new line matching ``pattern``; fails with everything seen if none comes in time."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout}s; saw {self.seen}") from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.poll()}) before a line matching {pattern!r}; "
                                     f"saw {self.seen}")
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m

    def drain(self) -> list[str]:
        """The lines that came since the last look, without waiting."""
        new: list[str] = []
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return new
            if line is not None:
                self.seen.append(line)
                new.append(line)


def _python(hosts: Hosts, i: int, code: str, *args: str, **kwargs: object) -> Lines:
    proc = hosts.popen(i, [sys.executable, "-u", "-c", code, *args], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, **kwargs)
    return Lines(proc)


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _net_inode_of_thread() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


def _net_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_setup_and_close_leave_nothing(make_hosts: Callable[[int], Hosts]) -> None:
    hosts = make_hosts(4)
    names = [hosts.bridge_ns, *(hosts.name(i) for i in range(4))]
    assert set(names) <= set(our_namespaces(os.getpid()))
    assert len({hosts.addr(i) for i in range(4)}) == 4 and hosts.addr(0).startswith("10.")
    root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    before = [_python(hosts, i, "import time; print('up', flush=True); time.sleep(600)") for i in range(4)]
    for lines in before:
        lines.expect("^up$", 30)
    pids = [lines.proc.pid for lines in before]

    hosts.close()

    assert all(lines.proc.poll() is not None for lines in before), "a host process outlived close()"
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert not set(names) & set(our_namespaces()), "ip netns list still shows a namespace of these hosts"
    assert not any(os.path.exists(os.path.join(NETNS_DIR, n)) for n in names)
    # Nothing was ever made in the root namespace, and nothing of ours is there now.
    after = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    ours = re.compile(r"^\d+: (br0|port\d+|veth-h\d+)[@:]", re.M)
    assert not ours.search(root_links) and not ours.search(after), after
    hosts.close()  # idempotent


def test_popen_tracks_the_program_itself_in_its_host(make_hosts: Callable[[int], Hosts]) -> None:
    hosts = make_hosts(2)
    lines = _python(hosts, 1, "import os; print('pid', os.getpid(), os.getsid(0), flush=True); "
                              "import time; time.sleep(600)")
    m = lines.expect(r"^pid (\d+) (\d+)$", 30)
    # ip netns exec execs in place: the PID we hold is the program's, and it leads its own session.
    assert int(m.group(1)) == lines.proc.pid
    assert int(m.group(2)) == lines.proc.pid and os.getpgid(lines.proc.pid) == lines.proc.pid
    assert os.readlink(f"/proc/{lines.proc.pid}/exe") == os.path.realpath(sys.executable)
    assert _net_inode(lines.proc.pid) == os.stat(os.path.join(NETNS_DIR, hosts.name(1))).st_ino
    assert _net_inode(lines.proc.pid) != _net_inode(os.getpid())
    assert hosts.pids(1) == [lines.proc.pid] and hosts.pids(0) == []


def test_kill_host_kills_children_that_left_the_group(make_hosts: Callable[[int], Hosts]) -> None:
    hosts = make_hosts(2)
    # A parent, a child in its group, and a grandchild in a session of its own (out of the group's reach).
    code = """
import subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("kids", kid.pid, stray.pid, flush=True)
time.sleep(600)
"""
    lines = _python(hosts, 1, code)
    other = _python(hosts, 0, "import time; print('up', flush=True); time.sleep(600)")
    m = lines.expect(r"^kids (\d+) (\d+)$", 30)
    other.expect("^up$", 30)
    family = [lines.proc.pid, int(m.group(1)), int(m.group(2))]
    assert os.getpgid(family[2]) != lines.proc.pid
    assert sorted(hosts.pids(1)) == sorted(family)

    hosts.kill_host(1)

    assert hosts.pids(1) == []
    assert lines.proc.poll() == -9
    _wait(lambda: not any(_alive(p) for p in family), 10, "host 1's processes to be gone")
    assert other.proc.poll() is None, "killing host 1 touched host 0"
    assert netns_pids(hosts.name(0)) == [other.proc.pid]


WATCHER = """
import os, select, sys
fd = os.pidfd_open(int(sys.argv[1]))
print("watching", flush=True)
select.select([fd], [], [])
open(sys.argv[2], "w").write("dead")
"""

# A victim, three hundred processes started after it, and a watcher of the victim, last: each in a
# session of its own, as Slurm's daemons start theirs (out of reach of one process group's kill).
FAMILY = """
import subprocess, sys, time
victim = subprocess.Popen(["sleep", "600"], start_new_session=True)
fillers = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(300)]
watcher = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(victim.pid), sys.argv[2]],
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
assert watcher.stdout.readline() == "watching\\n"
print("ready", victim.pid, watcher.pid, flush=True)
time.sleep(600)
"""


def test_a_lost_host_s_processes_die_as_one_so_none_reacts_to_another_s_death(
        make_hosts: Callable[[int], Hosts], tmp_path: Path) -> None:
    """As on a machine that loses power, no process of a killed host outlives another: a
    watcher that acts the moment the process it watches dies (as Slurm's srun helper does,
    SIGKILLing the step's tasks on every other node when srun dies) never gets to act, though
    three hundred processes started between the two would give it time if they died one by one."""
    hosts = make_hosts(2)
    marker = tmp_path / "the-watcher-saw-it-die"
    lines = _python(hosts, 1, FAMILY, WATCHER, str(marker))
    m = lines.expect(r"^ready (\d+) (\d+)$", 60)
    victim, watcher = int(m.group(1)), int(m.group(2))
    # (the victim has the lower PID, so a one-by-one kill from /proc's order would reach it
    # first; where PIDs wrapped between the two, the test still holds but tells less)

    hosts.kill_host(1)

    assert hosts.pids(1) == []
    assert not _alive(victim) and not _alive(watcher)
    assert not marker.exists(), "the watcher outlived the process it watched and acted"


# A process group like a Slurm batch shell's: a leader (here the host's own process, a session
# leader) whose child is in a group of its own in the same session, with that child's child in
# its group, ignoring SIGHUP and acting when its parent dies (as srun and its helper do).
# Three hundred processes started before them stand between the leader and the two in /proc.
ORPHANED = """
import os, signal, subprocess, sys, time
fillers = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(300)]
r, w = os.pipe()
if os.fork() == 0:
    os.setpgid(0, 0)
    if os.fork() == 0:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        os.close(w)
        print("watching", os.getpid(), flush=True)
        os.read(r, 1)  # the end of file: its parent died
        open(sys.argv[1], "w").write("dead")
        os._exit(0)
    os.close(r)
    time.sleep(600)
    os._exit(0)
os.close(r)
os.close(w)
time.sleep(600)
"""


def test_a_lost_host_s_stopped_processes_are_killed_children_first(
        make_hosts: Callable[[int], Hosts], tmp_path: Path) -> None:
    """Stopped first, a host's processes are killed children before parents: a parent killed
    first orphans its child's process group, and the kernel wakes a stopped group it orphans
    (SIGHUP, then SIGCONT), so a watcher that ignores SIGHUP would run again and act."""
    hosts = make_hosts(2)
    marker = tmp_path / "the-watcher-saw-its-parent-die"
    lines = _python(hosts, 1, ORPHANED, str(marker))
    watcher = int(lines.expect(r"^watching (\d+)$", 60).group(1))

    hosts.kill_host(1)

    assert hosts.pids(1) == [] and not _alive(watcher)
    assert not marker.exists(), "the watcher was woken by its orphaned group and acted"


def test_the_test_talks_to_a_host_from_inside_and_a_new_host_joins(make_hosts: Callable[[int], Hosts]) -> None:
    hosts = make_hosts(2)
    home = _net_inode_of_thread()
    new = hosts.add_host()
    assert new == 2 and len(hosts) == 3 and hosts.addr(2) not in (hosts.addr(0), hosts.addr(1))
    server = _python(hosts, new, ECHO_SERVER, "7000")
    server.expect("^listening$", 30)
    with hosts.inside(0):
        assert _net_inode_of_thread() == os.stat(os.path.join(NETNS_DIR, hosts.name(0))).st_ino
        conn = socket.create_connection((hosts.addr(new), 7000), timeout=10)
    assert _net_inode_of_thread() == home
    with conn:  # the socket stays in host 0 after the block
        assert conn.getsockname()[0] == hosts.addr(0)
        conn.sendall(b"hello\n")
        assert conn.recv(100) == b"hello\n"
    assert server.expect(r"^accepted ", 10).string.split()[1] == hosts.addr(0)


def test_gloo_all_reduce_across_hosts(make_hosts: Callable[[int], Hosts]) -> None:
    """Rank 0 is told its interface; rank 1 finds its own with netif, as the agent will."""
    hosts = make_hosts(3)
    store = _python(hosts, 0, STORE, str(STORE_PORT))
    store.expect("^ready$", 60)
    ranks = [_python(hosts, rank + 1, RANK, hosts.addr(0), str(STORE_PORT), str(rank), "2", iface)
             for rank, iface in enumerate([hosts.ifname(1), "derive"])]
    assert ranks[1].expect(r"^derived (\S+)$", 60).group(1) == hosts.ifname(2)
    for lines in ranks:
        assert lines.expect(r"^result ", 60).string.split()[1:] == ["3.0", "30.0"]
        assert lines.proc.wait(timeout=30) == 0, lines.seen


def test_gloo_without_socket_ifname_binds_loopback_and_fails(make_hosts: Callable[[int], Hosts]) -> None:
    """The finding behind netif: namespaces share the hostname, so gloo picks an unreachable address."""
    hosts = make_hosts(3)
    store = _python(hosts, 0, STORE, str(STORE_PORT))
    store.expect("^ready$", 60)
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    ranks = [_python(hosts, rank + 1, RANK, hosts.addr(0), str(STORE_PORT), str(rank), "2", "unset", env=env)
             for rank in (0, 1)]
    # At least one rank fails to reach its peer's advertised 127.0.0.1; none gets a result.
    # The other may wait for its own timeout: the test stops waiting once the first has failed.
    _wait(lambda: any(r.proc.poll() is not None for r in ranks), 60, "a rank to fail")
    failed = next(r for r in ranks if r.proc.poll() is not None)
    with pytest.raises(AssertionError, match="exited"):
        failed.expect(r"^result ", 30)
    assert failed.proc.returncode != 0
    assert "127.0.0.1" in "\n".join(failed.seen), failed.seen
    hosts.kill_host(1)
    hosts.kill_host(2)
    assert not any(line.startswith("result") for r in ranks for line in r.seen)


def test_cut_stalls_a_connection_and_heal_resumes_it(make_hosts: Callable[[int], Hosts]) -> None:
    hosts = make_hosts(2)
    server = _python(hosts, 0, ECHO_SERVER, "7000")
    server.expect("^listening$", 30)
    client_proc = hosts.popen(1, [sys.executable, "-u", "-c", ECHO_CLIENT, hosts.addr(0), "7000"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = Lines(client_proc)
    port = client.expect(r"^connected (\d+)$", 30).group(1)
    assert server.expect(r"^accepted ", 10).string.split()[1:] == [hosts.addr(1), port]
    assert client_proc.stdin is not None

    def send(word: str) -> None:
        assert client_proc.stdin is not None
        client_proc.stdin.write(word + "\n")
        client_proc.stdin.flush()

    send("before")
    assert client.expect(r"^echo ", 10).string.split()[1:3] == ["before", "direct"]

    hosts.cut(1)
    send("during")
    client.expect(r"^stalled$", 10)
    time.sleep(1.0)  # still cut: nothing may get through meanwhile
    assert client.drain() == []
    hosts.heal(1)
    assert client.expect(r"^echo ", 20).string.split()[1:3] == ["during", "stalled"]

    send("after")
    assert client.expect(r"^echo ", 10).string.split()[1:3] == ["after", "direct"]
    # The same connection all along: the server never accepted another.
    assert [line for line in server.seen if line.startswith("accepted")] == [f"accepted {hosts.addr(1)} {port}"]
    client_proc.stdin.close()
    assert client_proc.wait(timeout=10) == 0
