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
from undying.cli.status import view
from undying.config import JobConfig
from undying.errors import UsageError
from undying.manager.events import EventLog, LogReader
from undying.manager.hosts import HostBook, HostState, check_host
from undying.manager.manager import Manager
from undying.manager.migration import quarantine, request_move
from undying.manager.service import ManagerOptions, _Gate
from undying.manager.standby import SlotFacts
from undying.manager.standbys import Parked, Standbys
from undying.protocol.node_wire import AgentJoin


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
    gate.config = job_config(tmp_path)
    book = HostBook()
    book.drain("host-1", by="op", reason="", t=1.0)
    gate.host_out = lambda host: book.state(host).value if book.blocked(host) else ""
    assert gate(join_message(tmp_path, 0)) == ""  # host-0: ok
    refused = gate(join_message(tmp_path, 1))
    assert refused == "host host-1 is drained: it gets no new ranks; `undying undrain host-1` first", refused
    assert gate(join_message(tmp_path, 1, session="s-1")) == ""  # its own agent, after a manager restart
