"""An operator's request to move ranks or hosts (``POST /api/migrate``, ``/api/drain``,
``/api/undrain``): its JSON body checked whole before anything is done, then handed to the planned
moves."""

from __future__ import annotations

from typing import Any

from undying.errors import UsageError
from undying.manager.placement.hosts import check_host
from undying.manager.placement.migration import Migrations

__all__ = ["MOVE_EXAMPLES", "request_move"]

# What each POST of the HTTP API takes (manager/http/): its body's example, for the errors.
MOVE_EXAMPLES = {"migrate": '{"rank": 1, "to": "HOST"} or {"node": 1, "to": "HOST"}',
                 "drain": '{"host": "HOST"}', "undrain": '{"host": "HOST"}'}
_MAX_RANK = 1 << 20


def request_move(migrations: Migrations, what: str, body: dict[str, Any],
                 by: str) -> dict[str, Any]:
    """``POST /api/<what>`` with its JSON body, checked whole before anything is done; UsageError
    names the field."""
    example = MOVE_EXAMPLES[what]
    if what == "migrate":
        rank, to, node = body.get("rank"), body.get("to"), body.get("node")
        if to is not None and not isinstance(to, str):
            raise UsageError(
                f'"to" must be a host name (a string), got {str(to)[:40]!r}; e.g. {example}')
        if to is not None:
            check_host(to)
        if node is not None and rank is not None:
            raise UsageError(f'migrate takes a "rank" or a "node", not both; e.g. {example}')
        if node is not None:
            if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node <= _MAX_RANK:
                raise UsageError(
                    f'"node" must be a whole number from 0, got {str(node)[:40]!r}; e.g. {example}')
            return migrations.migrate_node(node, to, by=by)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= _MAX_RANK:
            raise UsageError('migrate needs a "rank" or a "node" (a whole number from 0, not '
                             f'both), got {str(rank)[:40]!r}; e.g. {example}')
        return migrations.migrate(rank, to, by=by)
    host = body.get("host")
    if not isinstance(host, str):
        raise UsageError(
            f'{what} needs a "host" (a string), got {str(host)[:40]!r}; e.g. {example}')
    check_host(host)
    if what == "drain":
        return migrations.drain(host, by=by, reason=str(body.get("reason") or "")[:500])
    return migrations.undrain(host, by=by)
