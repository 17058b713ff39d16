"""A fault before a planned move's boundary cancels the move and never fences the rank's old process.

Real Managers (tests/unit/live_manager.py); the processes are
tests/integration/test_migrate.py's (a crash during a move, with the oracle).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.live_manager import running
from undying.jobfiles.events import LogReader
from undying.protocol.worker_wire import Hello


@pytest.mark.parametrize("who", [0, 1])  # the other rank crashes; the moving rank's old process itself does
def test_a_crash_before_the_boundary_gives_the_rank_back_to_its_old_process(tmp_path: Path, who: int) -> None:
    manager, agent = running(tmp_path)
    old_pid, old_incarnation = manager.ranks[1].pid, manager.ranks[1].incarnation
    answer = manager.migrations.migrate(1, None)
    assert (1, "migrate") in agent.armed and agent.spawned[-1] == (1, True)  # the replacement, started ahead
    assert manager.ranks[1].pid != old_pid
    manager.on_exit(who, old_pid if who == 1 else manager.ranks[0].pid, -9, 12.0)
    info = manager.ranks[1]
    if who == 0:  # the old process is rank 1's again: the only holder of the state
        assert (info.pid, info.incarnation) == (old_pid, old_incarnation)
    assert agent.killed == [1]  # the replacement started ahead (the agent's newest process of rank 1)
    [incident] = manager.incidents
    assert (incident.kind, incident.rank, incident.action) == ("crash", who, "replace"), incident
    assert incident.detail["restore_plan"].startswith(f"rank {who} <- peer rank {1 - who}"), incident.detail
    manager.events.flush()
    with LogReader(manager.events.path) as log:
        [failed] = log.events("migration_failed")
    reason = failed.data["reason"]
    assert failed.data["pid"] == old_pid == answer["pid"]
    assert reason.startswith("a recovery took the job on first (crash of rank 0" if who == 0 else
                             f"rank 1's process {old_pid} killed by SIGKILL before the move's boundary"), reason
    assert not manager.migrations.pending
    manager.close()


def test_the_cancelled_replacement_s_late_hello_and_kill_leave_the_rank_to_its_old_process(tmp_path: Path) -> None:
    """Found by the suite under load: the replacement started ahead said hello after the cancel (it
    was on its way), took the rank's pid, and its kill was judged a crash of rank 1, failing a job
    whose rank 1 (the only holder of the state) still ran."""
    manager, _agent = running(tmp_path)
    old_pid, old_incarnation = manager.ranks[1].pid, manager.ranks[1].incarnation
    manager.migrations.migrate(1, None)
    ahead, ahead_incarnation = manager.ranks[1].pid, manager.ranks[1].incarnation
    assert ahead_incarnation != old_incarnation
    manager.on_exit(0, manager.ranks[0].pid, -9, 12.0)  # the crash that cancels the move
    manager.on_message(Hello(1, ahead, 1, True, 12.5, ahead_incarnation))  # said before its kill
    manager.on_exit(1, ahead, -9, 12.6)  # the kill of the cancel
    info = manager.ranks[1]
    assert (info.pid, info.incarnation) == (old_pid, old_incarnation)
    [incident] = manager.incidents  # rank 0's crash alone, still recoverable from rank 1
    assert (incident.kind, incident.rank, incident.action) == ("crash", 0, "replace"), incident
    manager.events.flush()
    with LogReader(manager.events.path) as log:
        [ignored] = log.events("hello_ignored")
    assert (ignored.data["pid"], ignored.data["incarnation"]) == (ahead, ahead_incarnation)
    manager.close()
