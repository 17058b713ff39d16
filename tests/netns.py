"""Test hosts for the tests: :mod:`undying.demo.hosts` (and its
:mod:`undying.demo.namespaces`) plus the pytest parts.

The harness itself lives in the library (``undying demo --fault node-loss``
needs it at run time); this module keeps the names the tests import
(``from tests.netns import Hosts, make_hosts``) and adds :data:`requires_netns`
and the ``make_hosts`` fixture, which skip with the reason where namespaces
cannot be made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from undying.demo.hosts import Hosts
from undying.demo.namespaces import (
    NETNS_DIR,
    PREFIX,
    netns_missing,
    netns_pids,
    netns_unavailable_reason,
    our_namespaces,
)

__all__ = [
    "Hosts",
    "NETNS_DIR",
    "PREFIX",
    "make_hosts",
    "netns_missing",
    "netns_pids",
    "netns_unavailable_reason",
    "our_namespaces",
    "requires_netns",
]

requires_netns = pytest.mark.skipif(
    netns_unavailable_reason() is not None, reason=str(netns_unavailable_reason()))


@pytest.fixture
def make_hosts() -> Iterator[Callable[[int], Hosts]]:
    """``make_hosts(n)`` -> a new :class:`Hosts`; all closed after the test, pass or fail.

    Skips the test, with the reason, where namespaces cannot be made.
    """
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        hosts = Hosts(n)
        made.append(hosts)
        return hosts

    yield make
    errors = []
    for hosts in made:
        try:
            hosts.close()
        except RuntimeError as e:
            errors.append(str(e))
    if errors:
        raise RuntimeError("\n".join(errors))
