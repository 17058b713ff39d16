"""The generation protocol on the manager's control store (a c10d TCPStore).

The manager opens generation ``n`` by writing ``gen/<n>``: the members' world
size and the port of a TCPStore created for that generation alone, on which
the workers build their process group. A generation that must be abandoned
(a member died while it was forming) is marked superseded and its store is
closed, which makes every wait on it fail at once. A process also reads
``rank/<r>/owner`` before it joins: a rank given to a newer process (its host
was lost, or cut off and back) leaves rather than join beside its successor.

A generation that regroups the job (a node lost for good, or one joining an
elastic job) names its ``members``: each surviving rank's number in it. They
restore one consistent state there, save it, and leave; the job then starts
again on its new set of nodes from that checkpoint (``purpose="regroup"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

__all__ = ["GenerationRecord", "generation_key", "rank_owner_key", "arrival_key", "CURRENT_KEY"]

CURRENT_KEY = "gen/current"


def generation_key(generation: int) -> str:
    return f"gen/{generation}"


def rank_owner_key(rank: int) -> str:
    """The incarnation (a number the manager counts up) of the process that holds ``rank`` now."""
    return f"rank/{rank}/owner"


def arrival_key(rank: int) -> str:
    """Set in a generation's own store by ``rank`` (its number in the job) as it starts building
    the group, outside the group's own keys: when the group fails to form, the manager reads who
    came, and blames one that did not."""
    return f"undying/arrived/{rank}"


@dataclass(frozen=True)
class GenerationRecord:
    """One generation as the control store holds it (also inside SpawnRank, for the agent to spawn
    into)."""

    generation: int
    world_size: int
    store_host: str
    store_port: int
    # "open" while it forms or runs; "superseded" once a newer one replaced it.
    status: str = "open"
    superseded_by: int = -1
    reason: str = ""
    # Old rank -> rank in this generation; empty: every rank keeps its number.
    members: dict[str, int] = field(default_factory=dict)
    # "" to train; "regroup": restore, save the state, leave (see the module's docstring).
    purpose: str = ""

    def member_rank(self, rank: int) -> int | None:
        """This generation's number for ``rank``; None when it is no member."""
        if not self.members:
            return rank
        return self.members.get(str(rank))

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> GenerationRecord:
        """The record a store value holds; ValueError naming the value when it is no record."""
        try:
            return msgspec.json.decode(raw, type=cls)
        except msgspec.DecodeError as e:
            raise ValueError(f"not a generation record ({e}): {raw!r:.200}") from None
