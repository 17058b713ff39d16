"""A regroup generation renumbers its members: what the restore's status exchange is keyed by.

(The restore plan itself: test_planner.py.)
"""

from __future__ import annotations


def test_a_regroup_generation_renumbers_its_members_and_leaves_out_the_rest() -> None:
    from undying.protocol.generations import GenerationRecord

    plain = GenerationRecord(3, 4, "h", 1)
    assert [plain.member_rank(r) for r in range(4)] == [0, 1, 2, 3]
    regroup = GenerationRecord(4, 2, "h", 1, members={"2": 0, "3": 1}, purpose="regroup")
    assert [regroup.member_rank(r) for r in range(4)] == [None, None, 0, 1]
    assert GenerationRecord.from_json(regroup.to_json()) == regroup
