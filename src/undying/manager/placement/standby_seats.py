"""The standby agents a whole node moves to (``undying migrate --node``, ``drain``): which hosts
have one parked, which one a node moves to, and giving the node to it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from undying.errors import UsageError
from undying.manager.placement.hosts import HostBook, check_host

if TYPE_CHECKING:
    from undying.manager.nodes import AgentServer

__all__ = ["parked_hosts", "standby_on", "place_on"]


def parked_hosts(server: AgentServer | None) -> list[str]:
    """The hosts a standby agent is parked on (none in a job without an agents' server)."""
    if server is None:
        return []
    return [p.join.host for p in server.standbys.parked.values()]


def standby_on(server: AgentServer | None, hosts: HostBook, to: str | None, *,
               avoid: set[str]) -> str:
    """The host of the standby a node moves to: ``to`` (one must be parked there) or any not
    avoided."""
    parked = [h for h in parked_hosts(server) if h not in avoid and not hosts.blocked(h)]
    if to is not None:
        check_host(to)
        if refused := hosts.refusal(to):
            raise UsageError(refused)
        if to not in parked:
            raise UsageError(f"no standby agent is parked on host {to} (parked on: "
                             f"{', '.join(parked) or 'none'}); start one there with `undying run "
                             "--standby ...`")
        return to
    if not parked:
        raise UsageError("no standby agent is parked to move the node to; start one on another "
                         "host with `undying run --standby ...`")
    return parked[0]


def place_on(server: AgentServer, hosts: HostBook, host: str) -> None:
    """Give the moved node to the standby on ``host``: the others are passed over this once."""
    standbys, others = server.standbys, hosts.blocked_hosts()
    blocked = standbys.blocked
    standbys.blocked = lambda: others | {h for h in parked_hosts(server) if h != host}
    try:
        server.place_standbys()
    finally:
        standbys.blocked = blocked
