"""undying.agent.netif: the local address and interface that reach a host, on loopback and on test hosts."""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import pytest

from tests.netns import Hosts, requires_netns
from undying.agent import netif
from undying.agent.netif import interface_for, source_address


def test_loopback_reaches_itself_through_lo() -> None:
    assert source_address("127.0.0.1") == "127.0.0.1"
    assert source_address("localhost") in ("127.0.0.1", "::1")
    assert interface_for("127.0.0.1") == "lo"


def test_an_address_no_interface_holds_has_no_interface() -> None:
    held = {interface_for(source_address("127.0.0.1"))}
    assert held == {"lo"}
    assert interface_for("203.0.113.77") is None  # TEST-NET-3: never assigned to a real interface
    assert interface_for("::1") is None  # IPv6 is not looked up
    assert interface_for("127.1") is None  # inet_aton would take this shorthand: refuse it
    assert interface_for("not an address") is None


def test_every_interface_with_an_ipv4_address_is_found_by_it() -> None:
    """Against the kernel's own list (``ip -j``), so the ioctl parsing is checked on every interface here."""
    listing = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, timeout=10)
    if listing.returncode != 0:
        pytest.skip(f"`ip -j -4 addr show` is not available here: {listing.stderr.strip()}")
    primary = {link["ifname"]: link["addr_info"][0]["local"] for link in json.loads(listing.stdout)
               if link.get("addr_info")}
    assert "lo" in primary
    for name, address in primary.items():
        assert interface_for(address) == name


def test_source_address_names_a_bad_host() -> None:
    with pytest.raises(ValueError, match=r"cannot resolve host 'no such host'.*pass an IP address"):
        source_address("no such host")


# Loads netif.py by path: importing the undying package would import torch (seconds) for nothing.
PROBE = """
import errno, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("netif", sys.argv[3])
netif = importlib.util.module_from_spec(spec)
spec.loader.exec_module(netif)
interface_for, source_address = netif.interface_for, netif.source_address
peer, outside = sys.argv[1], sys.argv[2]
found = {"source": source_address(peer), "loopback": source_address("127.0.0.1")}
found["iface"] = interface_for(found["source"])
try:
    source_address(outside)
except OSError as e:
    found["outside"] = [errno.errorcode[e.errno], str(e)]
print(json.dumps(found), flush=True)
"""

# Listens where source_address "connects" (UDP port 9) and reports whether anything arrived.
LISTEN = """
import select, socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", 9))
print("ready", flush=True)
ready, _, _ = select.select([sock, sys.stdin], [], [], 60)
print("got a packet" if sock in ready else "silent", flush=True)
"""


@requires_netns
def test_on_a_test_host_the_route_to_a_peer_goes_through_its_veth() -> None:
    with Hosts(2) as hosts:  # closed, processes and all, however the test ends
        _probe_on(hosts)


def _probe_on(hosts: Hosts) -> None:
    listener = hosts.popen(0, [sys.executable, "-u", "-c", LISTEN], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert listener.stdout is not None and listener.stdin is not None
    assert listener.stdout.readline().strip() == "ready"
    # 192.0.2.1 (TEST-NET-1) is off the hosts' /24, and a test host has no default route.
    probe = hosts.popen(1, [sys.executable, "-c", PROBE, hosts.addr(0), "192.0.2.1", netif.__file__],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = probe.communicate(timeout=60)
    assert probe.returncode == 0, err
    found = json.loads(out)
    assert found["source"] == hosts.addr(1)
    assert found["iface"] == hosts.ifname(1)
    assert found["loopback"] == "127.0.0.1"
    code, message = found["outside"]
    assert code == errno.errorcode[errno.ENETUNREACH]
    assert "192.0.2.1" in message and "check that it is up" in message
    listener.stdin.write("done\n")
    listener.stdin.flush()
    assert listener.stdout.readline().strip() == "silent", "source_address sent a packet"
    assert listener.wait(timeout=10) == 0
