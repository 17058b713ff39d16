"""Ring replication's pure parts: the ring, the switch, the copies (the restore plan: test_planner.py)."""

from __future__ import annotations

import pytest

from undying.checkpoint.planner import ring_replica_of
from undying.errors import UsageError
from undying.worker.replica import Copies, ReplicationConfig, ring_offset


@pytest.mark.parametrize(("world", "local", "offset"), [(1, 1, 0), (4, 4, 1), (2, 2, 1), (8, 4, 4), (6, 2, 2),
                                                        (4, 1, 1)])
def test_ring_offset_reaches_another_node_when_there_is_one(world: int, local: int, offset: int) -> None:
    assert ring_offset(world, local) == offset
    # The planner's map of the same ring: holder -> owner, every rank's shard kept exactly once, elsewhere.
    ring = ring_replica_of(world, offset)
    assert sorted(ring.values()) == (list(range(world)) if offset else [])
    assert all(holder == (owner + offset) % world != owner for holder, owner in ring.items())


def test_the_switch_reads_the_environment_and_refuses_bad_values() -> None:
    assert ReplicationConfig.from_environ({}) == ReplicationConfig("off", 1)
    config = ReplicationConfig.from_environ({"UNDYING_REPLICATE": "Ring", "UNDYING_REPLICATE_EVERY": "4"})
    assert config.ring and config.every == 4
    with pytest.raises(UsageError, match="UNDYING_REPLICATE='mirror'"):
        ReplicationConfig.from_environ({"UNDYING_REPLICATE": "mirror"})
    for bad in ("0", "x", "-2"):
        with pytest.raises(UsageError, match="UNDYING_REPLICATE_EVERY"):
            ReplicationConfig.from_environ({"UNDYING_REPLICATE": "ring", "UNDYING_REPLICATE_EVERY": bad})


def test_copies_keep_the_newest_committed_step_and_what_came_after() -> None:
    copies = Copies(own={3: b"a", 4: b"b"}, replicas={3: b"c", 4: b"d"})
    copies.own[5] = b"e"  # exchanged, not committed: kept beside 4
    copies.committed(4)
    assert sorted(copies.own) == [4, 5] and sorted(copies.replicas) == [4]
    copies.keep_only(5)
    assert list(copies.own) == [5] and copies.replicas == {}
    assert copies.nbytes() == 1
