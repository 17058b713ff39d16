"""A planned leave (``Abort.at_step_start``, an elastic job growing) waits for the step loop's next
step start; unplanned, or past its grace, the group's connections break at once; a lost peer's
survivors (``Abort.from_step``) leave at once where no rank completed their step, else at the next
step start.

Real sockets stand for the group's: a loopback TCP connection whose one end is registered as a
connection of the group (what ``worker.group._build`` records), its other end the peer. A leave
ends this rank's reading at once (its collective fails: gloo reads EOF), not its writing; the peer
hears of it when the rank leaves the group (``leave_group``).
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from undying.protocol.worker_wire import Abort
from undying.worker import group
from undying.worker.commands import Commands
from undying.worker.gasp import Preemption
from undying.worker.startup import unmanaged_context


@dataclass
class Link:
    ours: socket.socket  # the group's end, registered as its connection
    peer: socket.socket


@pytest.fixture
def connection() -> Iterator[Link]:
    """A connection the group holds: its end and the peer's."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname()[:2], timeout=5)
        peer, _ = server.accept()
    group._group_sockets[ours.fileno()] = os.readlink(f"/proc/self/fd/{ours.fileno()}")
    try:
        yield Link(ours, peer)
    finally:
        group._group_sockets.clear()
        ours.close()
        peer.close()


def _ended(end: socket.socket, within: float) -> bool:
    """``end`` reads EOF within ``within`` seconds."""
    readable, _, _ = select.select([end], [], [], within)
    return bool(readable) and end.recv(1) == b""


def _broken(link: Link, within: float) -> bool:
    """The rank's reading of its connection ended (its collective fails) within ``within`` seconds."""
    return _ended(link.ours, within)


def _commands() -> Commands:
    ctx = unmanaged_context()  # generation 0, no recent step: a grace of 1 s (the floor outside a job)
    return Commands(ctx, Preemption(ctx))


def test_an_abort_breaks_the_group_at_once(connection: Link) -> None:
    _commands().on_command(Abort(0, "rank 2 crashed"))
    assert _broken(connection, 1.0)


def test_a_planned_leave_waits_for_the_next_step_start_and_then_breaks_nothing(
        connection: Link) -> None:
    commands = _commands()
    commands.on_command(Abort(0, "node 1 joined", at_step_start=True))
    assert not _broken(connection, 0.3), "broken before the step loop took the leave"
    assert commands.take_planned_leave(14)
    assert commands.ctx.abort_reason == "a planned leave at the start of step 14: node 1 joined"
    assert not commands.take_planned_leave(15), "taken once"
    # The loop leaves the group itself (Rejoin.recover); the grace's timer must not break it again.
    assert not _broken(connection, 1.5)


def test_a_planned_leave_no_step_start_takes_breaks_the_group_after_its_grace(
        connection: Link) -> None:
    commands = _commands()
    started = time.monotonic()
    commands.on_command(Abort(0, "node 1 joined", at_step_start=True))
    assert not _broken(connection, 0.5)
    assert _broken(connection, 3.0), "a rank in a long step or the final barrier never left"
    assert time.monotonic() - started >= 0.9


def test_a_leave_of_another_generation_is_ignored(connection: Link) -> None:
    commands = _commands()
    commands.on_command(Abort(3, "old news"))
    commands.on_command(Abort(3, "old news", at_step_start=True))
    assert not commands.take_planned_leave(1)
    assert not _broken(connection, 1.5)


def test_a_planned_leave_of_a_generation_left_since_is_dropped(connection: Link) -> None:
    commands = _commands()
    commands.on_command(Abort(0, "node 1 joined", at_step_start=True))
    commands.ctx.generation = 1  # a fault took the rank out of generation 0 first
    assert not commands.take_planned_leave(7)
    assert not _broken(connection, 1.5), "the grace's timer broke the new generation's group"


def test_a_lost_peers_survivor_in_a_step_nobody_completed_leaves_at_once(connection: Link) -> None:
    """``from_step``: no rank completed step 8, so the survivor in it can never finish it: its links break now."""
    commands = _commands()
    commands.ctx.step_in_flight = 8
    commands.on_command(Abort(0, "crash of rank 2: replace", from_step=8))
    assert _broken(connection, 1.0)


def test_a_lost_peers_survivor_finishing_a_completed_step_leaves_at_the_next_step_start(
        connection: Link) -> None:
    """Rank 2 committed step 7 and died: the survivor still taking its last part of step 7 finishes it."""
    commands = _commands()
    commands.ctx.step_in_flight = 7
    commands.on_command(Abort(0, "crash of rank 2: replace", from_step=8))
    assert not _broken(connection, 1.5), "a step a peer completed was broken (it would run twice)"
    assert commands.take_planned_leave(8)
    assert commands.ctx.abort_reason == "leaving at the start of step 8: crash of rank 2: replace"
    assert not commands.take_planned_leave(9), "taken once"


def test_a_lost_peers_leave_of_another_generation_is_ignored(connection: Link) -> None:
    commands = _commands()
    commands.ctx.step_in_flight = 9
    commands.on_command(Abort(3, "old news", from_step=8))
    assert not commands.take_planned_leave(10)
    assert not _broken(connection, 1.0)


def test_a_leave_ends_the_ranks_reading_not_its_writing_and_the_peer_hears_at_leave_group(
        connection: Link) -> None:
    """A write in flight is not failed under gloo (a failed write it had not yet seen coming is queued
    and never woken: the survivor sat in its collective for the whole collective timeout); the peer
    learns when the rank leaves the group, both ways."""
    _commands().on_command(Abort(0, "rank 2 crashed"))
    assert _broken(connection, 1.0)
    connection.ours.sendall(b"last part")
    assert connection.peer.recv(64) == b"last part", "the rank's write still reached its peer"
    assert not _ended(connection.peer, 0.3), "the peer was told before the rank left the group"
    group.leave_group()
    assert _ended(connection.peer, 1.0), "leaving the group ends the connection both ways"
