"""Which warm standby takes which lost node: a pure decision over the slots and the parked standbys.

A standby agent (``undying run --standby``) joins the job with its zygote and
spares warm but no node. When a node is lost its ranks are recovered like
crashed ones, and their replacements wait in the node's slot for an agent;
a standby given the node's number takes them on its warm spares at once,
instead of the job waiting for a cold host to start an agent and import torch.

Only a node that was lost (its slot detached after it had an agent) is given
away: a node that has not joined yet at the job's start belongs to the host
started for it. Among the standbys, the one with the most warm spares goes
first (a lost node's ranks all start warm when it has as many as the node
had ranks), then the one parked longest. ``AgentServer`` (``nodes.py``)
carries the decision out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SlotFacts", "StandbyFacts", "Promote", "promotions"]


@dataclass(frozen=True)
class SlotFacts:
    """A node's slot as the decision needs it."""

    node: int
    attached: bool  # an agent holds it now
    lost_at: float  # when its agent was declared lost (0: never had one, or never lost)


@dataclass(frozen=True)
class StandbyFacts:
    """A parked standby as the decision needs it."""

    key: int  # the server's number for it
    spares_ready: int
    parked_at: float
    silent_s: float  # since its last beat


@dataclass(frozen=True)
class Promote:
    """Give ``node`` to standby ``standby``."""

    standby: int
    node: int
    reason: str


def promotions(slots: Sequence[SlotFacts], standbys: Sequence[StandbyFacts], *,
               silence_limit_s: float, closed: bool = False) -> list[Promote]:
    """Every lost node without an agent, paired with the best standby still heard from;
    the longest lost first.

    ``silence_limit_s``: a standby silent this long (a host cut off) is passed
    over; the server drops it. ``closed``: the job is over, nothing moves.
    """
    if closed:
        return []
    lost = sorted((s for s in slots if not s.attached and s.lost_at > 0),
                  key=lambda s: (s.lost_at, s.node))
    fit = sorted((s for s in standbys if s.silent_s <= silence_limit_s),
                 key=lambda s: (-s.spares_ready, s.parked_at, s.key))
    return [Promote(standby.key, slot.node,
                    f"node {slot.node} was lost; standby {standby.key} "
                    f"({standby.spares_ready} warm spare"
                    f"{'' if standby.spares_ready == 1 else 's'}) takes its number and its ranks")
            for slot, standby in zip(lost, fit, strict=False)]
