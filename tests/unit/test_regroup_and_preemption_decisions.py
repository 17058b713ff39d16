"""The regroup's and the preemption's decisions alone, as tables: the job's facts in, a decision out."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.unit.live_manager import running
from undying.config import EXIT_REGROUPED
from undying.manager.preemption.policy import (
    OnSigterm,
    Outcome,
    Saved,
    fallback_outcome,
    gasp_outcome,
    on_sigterm,
    resume_reruns,
    stop_step,
)
from undying.manager.regroup.policy import (
    Replan,
    WorldNext,
    form_world,
    grow,
    overdue,
    replan,
    waiting_for_members,
)
from undying.manager.regroup.record import Regroup
from undying.protocol.worker_wire import CheckpointSaved

# --- regroups -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (dict(elastic=True, available=[0, 1], trained=[0], nnodes=2), ([1], 2)),
        (dict(elastic=True, available=[0, 1, 2], trained=[0], nnodes=2), ([1, 2], 2)),  # at most MAX
        (dict(elastic=False, available=[0, 1], trained=[0], nnodes=2), None),  # a fixed size never grows
        (dict(elastic=True, available=[0], trained=[0], nnodes=2), None),  # nobody new
        (dict(elastic=True, available=[0, 1], trained=[0, 1], nnodes=2), None),  # at MAX
        (dict(elastic=True, available=[0, 1], trained=[0], nnodes=2, running=False), None),
        (dict(elastic=True, available=[0, 1], trained=[0], nnodes=2, recovering=True), None),  # after the recovery
        (dict(elastic=True, available=[0, 1], trained=[0], nnodes=2, any_done=True), None),  # the job is ending
    ],
)
def test_an_elastic_job_grows_only_while_it_runs_undisturbed(facts: dict, expected: tuple | None) -> None:
    decision = grow(**{"running": True, "recovering": False, "any_done": False, **facts})
    assert (None if decision is None else (decision.nodes, decision.size)) == expected


def _regroup(**changes: object) -> Regroup:
    regroup = Regroup(why="node 1 lost", members={0: 0, 1: 1}, step=20, first_members=2, started=100.0)
    for name, value in changes.items():
        setattr(regroup, name, value)
    return regroup


@pytest.mark.parametrize(
    ("regroup", "now", "all_attached", "waits"),
    [
        (_regroup(), 101.0, True, True),  # members still to save and leave
        (_regroup(left={0: EXIT_REGROUPED, 1: EXIT_REGROUPED}), 101.0, True, False),
        # A restarted manager: its agents have a heartbeat timeout (10 s here) to come back.
        (_regroup(left={0: EXIT_REGROUPED, 1: EXIT_REGROUPED}, restored_at=100.0), 105.0, False, True),
        (_regroup(left={0: EXIT_REGROUPED, 1: EXIT_REGROUPED}, restored_at=100.0), 105.0, True, False),
        (_regroup(left={0: EXIT_REGROUPED, 1: EXIT_REGROUPED}, restored_at=100.0), 111.0, False, False),
    ],
)
def test_the_world_waits_for_every_member_and_a_restarted_managers_agents(
        regroup: Regroup, now: float, all_attached: bool, waits: bool) -> None:
    assert waiting_for_members(regroup, now=now, heartbeat_s=10.0, all_attached=all_attached) is waits


@pytest.mark.parametrize(
    ("checkpoint_step", "available", "fewest", "waiting_since", "expected"),
    [
        (20, [0, 1], 1, 0.0, (WorldNext.FORM, [0, 1], 0, False)),
        (17, [0], 1, 0.0, (WorldNext.FORM, [0], 3, False)),  # an older checkpoint: its later steps re-run
        (20, [0, 1, 2], 1, 0.0, (WorldNext.FORM, [0, 1], 0, False)),  # at most MAX nodes
        (20, [0], 2, 0.0, (WorldNext.WAIT_FOR_NODES, [0], 0, True)),  # the wait begins (said once)
        (20, [0], 2, 150.0, (WorldNext.WAIT_FOR_NODES, [0], 0, False)),
        (None, [0, 1], 1, 0.0, (WorldNext.FAIL, [], 0, False)),
    ],
)
def test_once_every_member_left_the_world_forms_waits_for_nodes_or_fails(
        checkpoint_step: int | None, available: list[int], fewest: int, waiting_since: float,
        expected: tuple) -> None:
    regroup = _regroup(left={0: 1, 1: EXIT_REGROUPED}, waiting_since=waiting_since)
    world = form_world(regroup, checkpoint_step=checkpoint_step, checkpoint_dir="/ckpt", available=available,
                       nnodes=2, fewest=fewest)
    assert (world.next, world.nodes, world.lost_steps, world.first_wait) == expected
    if world.next is WorldNext.FAIL:
        assert "no rank saved the state" in world.reason and "/ckpt" in world.reason


@pytest.mark.parametrize(
    ("changes", "now", "expected"),
    [
        (dict(), 200.0, Replan.NONE),  # nothing broke it
        (dict(replan_at=150.0), 149.0, Replan.NONE),  # within the comm-error grace
        (dict(replan_at=150.0), 150.0, Replan.AGAIN),
        (dict(replan_at=150.0, saved="/ckpt/step-20"), 150.0, Replan.NONE),  # saved: the members are let go
        (dict(replan_at=150.0, waiting_since=140.0), 150.0, Replan.NONE),
        (dict(replan_at=150.0, attempt=6), 150.0, Replan.FAIL),  # 2 members + 3 retries + 1: the bound
        (dict(replan_at=150.0, attempt=5), 150.0, Replan.AGAIN),
    ],
)
def test_a_broken_regroup_replans_within_its_bound(changes: dict, now: float, expected: Replan) -> None:
    assert replan(_regroup(**changes), now=now, max_retries=3) is expected


@pytest.mark.parametrize(
    ("changes", "now", "words"),
    [
        (dict(), 150.0, []),
        (dict(), 161.0, ["ranks [0, 1] did not save and leave within the recovery timeout (60s)"]),
        (dict(left={0: EXIT_REGROUPED}), 161.0, ["ranks [1] did not save"]),
        (dict(waiting_since=150.0), 240.0, []),  # waiting for nodes: the rendezvous timeout, not the recovery's
        (dict(waiting_since=150.0), 251.0, ["needs 2 node(s) and has 1 ([0])", "rendezvous timeout (100s)",
                                            "step 20 is saved in /ckpt/step-20", "--node-rank I"]),
    ],
)
def test_a_regroup_that_waits_too_long_fails_saying_why(changes: dict, now: float, words: list[str]) -> None:
    why = overdue(_regroup(**changes), now=now, rendezvous_s=100.0, recovery_s=60.0, fewest=2, available=[0],
                  saved_step=20, saved_at="/ckpt/step-20")
    assert (why == "") is (not words)
    assert all(w in why for w in words), why


# --- preemption ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preempting", "winding_down", "expected"),
    [(False, False, OnSigterm.BEGIN), (True, False, OnSigterm.AGAIN), (True, True, OnSigterm.AGAIN),
     (False, True, OnSigterm.IGNORE)],
)
def test_what_a_sigterm_does(preempting: bool, winding_down: bool, expected: OnSigterm) -> None:
    assert on_sigterm(preempting=preempting, winding_down=winding_down) is expected


@pytest.mark.parametrize(
    ("proposals", "newest", "expected"),
    [({0: 12, 1: 13}, 12, 13), ({}, 12, 12), ({0: 12}, 14, 12)],
)
def test_the_stop_step_is_the_furthest_any_rank_proposed(proposals: dict, newest: int, expected: int) -> None:
    assert stop_step(proposals, newest) == expected


def _gasp(step: int = 13, error: str = "", kind: str = "dying-gasp") -> CheckpointSaved:
    return CheckpointSaved(rank=0, step=step, path=f"/ckpt/step-{step}", kind=kind, bytes=100, write_s=0.25, blocking_s=0.01,
                           t=1003.0, error=error)


CKPT_10 = Saved(10, "/ckpt/step-10", "periodic", "step-10")


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (dict(all_done=True), (-1, True, None)),
        (dict(reused=Saved(13, "/ckpt/gasp-13", "dying-gasp", "gasp-13")), (13, False, "reused the dying gasp")),
        (dict(gasp=_gasp()), (13, False, "dying gasp written in 0.250s, 3.000s after SIGTERM")),
        (dict(gasp=_gasp(kind="existing")), (13, False, "the checkpoint of that step already existed")),
        (dict(gasp=_gasp(step=12)), None),  # not the stop step's: look on disk
        (dict(gasp=_gasp(error="disk full")), None),
        (dict(), None),
    ],
)
def test_a_dying_gasp_stands_when_it_was_reused_or_reported_for_the_stop_step(facts: dict,
                                                                              expected: tuple | None) -> None:
    outcome = gasp_outcome(**{"all_done": False, "reused": None, "gasp": None, "stop": 13, "t0": 1000.0,
                              "gasp_reuse_s": 60.0, **facts})
    if expected is None:
        assert outcome is None
        return
    assert outcome is not None
    step, succeeded, words = expected
    assert (outcome.step, outcome.succeeded) == (step, succeeded)
    assert words is None or words in outcome.what


@pytest.mark.parametrize(
    ("facts", "step", "words"),
    [
        (dict(latest=None), -1, ["dying gasp of step 13 was not taken", "not written within the grace period of 8.0s",
                                 "there is no checkpoint"]),
        (dict(latest=CKPT_10), 10, ["the latest valid checkpoint step-10 (periodic) stands",
                                    "steps 11..13 will be re-run"]),
        (dict(latest=CKPT_10, late=[2, 3]), 10, ["ranks 2, 3 still running when the grace period of 8.0s ran out"]),
        (dict(latest=CKPT_10, late=[2]), 10, ["rank 2 still running"]),
        (dict(latest=CKPT_10, gasp=_gasp(error="disk full")), 10, ["could not be written (disk full)"]),
        (dict(latest=Saved(10, "/c/s", "periodic", "s"), committed=10), 10, ["no step is lost"]),
        # Written, its report cut off by the kill: found on disk, it stands.
        (dict(latest=Saved(13, "/ckpt/g", "dying-gasp", "g")), 13, ["dying gasp g found on disk, unreported"]),
    ],
)
def test_without_a_dying_gasp_the_latest_valid_checkpoint_stands_or_none(facts: dict, step: int,
                                                                         words: list[str]) -> None:
    outcome = fallback_outcome(**{"gasp": None, "stop": 13, "late": [], "grace": 8.0, "committed": 13, **facts})
    assert outcome.step == step
    assert all(w in outcome.what for w in words), outcome.what
    assert outcome.exit_reason.startswith("preempted, checkpoint at step" if step >= 0 else "preempted, no checkpoint")


@pytest.mark.parametrize(
    ("outcome", "gasp", "rank_steps", "expected"),
    [
        (Outcome(13, "/g", "gasp"), _gasp(), [12, 13], 0),  # the stop step is saved: nothing re-runs
        (Outcome(10, "/c", "older"), None, [12, 13], 3),  # steps 11..13 re-run
        (Outcome(10, "/c", "older"), _gasp(error="disk full"), [12, 12], 2),
        (Outcome(13, "/g", "reused", reused=True), None, [15], 0),  # a reused gasp: no step was trained since
        (Outcome(-1, "", "none"), None, [12], 0),
    ],
)
def test_a_resume_reruns_every_step_committed_after_its_checkpoint(outcome: Outcome, gasp: CheckpointSaved | None,
                                                                   rank_steps: list[int], expected: int) -> None:
    assert resume_reruns(outcome, gasp=gasp, stop=13, rank_steps=rank_steps) == expected


# --- deadlines after a stall of the manager itself ------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "now", "resumed", "late"),
    [
        (dict(), 161.0, 0.0, True),  # 61 s of a 60 s recovery timeout, the manager never stalled
        (dict(), 161.0, 140.0, False),  # it stopped until 140: 21 s since it came back
        (dict(), 201.0, 140.0, True),  # and then 61 s: late again
        (dict(waiting_since=150.0), 251.0, 200.0, False),  # the rendezvous' 100 s count from its return
        (dict(waiting_since=150.0), 301.0, 200.0, True),
    ],
)
def test_a_regroups_waits_count_only_while_the_manager_ran(changes: dict, now: float, resumed: float,
                                                           late: bool) -> None:
    why = overdue(_regroup(**changes), now=now, rendezvous_s=100.0, recovery_s=60.0, fewest=2, available=[0],
                  saved_step=20, saved_at="/ckpt/step-20", resumed=resumed)
    assert bool(why) is late, why


def test_a_recoverys_timeout_counts_only_while_the_manager_ran(tmp_path: Path) -> None:
    """A real Manager: a round open for longer than --recovery-timeout is overdue, unless the manager itself
    stalled meanwhile (protocol/judge_clock.py), and then it has the whole timeout again from its return."""
    manager, _ = running(tmp_path)
    manager.on_exit(1, manager.ranks[1].pid, -9, time.time())
    recovery = manager.recoveries.current
    assert recovery is not None
    limit = manager.config.timeouts.recovery_timeout
    late = recovery.started + limit + 1
    assert "did not complete within" in manager.recoveries.overdue(late)
    assert manager.recoveries.overdue(late, resumed=recovery.started + 2) == ""
    assert "did not complete within" in manager.recoveries.overdue(late + 2, resumed=recovery.started + 2)
    assert manager.watch.clock.stalls == 0 and manager.watch.clock.resumed_wall == 0.0
