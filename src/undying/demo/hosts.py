"""Test hosts: network namespaces on one private bridge, so node loss and partitions are real.

Used by ``undying demo --fault node-loss`` at run time and by the multi-node
tests (``tests/netns.py`` re-exports this module and adds the pytest fixture).

Each :class:`Hosts` is a small network of its own: one namespace per host, each
with one veth whose other end is a port of a bridge that lives in a namespace
of its own. Nothing is created in the machine's root namespace, so its real
network never changes, and two sets of hosts (another test, another session)
never see each other: they may even use the same ports. Namespace names carry
the creating process's PID and a counter, so parallel sessions never collide.

Every process started through :meth:`Hosts.popen` runs in a session of its
own, so :meth:`Hosts.kill_host` (a node lost) and :meth:`Hosts.close` can kill
it by PID and process group; they also kill, by PID, any other process found
inside the host's namespace (a child that left the group still dies with its
host). A lost host's processes are all stopped before any is killed, so none
outlives another long enough to react to its death, as on a machine that loses
power. :meth:`Hosts.cut` / :meth:`Hosts.heal` take a host's bridge port down
and up: a partition, with the host's own interface and addresses left as they
were. :meth:`Hosts.inside` runs the caller's own code in a host (sockets opened
there belong to it: to call a manager's HTTP API), :meth:`Hosts.add_host` plugs
in one more host (a replacement node).

Setup is a handful of ``ip -batch`` runs (tens of milliseconds for four hosts).
Root, ``ip`` and namespace support are required:
:func:`undying.demo.namespaces.netns_unavailable_reason` says which is missing
and what to do about it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import ipaddress
import itertools
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any

from undying.demo.namespaces import (
    BRIDGE,
    IP,
    NETNS_DIR,
    PREFIX,
    SETUP_TIMEOUT,
    netns_pids,
    netns_unavailable_reason,
    ns_inode,
    run_ip,
)
from undying.procfs import parent_pid, process_state

__all__ = ["Hosts"]

CLONE_NEWNET = 0x40000000
KILL_TIMEOUT = 10.0

_counter = itertools.count()


def _children_first(pids: list[int]) -> list[int]:
    """``pids`` ordered so that each comes before its parent (the deepest first)."""
    parent = {pid: ppid for pid in pids if (ppid := parent_pid(pid)) is not None}

    def depth(pid: int) -> int:
        d = 0
        while (pid := parent.get(pid, 0)) in parent and d < len(parent):
            d += 1
        return d

    return sorted(parent, key=depth, reverse=True)


def _setns(fd: int, what: str) -> None:
    setns = getattr(os, "setns", None)  # Python 3.12+
    if setns is not None:
        setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot enter the network namespace of {what}: {os.strerror(err)}")


def _root_subnets() -> list[ipaddress.IPv4Network]:
    out = subprocess.run([IP, "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=SETUP_TIMEOUT).stdout
    return [ipaddress.IPv4Interface(m).network for m in re.findall(r"inet (\S+)", out)]


def _pick_subnet(tag: str) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 derived from the tag (so parallel sets differ), skipping the machine's own
    networks.

    The hosts cannot reach the root namespace anyway; a distinct subnet keeps
    addresses in logs unambiguous and never shadows a real network if a test
    ever bridges out.
    """
    taken = _root_subnets()
    seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:4], "big")
    for k in range(256 * 128):
        n = (seed + k) % (128 * 256)
        net = ipaddress.IPv4Network(f"10.{128 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free 10.128.0.0/9 subnet for test hosts; the machine's own addresses "
                       "cover it all")


class Hosts:
    """N test hosts (network namespaces) on one private bridge; see the module docstring.

    Host i is namespace ``name(i)``, its interface ``ifname(i)`` holds
    ``addr(i)`` (10.x.y.(i+1)/24), ``lo`` is up. Use it as a context manager or
    call :meth:`close` (the tests' ``make_hosts`` fixture does it even when a test fails).
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"Hosts(n={n}): ask for at least one host")
        reason = netns_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        # A leftover of a dead session with a reused PID may hold the name: take the next.
        while True:
            self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
            if not os.path.exists(os.path.join(NETNS_DIR, f"{self.tag}-br")):
                break
        self.bridge_ns = f"{self.tag}-br"
        self.subnet = _pick_subnet(self.tag)
        self._names: list[str] = []
        self._procs: list[list[subprocess.Popen[Any]]] = []
        self._closed = False
        try:
            run_ip([], f"netns add {self.bridge_ns}\n"
                       f"link add name {BRIDGE} netns {self.bridge_ns} type bridge\n")
            run_ip(["-n", self.bridge_ns], f"link set lo up\nlink set {BRIDGE} up\n")
            self._add(n)
        except BaseException:
            self.close()
            raise

    # -- topology -------------------------------------------------------------------------------

    def _add(self, count: int) -> list[int]:
        first = len(self._names)
        new = list(range(first, first + count))
        if new[-1] + 2 > 254:
            raise ValueError(f"a /24 holds at most 253 test hosts; asked for host {new[-1]}")
        for i in new:
            self._names.append(f"{self.tag}-h{i}")
            self._procs.append([])
        create = "".join(
            f"netns add {self.name(i)}\n"
            f"link add name {self._port(i)} netns {self.bridge_ns} type veth"
            f" peer name {self.ifname(i)} netns {self.name(i)}\n"
            for i in new)
        run_ip([], create)
        # The bridge's ports and every host's addresses are set up by one ``ip`` each, all at once.
        ports = "".join(f"link set {self._port(i)} master {BRIDGE}\nlink set {self._port(i)} up\n"
                        for i in new)
        jobs = [(["-n", self.bridge_ns], ports)]
        jobs += [(["-n", self.name(i)],
                  f"link set lo up\n"
                  f"addr add {self.addr(i)}/{self.subnet.prefixlen} dev {self.ifname(i)}\n"
                  f"link set {self.ifname(i)} up\n") for i in new]
        running = [(a, b, subprocess.Popen([IP, *a, "-batch", "-"], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True))
                   for a, b in jobs]
        failures = []
        try:
            for args, batch, p in running:
                _, err = p.communicate(batch, timeout=SETUP_TIMEOUT)
                if p.returncode != 0:
                    failures.append(f"`ip {' '.join(args)} -batch -` failed ({p.returncode}): "
                                    f"{err.strip()}\n{batch}")
        finally:
            for _, _, p in running:  # after a timeout: none of them outlives the failed setup
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if failures:
            raise RuntimeError("\n".join(failures))
        return new

    def add_host(self) -> int:
        """One more host on the same bridge (a replacement node joining); returns its index."""
        if self._closed:
            raise RuntimeError(f"hosts {self.tag} are closed; make a new Hosts")
        return self._add(1)[0]

    def __len__(self) -> int:
        return len(self._names)

    def _check(self, i: int) -> None:
        if not 0 <= i < len(self._names):
            raise IndexError(f"no test host {i}: hosts {self.tag} has {len(self._names)} "
                             f"(0..{len(self._names) - 1})")

    def name(self, i: int) -> str:
        """Host i's namespace name (for ``ip netns exec`` / ``ip -n`` by hand)."""
        self._check(i)
        return self._names[i]

    def addr(self, i: int) -> str:
        """Host i's IPv4 address on the bridge."""
        self._check(i)
        return str(self.subnet.network_address + i + 1)

    def ifname(self, i: int) -> str:
        """The name of host i's veth inside its namespace (distinct per host, so a wrong pick
        shows)."""
        self._check(i)
        return f"veth-h{i}"

    def _port(self, i: int) -> str:
        return f"port{i}"

    # -- processes ------------------------------------------------------------------------------

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host i; takes :class:`subprocess.Popen`'s keyword arguments.

        ``ip netns exec`` switches namespace and then execs ``argv`` in the same
        process (no fork), so the returned Popen's PID is the program's own. It
        always runs in a new session (its PID is its process group), so a kill
        of the group reaches the children that stayed in it.
        """
        self._check(i)
        if self._closed:
            raise RuntimeError(f"hosts {self.tag} are closed; make a new Hosts")
        if not argv:
            raise ValueError("popen needs a command: argv is empty")
        if (kwargs.get("start_new_session") is False or "preexec_fn" in kwargs
                or "process_group" in kwargs):
            raise ValueError("popen starts every process in a session of its own (so kills "
                             "reach its children); drop start_new_session=False / preexec_fn / "
                             "process_group")
        kwargs["start_new_session"] = True
        proc: subprocess.Popen[Any] = subprocess.Popen(
            [IP, "netns", "exec", self.name(i), *argv], **kwargs)
        self._procs[i].append(proc)
        return proc

    @contextlib.contextmanager
    def inside(self, i: int) -> Iterator[None]:
        """Run the test's own code in host i: sockets the calling thread opens in this block
        live there.

        For a test that talks to a server in a host (the manager's HTTP API)
        without a subprocess. Only the calling thread switches (setns), and it
        switches back on exit; a socket keeps its host after the block, so a
        connection made inside may be used outside.
        """
        self._check(i)
        with (open(os.path.join(NETNS_DIR, self.name(i))) as target,
              open("/proc/thread-self/ns/net") as home):
            _setns(target.fileno(), self.name(i))
            try:
                yield
            finally:
                _setns(home.fileno(), "the test's own network namespace")

    def pids(self, i: int) -> list[int]:
        """Every live process inside host i, whoever started it."""
        return netns_pids(self.name(i))

    def kill_host(self, i: int) -> None:
        """Lose host i: every process in it stops at once, then dies.

        A machine that loses power takes all its processes in the same instant, so
        none sees another die first. Killed one by one, a process that outlives its
        neighbour by a moment reacts to that death over the network (Slurm's ``srun``
        leaves a helper that, when ``srun`` dies, SIGKILLs the step's tasks on every
        other node). So each process is first stopped (SIGSTOP, until a pass over the
        host finds none left running), then SIGKILLed children before parents: a
        parent killed first would leave its children's process group orphaned, and
        the kernel wakes a stopped group it orphans (SIGHUP, then SIGCONT), so a
        stopped ``srun`` helper would run again and act.

        Returns once none is left; the host's namespace and link stay, empty (a
        dead machine still plugged in). Raises if a process survives.
        """
        self._check(i)
        deadline = time.monotonic() + KILL_TIMEOUT
        self._freeze(i, deadline)
        left = self.pids(i)
        while left and time.monotonic() < deadline:
            for pid in _children_first(left):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
            left = self.pids(i)
        procs = self._procs[i]
        for proc in procs:  # (and what is left of their process groups, wherever it is now)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        for proc in procs:  # reap our own children so none lingers as a zombie
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if left:
            raise RuntimeError(f"host {i} ({self.name(i)}): processes {left} survived SIGKILL "
                               f"for {KILL_TIMEOUT}s")

    def _freeze(self, i: int, deadline: float) -> None:
        """SIGSTOP every process in host i, again for any that a running one forked
        meanwhile, until all are stopped (or ``deadline``: the kill goes on regardless)."""
        while time.monotonic() < deadline:
            running = [pid for pid in self.pids(i)
                       if process_state(pid) not in ("T", "t", "Z", "X", "?")]
            if not running:
                return
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            time.sleep(0.001)  # (a stop lands when the process next runs)

    # -- network faults -------------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Partition host i: its bridge port goes down, so no packet passes either way.

        Host i keeps its interface, address and routes (its link shows no
        carrier, like a pulled cable); established connections stall and
        retransmit, new ones time out. :meth:`heal` reconnects it.
        """
        self._check(i)
        run_ip(["-n", self.bridge_ns, "link", "set", self._port(i), "down"])

    def heal(self, i: int) -> None:
        """Reconnect host i after :meth:`cut`; stalled connections resume at their next
        retransmit."""
        self._check(i)
        run_ip(["-n", self.bridge_ns, "link", "set", self._port(i), "up"])

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in every host, delete every namespace (their veths and the bridge
        go with them). Idempotent; raises if anything is left, naming it."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for i in range(len(self._names)):
            try:
                self.kill_host(i)
            except RuntimeError as e:
                errors.append(str(e))
        names = [n for n in [self.bridge_ns, *self._names] if ns_inode(n) is not None]
        if names:
            try:
                run_ip(["-force"], "".join(f"netns del {n}\n" for n in names))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                errors.append(str(e))
        left = [n for n in [self.bridge_ns, *self._names] if ns_inode(n) is not None]
        if left:
            errors.append(f"namespaces not deleted: {left}")
        if errors:
            raise RuntimeError(f"cleaning up test hosts {self.tag}: " + "; ".join(errors))

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Hosts({self.tag}, {len(self)} hosts on {self.subnet})"
