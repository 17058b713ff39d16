"""Network namespaces by hand: ``ip`` runs, the probe, and what a namespace holds.

Split from :mod:`undying.demo.hosts` so the building block stays apart from the
harness built on it: this module runs ``ip``, says whether test hosts can be
made here (and what to do when not), lists the namespaces a harness made, the
processes inside one, and sweeps the leftovers of dead owners. :class:`Hosts`
uses these; the tests' ``tests/netns.py`` re-exports them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence

from undying.jobfiles.jobdir import pid_alive

__all__ = [
    "BRIDGE",
    "IP",
    "NETNS_DIR",
    "PREFIX",
    "SETUP_TIMEOUT",
    "netns_missing",
    "netns_pids",
    "netns_unavailable_reason",
    "ns_inode",
    "our_namespaces",
    "run_ip",
]

IP = shutil.which("ip") or "ip"  # absolute: a caller's env= without PATH must still find it
PREFIX = "udn"
NETNS_DIR = "/run/netns"
BRIDGE = "br0"
SETUP_TIMEOUT = 20.0  # seconds for one ``ip`` run; generous for a loaded 2-core machine

# udn<pid>x<counter>-<role>: the owner's PID is what lets a later session sweep a dead one's
# leftovers.
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-")


def run_ip(args: Sequence[str], batch: str | None = None) -> None:
    """Run ``ip``; a failure raises with the commands and ip's own message, which say what
    broke."""
    argv = [IP, *args] + (["-batch", "-"] if batch is not None else [])
    done = subprocess.run(argv, input=batch, capture_output=True, text=True,
                          timeout=SETUP_TIMEOUT)
    if done.returncode != 0:
        shown = f"\n{batch}" if batch else ""
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): "
                           f"{done.stderr.strip()}{shown}")


def ns_inode(name: str) -> int | None:
    """The inode of namespace ``name``'s file under :data:`NETNS_DIR`; None when it is gone."""
    try:
        return os.stat(os.path.join(NETNS_DIR, name)).st_ino
    except FileNotFoundError:
        return None


def netns_pids(name: str) -> list[int]:
    """PIDs of the live processes inside namespace ``name`` (what ``ip netns pids`` lists),
    from /proc."""
    inode = ns_inode(name)
    if inode is None:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                pids.append(int(entry))
        except OSError:  # gone meanwhile, or a zombie without namespaces
            continue
    return pids


def our_namespaces(pid: int | None = None) -> list[str]:
    """The namespaces this harness made (for one owner PID, or any), as ``ip netns list``
    shows them."""
    out = subprocess.run([IP, "netns", "list"], capture_output=True, text=True,
                         timeout=SETUP_TIMEOUT).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names
            if (m := _NAME.match(n)) and (pid is None or int(m.group(1)) == pid)]


def _sweep_stale() -> None:
    """Delete namespaces left by a harness whose process died (a killed pytest), never a
    live one's.

    Only names of this harness whose owner PID is gone and which hold no process
    are removed, so a parallel session's hosts are safe.
    """
    for name in our_namespaces():
        m = _NAME.match(name)
        assert m is not None
        if not pid_alive(int(m.group(1))) and not netns_pids(name):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                run_ip(["netns", "del", name])


def netns_missing(euid: int, ip: str | None) -> str | None:
    """What rules test hosts out before anything is tried: not root, or no ``ip``; None when
    neither.

    Split from :func:`netns_unavailable_reason` so the messages can be checked
    for any user without becoming that user.
    """
    if euid != 0:
        return ("test hosts (network namespaces made with `ip netns`) need root, and this "
                f"runs as uid {euid}: run it as root (e.g. with sudo)")
    if ip is None:
        return ("test hosts need the `ip` command, which was not found on PATH: install "
                "iproute2 (e.g. `apt-get install iproute2`)")
    return None


@functools.lru_cache(maxsize=1)
def netns_unavailable_reason() -> str | None:
    """Why test hosts cannot be made here, and what to do; None when they can (probed once
    per process).

    Past the root and ``ip`` checks it makes a throw-away namespace with a
    bridge and a veth pair, since a container may be root yet lack the
    capability; a successful probe also sweeps the leftovers of dead owners.
    """
    missing = netns_missing(os.geteuid(), shutil.which("ip"))
    if missing is not None:
        return missing
    probe = f"{PREFIX}{os.getpid()}x-probe"
    try:
        run_ip([], f"netns add {probe}\nlink add name {BRIDGE} netns {probe} type bridge\n"
                   f"link add name p0 netns {probe} type veth peer name p1 netns {probe}\n")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return (f"cannot create a network namespace with a bridge and a veth pair here ({e}): "
                "run as root on a Linux host whose kernel has network namespaces, veth and "
                "bridge (in a container: with CAP_NET_ADMIN and CAP_SYS_ADMIN, e.g. "
                "--privileged)")
    finally:
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            run_ip(["netns", "del", probe])
    _sweep_stale()
    return None
