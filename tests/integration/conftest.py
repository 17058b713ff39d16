"""Fixtures of the integration tests: test hosts in network namespaces (tests/netns.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.netns import make_hosts, our_namespaces

__all__ = ["make_hosts"]


@pytest.fixture(scope="session", autouse=True)
def _no_test_hosts_left() -> Iterator[None]:
    """Fail the session if a test left one of its network namespaces behind (one made outside make_hosts)."""
    yield
    if os.geteuid() == 0 and shutil.which("ip"):
        left = our_namespaces(os.getpid())
        assert not left, f"test hosts left behind: {left}; close every Hosts (make_hosts does)"
