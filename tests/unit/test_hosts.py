"""Host states (ok, drained, quarantined) and the planned moves' requests, without a running job.

The host book alone (a table of transitions), then the manager's side on a
real Manager and its real SQLite log: drain, quarantine and undrain recorded,
shown in the status, kept across a manager restart; the HTTP API's bodies
checked whole; a move refused, with the reason, when the job cannot take one;
and a standby on a drained host passed over when a lost node is given away.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from rich.console import Console

from tests.unit.test_nodes import JOB, TOKEN, job_config, join_message
from undying.cli.status_view import view
from undying.config import JobConfig, ManagerOptions
from undying.errors import UsageError
from undying.jobfiles.events import EventLog, LogReader
from undying.launch.manager_service import _Gate
from undying.manager.manager import Manager
from undying.manager.placement import quarantine, request_move
from undying.manager.placement.hosts import REQUALIFY_PASSES, HostBook, HostState, check_host
from undying.manager.standbys import Parked, SlotFacts, Standbys
from undying.protocol.node_wire import AgentJoin
from undying.protocol.worker_wire import Progress


def test_a_host_is_drained_quarantined_and_cleared_and_a_quarantine_outranks_a_drain() -> None:
    book = HostBook()
    assert book.state("a") is HostState.OK and not book.blocked("a")
    book.drain("a", by="op", reason="", t=1.0)
    assert book.state("a") is HostState.DRAINED and book.blocked("a")
    book.quarantine("a", reason="rank 3 at fault twice", by="numerics", t=2.0)
    kept = book.drain("a", by="op", reason="again", t=3.0)  # a drain leaves the quarantine and its reason
    assert (kept.state, kept.reason) == (HostState.QUARANTINED, "rank 3 at fault twice")
    book.drain("b", by="op", reason="disk swap", t=0.5)
    assert [m["host"] for m in book.view()] == ["b", "a"]  # oldest first
    assert book.blocked_hosts() == {"a", "b"}
    cleared = book.clear("a")
    assert cleared is not None and cleared.state is HostState.QUARANTINED and not book.blocked("a")
    assert book.clear("a") is None


def test_a_drain_is_kept_under_a_quarantine_in_either_order_and_outlasts_its_requalification() -> None:
    """Drained then quarantined, or quarantined then drained: the host requalifies to drained, not ok."""
    for first_drained in (True, False):
        book = HostBook()
        if first_drained:
            book.drain("a", by="op", reason="disk swap", t=1.0)
        book.quarantine("a", reason="rank 3 at fault twice", by="numerics", t=2.0)
        if not first_drained:
            book.drain("a", by="op", reason="disk swap", t=3.0)
        [shown] = book.view()
        assert shown["state"] == "quarantined" and shown["drained"]["reason"] == "disk swap", shown
        again = HostBook.from_log(book.to_log())  # a restarted manager keeps the drain under it
        assert again.view() == book.view()
        for step in (10, 20):
            assert again.verified("a", passed=True, step=step).state is HostState.QUARANTINED  # type: ignore[union-attr]
        cleared = again.verified("a", passed=True, step=30)
        assert cleared is not None and cleared.state is HostState.OK  # the quarantine is cleared...
        assert again.state("a") is HostState.DRAINED and again.blocked("a")  # ...the operator's drain stands
        [left] = again.view()
        assert (left["reason"], left["by"]) == ("disk swap", "op") and "drained" not in left
        assert again.verified("a", passed=True, step=40) is None  # a drained host is not counted
        assert again.clear("a") is not None and not again.blocked("a")


def test_the_book_round_trips_through_its_log_form_and_skips_what_it_cannot_read() -> None:
    book = HostBook()
    book.drain("a", by="op", reason="r", t=1.0)
    book.quarantine("b", reason="why", by="numerics", t=2.0)
    again = HostBook.from_log([*book.to_log(), {"host": "c", "state": "melted"}, "junk", {"state": "drained"}])
    assert again.view() == book.view()
    assert HostBook.from_log(None).view() == [] and HostBook.from_log({"a": 1}).view() == []


@pytest.mark.parametrize("bad", ["", "a b", "x" * 256, "h;rm", 7, None])
def test_a_bad_host_name_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(UsageError, match="is not a host name or address"):
        check_host(bad)


def test_a_quarantine_needs_its_reason() -> None:
    with pytest.raises(UsageError, match="needs a reason"):
        HostBook().quarantine("a", reason="  ", by="numerics", t=1.0)


def _manager(tmp_path: Path, *, restoring: bool = False) -> Manager:
    config = JobConfig(job_id="h", job_dir=str(tmp_path), nproc_per_node=2)
    return Manager(config, EventLog(tmp_path / "events.db"), restoring=restoring)


def test_drain_quarantine_and_undrain_are_logged_shown_and_kept_across_a_manager_restart(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    moves = manager.migrations
    # One node whose manager runs in its launcher: a host it does not know is refused, naming the one it knows.
    manager.core.agents[0] = cast(Any, _Node(0, "localhost"))
    with pytest.raises(UsageError, match="host idle is not a host of this job, which runs on localhost "):
        moves.drain("idle", by="op")
    assert manager.status()["hosts_out"] == []
    for node, host in ((5, "idle"), (6, "gone")):  # hosts it knows, running none of its ranks
        manager.core.agents[node] = cast(Any, _Node(node, host))
    assert moves.drain("idle", by="op", reason="disk swap") == {"host": "idle", "state": "drained",
                                                                  "reason": "disk swap", "moved": []}
    moves.quarantine("sick", "rank 1 found at fault twice")
    moves.drain("gone", by="op")
    assert moves.undrain("gone", by="op") == {"host": "gone", "state": "ok", "was": "drained"}
    with pytest.raises(UsageError, match="host gone is not drained or quarantined; nothing to undrain"):
        moves.undrain("gone")
    console = Console(record=True, width=80)
    console.print(view(manager.status()))
    assert "host idle: drained by op: disk swap" in console.export_text()  # `undying status`, as text
    shown = {m["host"]: m for m in manager.status()["hosts_out"]}
    assert set(shown) == {"idle", "sick"}
    assert (shown["sick"]["state"], shown["sick"]["reason"], shown["sick"]["by"]) == (
        "quarantined", "rank 1 found at fault twice", "numerics")
    manager.events.flush()
    with LogReader(tmp_path / "events.db") as reader:
        assert [e.kind for e in reader.events("host_drained")] == ["host_drained", "host_drained"]
        assert [e.data["host"] for e in reader.events("host_cleared")] == ["gone"]
    manager.close()
    again = _manager(tmp_path, restoring=True)
    try:
        again.restore()
        assert again.core.hosts.blocked_hosts() == {"idle", "sick"}
        assert [m["host"] for m in again.status()["hosts_out"]] == ["idle", "sick"]
    finally:
        again.close()


def test_the_fault_policys_one_call_quarantines_a_host_named_or_by_its_rank(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    try:
        assert quarantine(manager.core, host="h1", reason="rank 1 found at fault twice") == {
            "host": "h1", "state": "quarantined", "reason": "rank 1 found at fault twice"}
        with pytest.raises(UsageError, match="quarantine needs a host or a rank of this job, got rank 9"):
            quarantine(manager.core, rank=9, reason="x")
        assert [m["by"] for m in manager.status()["hosts_out"]] == ["numerics"]
        assert manager.migrations.undrain("h1")["was"] == "quarantined"  # the one clear surface
    finally:
        manager.close()


def test_a_move_is_refused_saying_why_while_the_job_cannot_take_one(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    try:
        with pytest.raises(UsageError, match="rank 5 does not exist; this job has ranks 0..1"):
            manager.migrations.migrate(5, None)
        with pytest.raises(UsageError, match="cannot migrate rank 0 now: the job is starting"):
            manager.migrations.migrate(0, None)
        with pytest.raises(UsageError, match="node 3 is not a node of this job"):
            manager.migrations.migrate_node(3, "b")
    finally:
        manager.close()


@pytest.mark.parametrize(("what", "body", "error"), [
    ("migrate", {}, 'migrate needs a "rank" or a "node"'),
    ("migrate", {"rank": True}, 'migrate needs a "rank" or a "node"'),
    ("migrate", {"rank": -1}, 'migrate needs a "rank" or a "node"'),
    ("migrate", {"rank": 1, "node": 0}, "not both"),
    ("migrate", {"node": "1"}, '"node" must be a whole number from 0'),
    ("migrate", {"rank": 1, "to": 5}, '"to" must be a host name'),
    ("migrate", {"rank": 0, "to": "bad host"}, "is not a host name or address"),
    ("drain", {"hosts": "a"}, 'drain needs a "host"'),
    ("undrain", {"host": ["a"]}, 'undrain needs a "host"'),
    ("drain", {"host": "a b"}, "is not a host name or address"),
])
def test_a_bad_request_body_is_refused_naming_the_field(tmp_path: Path, what: str, body: dict[str, Any],
                                                        error: str) -> None:
    manager = _manager(tmp_path)
    try:
        with pytest.raises(UsageError, match=error):
            request_move(manager.migrations, what, body, "test")
        assert manager.status()["hosts_out"] == []  # nothing changed
    finally:
        manager.close()


def test_a_standby_parked_on_a_drained_host_is_passed_over_for_a_lost_node(tmp_path: Path) -> None:
    seated: list[tuple[int, str]] = []

    def seat(node: int, join: AgentJoin, writer: Any) -> str:
        seated.append((node, join.host))
        return f"s{node}"

    standbys = Standbys(seat, lambda what, detail: None)
    now = time.time()
    for key, host, spares in ((1, "drained-host", 4), (2, "fine-host", 1)):
        join = msgspec.structs.replace(join_message(tmp_path, -1), host=host)
        standbys.parked[key] = Parked(key, join, cast(Any, None), parked_at=now, last_heard=now, spares_ready=spares)
    standbys.blocked = lambda: {"drained-host"}
    done = standbys.place([SlotFacts(1, attached=False, lost_at=now)], silence_limit_s=10.0)
    assert [p.standby for p in done] == [2] and seated == [(1, "fine-host")]  # not the one with more spares



def test_a_new_agent_from_a_drained_host_is_refused_and_one_coming_back_is_let_in(tmp_path: Path) -> None:
    """The join gate of `undying manager`: a drained host gets no node, a node's agent reconnecting keeps its."""
    gate = _Gate(ManagerOptions(job_id=JOB, job_dir=str(tmp_path), host="127.0.0.1", port=0, http_port=0),
                 TOKEN)
    book = HostBook()
    book.drain("host-1", by="op", reason="", t=1.0)
    gate.bind(job_config(tmp_path), book.refusal)  # as launch/manager_service.py binds it
    assert gate(join_message(tmp_path, 0)) == ""  # host-0: ok
    refused = gate(join_message(tmp_path, 1))
    assert refused == "host host-1 is drained: it gets no new ranks; `undying undrain host-1` first", refused
    assert gate(join_message(tmp_path, 1, session="s-1")) == ""  # its own agent, after a manager restart


# --- requalification: a quarantined host cleared by its ranks' verified steps ----------------------------------


def test_a_quarantined_host_requalifies_after_passes_in_a_row_and_a_mismatch_starts_the_count_again() -> None:
    assert REQUALIFY_PASSES == 3  # documented in docs/numerics.md
    book = HostBook()
    book.quarantine("sick", reason="rank 1 found at fault twice", by="numerics", t=1.0)
    book.drain("idle", by="op", reason="disk swap", t=2.0)
    assert book.verified("fine", passed=True, step=4) is None  # an ok host: nothing to count
    for step in (4, 8, 12, 16):
        assert book.verified("idle", passed=True, step=step) is None  # a drained host never requalifies this way
    assert book.state("idle") is HostState.DRAINED
    counted = [book.verified("sick", passed=True, step=4), book.verified("sick", passed=True, step=8)]
    assert [(m.state, m.passes, m.steps) for m in counted if m] == [
        (HostState.QUARANTINED, 1, (4,)), (HostState.QUARANTINED, 2, (4, 8))]
    reset = book.verified("sick", passed=False, step=12)
    assert reset is not None and (reset.state, reset.passes, reset.steps) == (HostState.QUARANTINED, 0, ())
    for step in (16, 20):
        assert book.verified("sick", passed=True, step=step) is not None
    (shown,) = [m for m in book.view() if m["host"] == "sick"]
    assert book.blocked("sick") and (shown["passes"], shown["needed"], shown["steps"]) == (2, 3, [16, 20])
    again = HostBook.from_log(book.to_log())  # a restarted manager goes on from the count
    done = again.verified("sick", passed=True, step=24)
    assert done is not None and (done.state, done.passes, done.steps, done.reason) == (
        HostState.OK, 3, (16, 20, 24), "rank 1 found at fault twice")
    assert not again.blocked("sick") and again.blocked_hosts() == {"idle"}
    assert again.verified("sick", passed=True, step=28) is None  # ok now: counted no more
    book.quarantine("sick", reason="found again", by="numerics", t=3.0)  # quarantined anew: from 0
    assert [m["passes"] for m in book.view() if m["host"] == "sick"] == [0]


class _Node:
    """A node's agent as the manager sees it here: only where it runs (the host its ranks are on)."""

    def __init__(self, node: int, host: str) -> None:
        self.node, self.host = node, host

    def view(self) -> dict[str, Any]:
        return {"node": self.node, "host": self.host}

    def spares_ready(self) -> int:
        return 0

    def phases(self) -> dict[int, str]:
        return {}


def _verdict(step: int, suspect: int, passed: bool) -> Progress:
    """Rank 0's word on one verified step, as worker.verify sends it."""
    return Progress(0, 0, "verify_result", time.time(), step=step, detail={"suspect": suspect, "passed": passed})


def test_verified_steps_of_a_quarantined_hosts_ranks_requalify_it_logged_shown_and_kept(tmp_path: Path) -> None:
    """Real Progress messages into a real Manager (2 nodes of 2 ranks): only the quarantined host's ranks count."""
    def manager(restoring: bool = False) -> Manager:
        config = JobConfig(job_id="q", job_dir=str(tmp_path), nproc_per_node=2, nnodes=2)
        m = Manager(config, EventLog(tmp_path / "events.db"), restoring=restoring)
        for node, host in ((0, "good"), (1, "sick")):
            m.core.agents[node] = cast(Any, _Node(node, host))
        return m

    first = manager()
    quarantine(first.core, rank=3, reason="rank 3 found at fault twice")
    first.on_messages([_verdict(2, 2, True), _verdict(4, 0, False), _verdict(6, 3, False),  # reset on sick
                       _verdict(8, 3, True), _verdict(10, 0, True), _verdict(12, 2, True)])
    console = Console(record=True, width=200)
    console.print(view(first.status()))
    assert "host sick: quarantined by numerics: rank 3 found at fault twice (requalifying: 2/3 verified" in (
        console.export_text())
    first.close()
    again = manager(restoring=True)  # a manager restart keeps the count
    try:
        again.restore()
        assert again.status()["hosts_out"][0]["passes"] == 2
        again.on_messages([_verdict(14, 2, True), _verdict(16, 9, True), Progress(0, 0, "verify_result", 1.0)])
        assert again.status()["hosts_out"] == [] and not again.core.hosts.blocked("sick")
        again.events.flush()
        with LogReader(tmp_path / "events.db") as reader:
            (done,) = [e.data for e in reader.events("host_requalified")]
            (said,) = [e.data for e in reader.events("host_quarantined")]
            assert len(list(reader.events("verify_result"))) == 9
        assert (done["host"], done["passes"], done["steps"]) == ("sick", 3, [8, 12, 14])
        assert "--verify-every" in said["until"] and "undying undrain HOST" in said["until"]
    finally:
        again.close()


def test_a_drain_under_a_quarantine_outlasts_its_requalification_through_a_real_manager(tmp_path: Path) -> None:
    """An operator's drain of a quarantined host: shown under it, and the host is drained still once the
    verified steps clear the quarantine (the event says so)."""
    config = JobConfig(job_id="qd", job_dir=str(tmp_path), nproc_per_node=2, nnodes=2)
    m = Manager(config, EventLog(tmp_path / "events.db"))
    for node, host in ((0, "good"), (1, "sick")):
        m.core.agents[node] = cast(Any, _Node(node, host))
    try:
        quarantine(m.core, rank=3, reason="rank 3 found at fault twice")
        m.core.hosts.drain("sick", by="op", reason="fan swap", t=time.time())
        assert m.status()["standbys"] == []  # none parked (the live list: tests/integration/test_migrate.py)
        console = Console(record=True, width=240)
        parked = {"standby": 0, "host": "spare1", "agent_pid": 42, "spares_ready": 2, "last_heard": time.time()}
        console.print(view({**m.status(), "standbys": [parked]}))
        shown = console.export_text()
        assert "standby on spare1 (agent pid 42): 2 warm spare(s), last heard 0s ago" in shown, shown
        assert "(requalifying: 0/3 verified" in shown and "; also drained by op: fan swap" in shown, shown
        m.on_messages([_verdict(2, 2, True), _verdict(4, 3, True), _verdict(6, 2, True)])
        [left] = m.status()["hosts_out"]
        assert (left["host"], left["state"], left["reason"]) == ("sick", "drained", "fan swap"), left
        m.events.flush()
        with LogReader(tmp_path / "events.db") as reader:
            (done,) = [e.data for e in reader.events("host_requalified")]
        assert (done["host"], done["state"]) == ("sick", "drained"), done
    finally:
        m.close()
