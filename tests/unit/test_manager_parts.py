"""The manager's small parts alone: exit classification, incident states, the membership book, the step clock."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from undying.config import EXIT_SCRIPT_ERROR
from undying.jobfiles.events import EventLog, LogReader
from undying.jobfiles.records import (
    IllegalTransition,
    Incident,
    IncidentKind,
    IncidentStatus,
    RankInfo,
    RankState,
)
from undying.manager.membership import RankBook
from undying.manager.recovery.detection import ExitCause, classify_exit, describe_exit
from undying.manager.steps import StepClock
from undying.protocol.worker_wire import Fatal

KILLED = -int(signal.SIGKILL)


@pytest.mark.parametrize(
    ("cause", "kind", "fault_t", "detected_t", "error"),
    [
        (ExitCause(KILLED, 10.0), IncidentKind.CRASH, 10.0, 10.0, "killed by SIGKILL"),
        (ExitCause(3, 10.0), IncidentKind.CRASH, 10.0, 10.0, "exited with code 3"),
        (ExitCause(KILLED, 10.0, injected=(9.5, "crash")), IncidentKind.CRASH, 9.5, 10.0, "killed by SIGKILL"),
        (ExitCause(1, 10.0, fatal=Fatal(0, 7, "ValueError: x", "tb", 9.9)), IncidentKind.ERROR, 10.0, 10.0,
         "ValueError: x"),
        (ExitCause(KILLED, 10.0, hung=(4.0, 8.0, "heartbeat")), IncidentKind.HANG, 4.0, 8.0,
         "no heartbeat for 4.0s (heartbeat timeout); killed"),
        (ExitCause(KILLED, 10.0, hung=(4.0, 9.0, "step")), IncidentKind.HANG, 4.0, 9.0,
         "no progress in step 8 for 5.0s (step timeout); killed"),
        (ExitCause(KILLED, 10.0, lost=(1, "link cut", 7.0)), IncidentKind.NODE_LOSS, 7.0, 10.0,
         "node 1 lost: link cut"),
        (ExitCause(EXIT_SCRIPT_ERROR, 10.0), IncidentKind.SCRIPT_ERROR, 10.0, 10.0, "cannot run"),
        # A hang killed with the script-error code is still the hang (the code is the kill's, by chance).
        (ExitCause(EXIT_SCRIPT_ERROR, 10.0, hung=(4.0, 8.0, "heartbeat")), IncidentKind.HANG, 4.0, 8.0,
         "no heartbeat"),
    ],
)
def test_an_exit_is_classified_from_what_was_known_of_the_process(
    cause: ExitCause, kind: IncidentKind, fault_t: float, detected_t: float, error: str
) -> None:
    found = classify_exit(cause, step=8, script_error="cannot run")
    assert (found.kind, found.fault_t, found.detected_t) == (kind, fault_t, detected_t)
    assert found.error.startswith(error)


def test_an_exit_code_and_an_unknown_signal_are_described() -> None:
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-int(signal.SIGTERM)) == "killed by SIGTERM"
    assert describe_exit(-200) == "killed by signal 200"


def test_an_incident_settles_once_and_its_kind_and_status_are_checked() -> None:
    incident = Incident(id=1, kind=IncidentKind.CRASH, rank=0, step=3, fault_t=1.0, recovery=1)
    assert incident.status is IncidentStatus.OPEN and not incident.status.settled
    incident.settle(IncidentStatus.RECOVERED)
    with pytest.raises(IllegalTransition, match="incident 1 is recovered; it cannot become failed"):
        incident.settle(IncidentStatus.FAILED)
    observed = Incident(id=2, kind=IncidentKind.SLOW_RANK, rank=1, step=5, fault_t=1.0, recovery=0,
                        status=IncidentStatus.OBSERVED)
    with pytest.raises(IllegalTransition):
        observed.settle(IncidentStatus.RECOVERED)
    with pytest.raises(ValueError, match="'meteor'"):
        Incident(id=3, kind="meteor", rank=0, step=1, fault_t=1.0, recovery=1)  # type: ignore[arg-type]



def test_an_incident_written_to_the_log_is_read_back_with_its_enums(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.db")
    incident = Incident(id=1, kind=IncidentKind.HANG, rank=2, step=3, fault_t=100.0, recovery=1)
    incident.phases["detected"] = 101.5
    incident.settle(IncidentStatus.RECOVERED)
    log.incident(incident)
    (again,) = log.saved_job().incidents
    assert (again.kind, again.status, again.phases) == (IncidentKind.HANG, IncidentStatus.RECOVERED,
                                                        {"detected": 101.5})
    log.close()


def _rows(log: EventLog) -> dict[int, RankInfo]:
    return {row.rank: row for row in log.saved_job().ranks}


def test_the_book_numbers_ranks_node_by_node_sees_reruns_and_writes_only_moved_rows(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.db")
    book = RankBook(log, nproc_per_node=2, nodes=[0, 1])
    assert {r: i.node for r, i in book.ranks.items()} == {0: 0, 1: 0, 2: 1, 3: 1}
    assert not book.commit(1, 1, 0, 5.0)
    assert book.ranks[1].state is RankState.RUNNING
    log.flush()
    assert _rows(log)[1].state is RankState.RUNNING  # its state changed: the row is written at the flush
    book.ranks[1].pid = 99
    assert not book.commit(1, 2, 0, 6.0)
    log.flush()
    assert _rows(log)[1].pid != 99  # only its step changed: the steps table holds that, no row rewrite
    assert book.commit(1, 2, 1, 7.0) and book.rerun_steps == {2}  # step 2 again (after a recovery)
    book.set_layout([1], step=2)
    assert {r: (i.node, i.step) for r, i in book.ranks.items()} == {0: (1, 2), 1: (1, 2)}
    log.flush()
    assert set(_rows(log)) == {0, 1}  # the rows of ranks gone with the layout are forgotten
    assert book.take(0) == 1 and book.take(1) == 2 and book.ranks[1].incarnation == 2
    log.close()


def test_the_step_clock_times_steps_once_every_rank_committed_them() -> None:
    clock = StepClock(world_size=2)
    for rank, step, t in [(0, 1, 1.0), (1, 1, 1.2), (0, 2, 2.0), (1, 2, 2.5), (1, 3, 3.0)]:
        clock.committed(rank, step, t)
    assert list(clock.step_times) == [(2, 1.3)]  # step 3 waits for rank 0
    assert clock.longest_rank_step_s() == pytest.approx(1.3)
    assert clock.median_rank_step_s() == pytest.approx(1.0)


def test_a_nodes_step_record_is_taken_as_the_commits_it_carries(tmp_path: Path) -> None:
    """One NodeStep (a node's commits of a step) leaves the manager where its ranks' StepCommitted would."""
    from undying.config import JobConfig
    from undying.manager.manager import Manager
    from undying.protocol.node_wire import NodeStep
    from undying.protocol.worker_wire import StepCommitted

    def manager(name: str) -> Manager:
        return Manager(JobConfig(job_id=name, job_dir=str(tmp_path / name), nproc_per_node=2, nnodes=2),
                       EventLog(tmp_path / f"{name}.db"))

    def commits(m: Manager) -> list[tuple[int, int, int, float, dict[str, float]]]:
        m.events.flush()
        with LogReader(m.events.path) as log:
            return sorted((c.rank, c.step, c.generation, c.t, c.metrics) for c in log.commits())

    by_record, one_by_one = manager("a"), manager("b")
    records = [NodeStep(0, 1, [0, 1], [10.0, 10.1], [{"loss": 1.0}, {"loss": 1.0}]),
               NodeStep(0, 1, [2, 3], [10.2, 10.3], [{"loss": 1.0}, {"loss": 1.0}]),
               NodeStep(0, 2, [0, 1, 2, 3], [11.0, 11.1, 11.2, 11.3], [{"loss": 0.5}] * 4)]
    by_record.on_messages(list(records))
    one_by_one.on_messages([c for r in records for c in r.commits()])
    for m in (by_record, one_by_one):
        assert {r: i.step for r, i in m.ranks.items()} == {0: 2, 1: 2, 2: 2, 3: 2}
        assert m.state.value == "running" and not m.rerun_steps
        assert [list(p) for p in m.core.clock.step_times] == [[2, 1.0]]
    assert commits(by_record) == commits(one_by_one)
    # A record sent again (a resend after a break) is a re-run of those steps, said so.
    by_record.on_messages([records[2]])
    assert by_record.rerun_steps == {2}
    assert StepCommitted(0, 0, 2, 11.0, {"loss": 0.5}) in records[2].commits()
    for m in (by_record, one_by_one):
        m.close()


def test_a_sigterm_from_a_process_the_rank_was_taken_from_does_not_preempt_the_job(tmp_path: Path) -> None:
    """Found in the multi-node suite: a cut-off host's agent, fenced, stopped its old workers with SIGTERM; one
    reported it after the agent joined again, and the manager preempted the whole job for a stale process."""
    from undying.config import JobConfig
    from undying.manager.manager import Manager
    from undying.protocol.worker_wire import Terminated

    events = EventLog(tmp_path / "events.db")
    manager = Manager(JobConfig(job_id="t", job_dir=str(tmp_path), nproc_per_node=2), events)
    manager.ranks[1].pid = 2000  # the rank's process now (a replacement)
    manager.on_message(Terminated(1, 10.0, pid=1000))  # the one it replaced, stopped by its fenced agent
    assert manager.preemption is None and manager.state.value == "starting"
    events.flush()
    with LogReader(tmp_path / "events.db") as log:
        (stale,) = log.events("sigterm_stale")
    assert stale.data["pid"] == 1000 and stale.data["holder"] == 2000
    assert not log_has(tmp_path, "sigterm")
    manager.close()


def log_has(tmp_path: Path, kind: str) -> bool:
    with LogReader(tmp_path / "events.db") as log:
        return bool(log.events(kind))
