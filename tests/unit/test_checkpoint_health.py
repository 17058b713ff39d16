"""Failed saves as one incident, and the preempted job's exit code and last line (#14 finding 6)."""

from __future__ import annotations

import io

from rich.console import Console

from undying.cli.status_view import render
from undying.config import EXIT_PREEMPTED, EXIT_PREEMPTED_BEHIND
from undying.jobfiles.records import Incident
from undying.jobfiles.reruns import relaunch_rerun, rerun_words
from undying.manager.checkpoints.health import CheckpointHealth, resume_line
from undying.protocol.worker_wire import CheckpointSaved


class _Log:
    def __init__(self) -> None:
        self.written: list[tuple[int, str]] = []

    def incident(self, incident: Incident) -> None:
        self.written.append((incident.id, incident.status))


def _failed(step: int) -> CheckpointSaved:
    return CheckpointSaved(0, step, "periodic", "", 0.0, 0.0, 0, 1.0 + step, error="cannot write",
                           os_error="ENOSPC: No space left on device")


def _saved(step: int) -> CheckpointSaved:
    return CheckpointSaved(0, step, "periodic", f"/c/step-{step}", 0.01, 0.1, 100, 1.0 + step)


def test_failures_in_a_row_are_one_incident_closed_by_the_next_save_and_a_new_run_opens_another() -> None:
    log, incidents = _Log(), [Incident(1, "crash", 0, 3, 0.0, 1)]
    health = CheckpointHealth(log, incidents)
    health.failed(_failed(8))
    health.failed(_failed(12))
    assert [i.kind for i in incidents] == ["crash", "checkpoint_failed"]
    first = incidents[1]
    assert first.id == 2 and first.status == "open" and first.detail["failed_saves"] == 2
    assert first.detail["os_error"] == "ENOSPC: No space left on device" and first.detail["last_failed_step"] == 12
    assert health.view()["failing"] and health.warning(20, 4).startswith("; warning: the last 2 checkpoint save")
    health.saved(_saved(16))
    assert first.status == "recovered" and first.detail["recovered_by_step"] == 16 and not health.failing
    assert health.warning(20, 16) == ""
    health.failed(_failed(20))
    health.close()
    assert [(i.id, i.status) for i in incidents[1:]] == [(2, "recovered"), (3, "failed")]
    assert health.failures == 3 and log.written[-1] == (3, "failed")


def test_the_last_line_of_a_preempted_run_counts_what_a_resume_re_runs() -> None:
    assert resume_line({"checkpoint_step": 20, "resume_reruns": 0}).startswith(f"exit {EXIT_PREEMPTED}: ")
    behind = resume_line({"checkpoint_step": 4, "resume_reruns": 10})
    assert behind.startswith(f"exit {EXIT_PREEMPTED_BEHIND}: ") and "re-runs 10 step(s) (5..14)" in behind
    assert resume_line({"checkpoint_step": -1}).startswith("exit 143: ")


def test_undying_status_says_saves_are_failing_and_what_a_resume_re_runs() -> None:
    health = {"failures": 3, "failing": True, "last_error": "cannot write",
              "last_os_error": "ENOSPC: No space left on device", "last_failed_step": 24, "incident": 1}
    base = {"job_id": "j", "state": "running", "generation": 0, "world_size": 2, "started_at": None, "step": 30,
            "rerun_steps": [], "exit_reason": "", "ranks": [], "incidents": []}
    out = io.StringIO()
    render(dict(base, checkpoints={"health": health}), Console(file=out, width=160, color_system=None))
    assert "checkpoint saves failing since step 24: ENOSPC: No space left on device" in out.getvalue()
    out = io.StringIO()
    render(dict(base, state="preempted", preemption={"checkpoint_step": 4, "resume_reruns": 10}),
           Console(file=out, width=160, color_system=None))
    assert "a resume re-runs 10 step(s)" in out.getvalue()


def test_a_restarted_manager_takes_back_an_open_run_of_failures_and_not_as_a_recovery() -> None:
    incidents: list[Incident] = []
    before = CheckpointHealth(_Log(), incidents)
    before.failed(_failed(8))
    after = CheckpointHealth(_Log(), [])
    assert after.adopt(incidents[0]) and after.failing and after.last_failed_step == 8
    assert not after.adopt(Incident(2, "crash", 0, 3, 0.0, 1))
    after.saved(_saved(12))
    assert incidents[0].status == "recovered"


def test_a_relaunch_says_which_committed_steps_it_re_runs_and_why() -> None:
    assert relaunch_rerun(20, 20, 20, [], "/c") is None  # resumed at the last launch's newest step
    assert relaunch_rerun(20, 0, 0, [], "/c") is None  # the last launch committed nothing
    gone = relaunch_rerun(16, 26, 24, [], "/c")
    assert gone == {"first": 17, "last": 26, "steps": 10,
                    "why": "the last launch's checkpoint of step 24 is gone from /c (deleted or moved)"}
    assert rerun_words(gone) == ("re-runs 10 step(s) (steps 17..26) the last launch committed: the last launch's "
                                 "checkpoint of step 24 is gone from /c (deleted or moved)")
    rejected = relaunch_rerun(16, 26, 24, ["step-000000024"], "/c")
    assert rejected is not None and "step 24 was rejected" in rejected["why"]
    behind = relaunch_rerun(24, 26, 24, [], "/c")
    assert behind is not None and behind["why"] == "the last launch committed them after its newest checkpoint (step 24)"
    assert rerun_words(behind).startswith("re-runs 2 step(s) (steps 25..26)")
    fresh = relaunch_rerun(0, 5, 0, [], "/c")
    assert fresh is not None and fresh["first"] == 1 and "it saved none" in fresh["why"]
    assert "(step 1)" in rerun_words(relaunch_rerun(0, 1, 0, [], "/c") or {})
