"""Which local address and interface reach a given host.

gloo binds to the address of the machine's hostname unless ``GLOO_SOCKET_IFNAME``
names an interface. Where the hostname resolves to loopback (common in
containers, and in network namespaces, which share the machine's hostname)
every rank advertises 127.0.0.1 and peers on other nodes cannot connect. The
interface that reaches the manager is the one the job's traffic should use,
so the agent asks the kernel which source address it would pick for the
manager and which interface holds that address. No packet is sent and no
subprocess is run.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import struct

__all__ = ["gloo_interface_env", "interface_for", "source_address"]

log = logging.getLogger("undying.agent.netif")

SIOCGIFADDR = 0x8915  # linux/sockios.h: get an interface's (primary) IPv4 address
_IFNAMSIZ = 16


def source_address(remote_host: str) -> str:
    """The local IP address the kernel would use as source to reach ``remote_host`` (a name or an
    IP).

    A UDP socket's ``connect`` only runs the route lookup: nothing goes on the wire.
    """
    try:
        infos = socket.getaddrinfo(remote_host, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve host {remote_host!r}: {e.strerror}; "
                         f"pass an IP address or a name this machine can resolve") from e
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.connect(sockaddr)
            except OSError as e:  # no route in this family: try the next address
                last = e
                continue
            return str(sock.getsockname()[0])
    reason = (errno.errorcode.get(last.errno, str(last.errno)) if last and last.errno
              else "no address")
    raise OSError(last.errno if last else errno.EHOSTUNREACH,
                  f"no route from this host to {remote_host!r} "
                  f"({reason}: {last.strerror if last else ''}); "
                  f"check that it is up and on a network this host is connected to")


def interface_for(address: str) -> str | None:
    """The name of the interface whose IPv4 address is ``address``, or None (no such interface, or
    IPv6).

    SIOCGIFADDR gives each interface's primary address; a secondary address
    added without a label is not seen, which is fine for the agent's use: the
    route to the manager takes the primary address as its source.
    """
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        # not an IPv4 address: gloo finds IPv6 ones from the interface name, not asked here
        return None
    if address.count(".") != 3:  # inet_aton also takes shorthands like "127.1"
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[: _IFNAMSIZ - 1])
            try:
                answer = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:  # EADDRNOTAVAIL: the interface has no IPv4 address
                continue
            # struct ifreq: the name (16 bytes), then a sockaddr_in: family (2), port (2), address
            # (4).
            if answer[_IFNAMSIZ + 4: _IFNAMSIZ + 8] == wanted:
                return name
    return None


def gloo_interface_env(manager_host: str, node: int) -> dict[str, str]:
    """Gloo binds where the hostname resolves unless told: point it at the interface toward the
    manager."""
    if "GLOO_SOCKET_IFNAME" in os.environ or manager_host in ("127.0.0.1", "localhost", "::1"):
        return {}
    try:
        name = interface_for(source_address(manager_host))
    except Exception as e:  # no route yet, an exotic platform: gloo's own choice stands
        log.info("node %d: no interface found toward %s (%s)", node, manager_host, e)
        return {}
    if not name or name == "lo":
        return {}
    log.info("node %d: GLOO_SOCKET_IFNAME=%s (the interface toward the manager)", node, name)
    return {"GLOO_SOCKET_IFNAME": name}
