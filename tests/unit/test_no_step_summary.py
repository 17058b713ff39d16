"""A script without the step API (torchrun-style) is summed up in its own terms: wall time and its
whole-group restarts with their causes, never "step 0" or "goodput 0.0%", with one count of the
recovered incidents in every summary.

Real Managers fed the exits their agents report (``tests/unit/live_manager``'s agents start
nothing) write a real ``events.db``; the summaries are read back from it as ``undying run`` and
``undying status`` read it.
"""

from __future__ import annotations

import asyncio
import io
import re
import time
from pathlib import Path

import pytest
from rich.console import Console

from tests.unit.live_manager import FakeAgent, running, starting
from undying.cli.restarts import incidents_line
from undying.cli.status import collect_status
from undying.cli.status_view import render
from undying.cli.summary import end_summary
from undying.jobfiles.events import LogReader
from undying.jobfiles.records import JobState
from undying.jobfiles.restarts import has_steps, rounds
from undying.manager.manager import Manager

SIGKILL = -9


class StoppingAgent(FakeAgent):
    """(A failed job stops its ranks: these are processes of nothing, stopped at once.)"""

    async def stop_all(self, grace_s: float) -> None:
        pass


def torchrun_job(job_dir: Path, *, ranks: int = 2, max_restarts: int = 3) -> tuple[Manager, StoppingAgent]:
    """A job whose script does not import undying, its ranks started and running (as
    ``Manager.run`` starts them): no hello, no step."""
    manager, agent = starting(job_dir, ranks, step_api=False, max_restarts=max_restarts, job_id="plain",
                              log="events.db", agent=StoppingAgent())
    manager.core.move(JobState.RUNNING)
    return manager, agent


def crash(manager: Manager, rank: int, t: float) -> None:
    manager.on_exit(rank, manager.ranks[rank].pid, SIGKILL, t)


def finish(manager: Manager, t: float) -> None:
    for rank in list(manager.ranks):
        manager.on_exit(rank, manager.ranks[rank].pid, 0, t)


def fits(lines: list[str]) -> None:
    assert lines and all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]


def test_a_whole_group_restart_is_recovered_in_the_log_and_every_summary_counts_it_so(tmp_path: Path) -> None:
    manager, agent = torchrun_job(tmp_path)
    crash(manager, 1, time.time())
    [incident] = manager.incidents
    assert (incident.action, incident.status.value) == ("restart", "recovered")
    assert sorted(r for r, _ in agent.spawned[2:]) == [0, 1]  # every rank started again
    finish(manager, time.time())
    assert manager.state is JobState.SUCCEEDED
    manager.close()
    with LogReader(tmp_path / "events.db") as reader:
        [logged] = reader.incidents()
        # Every rank was started again once: each rank's count says so, as the restart's does.
        assert [r["restarts"] for r in reader.ranks()] == [1, 1]
    # Recovered, by a restart: no first step to time, so no MTTR, and recovered all the same.
    assert logged["status"] == "recovered" and logged["mttr_s"] is None
    assert logged["detail"]["restart"] == 1
    lines = end_summary(tmp_path)
    text = "\n".join(lines)
    fits(lines)
    assert re.match(r"undying: job plain succeeded: wall time \S+ s$", lines[0]), text
    assert "  incidents: 1, 1 recovered" in lines, text
    assert "  whole-group restarts: 1 (at most 3: --max-restarts)" in lines, text
    flat = " ".join(line.strip() for line in lines)
    assert re.search(r"#1 at \S+ s: crash of rank 1 \(killed by SIGKILL\); all 2 ranks started again \S+ s later "
                     r"\(restart 1\)", flat), text
    # Nothing in a step's terms: no step was counted, no goodput, no re-run, no checkpoint of undying's.
    for word in ("step 0", "goodput", "re-run", "MTTR", "checkpoints:"):
        assert word not in text, (word, text)
    assert "no steps to count: the script never calls job.steps" in flat


def test_restarts_and_the_failure_that_ended_the_job_each_name_their_cause(tmp_path: Path) -> None:
    manager, _ = torchrun_job(tmp_path, max_restarts=1)

    async def two_faults() -> None:
        crash(manager, 1, time.time())
        manager.on_exit(0, manager.ranks[0].pid, 1, time.time())  # the restarted rank 0 fails: no restart left
        await asyncio.wait_for(manager.core.finished.wait(), 30)

    asyncio.run(two_faults())
    assert manager.state is JobState.FAILED
    manager.close()
    lines = end_summary(tmp_path)
    text = "\n".join(lines)
    fits(lines)
    assert lines[0].startswith("undying: job plain failed: wall time "), text
    assert "  whole-group restarts: 1 (at most 1: --max-restarts)" in lines, text
    assert "  incidents: 2, 1 recovered" in lines, text
    flat = " ".join(line.strip() for line in lines)
    assert "#1 at " in flat and "crash of rank 1 (killed by SIGKILL); all 2 ranks started again" in flat, text
    assert re.search(r"#2 at \S+ s: \S+ of rank 0 \(exited with code 1\); not restarted: the job failed "
                     r"\(--max-restarts 1 used up\)", flat), text
    assert "step 0" not in text and "goodput" not in text and "at step" not in text, text


def test_a_long_error_and_a_long_job_dir_stay_within_80_columns(tmp_path: Path) -> None:
    deep = tmp_path / ("a-folder-name-that-goes-on-and-on-" * 3) / "job"
    deep.mkdir(parents=True)
    manager, _ = torchrun_job(deep)
    crash(manager, 1, time.time())
    manager.incidents[0].error = "exited with code 1: ValueError: " + "a long word salad of a message " * 10
    manager.events.incident(manager.incidents[0])
    finish(manager, time.time())
    manager.close()
    lines = end_summary(deep)
    # The path cannot break: it stands alone on its line; every other line fits.
    fits([line for line in lines if str(deep) not in line])
    assert f"    {deep}" in lines, lines
    assert any(line.rstrip().endswith("…") or "…" in line for line in lines), lines  # the error cut short


def test_undying_status_of_the_ended_job_says_its_restarts_and_no_step_or_goodput(tmp_path: Path) -> None:
    manager, _ = torchrun_job(tmp_path)
    crash(manager, 1, time.time())
    finish(manager, time.time())
    manager.close()
    status = collect_status(str(tmp_path), None)
    assert status["has_steps"] is False and status["max_restarts"] == 3
    out = io.StringIO()
    render(status, Console(file=out, width=80, color_system=None, force_terminal=False))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    flat = " ".join(line.strip() for line in text.splitlines())
    assert "whole-group restarts: 1 (at most 3: --max-restarts)" in flat, text
    assert "crash of rank 1 (killed by SIGKILL); all 2 ranks started again" in flat, text
    assert "wall time" in flat and "no steps to count" in flat, text
    for word in ("step 0", "goodput", "progress:"):
        assert word not in text, (word, text)


def test_a_step_api_job_counts_recovered_incidents_as_the_launcher_does(tmp_path: Path) -> None:
    """A step-API job keeps its step and goodput lines; its count of recovered incidents is the
    manager's (status recovered), the MTTR only of the incidents that have one."""
    manager, _ = running(tmp_path)
    assert manager.status()["has_steps"] is True
    manager.close()
    incidents = [{"id": 1, "status": "recovered", "mttr_s": 2.0}, {"id": 2, "status": "recovered", "mttr_s": None},
                 {"id": 3, "status": "failed", "mttr_s": None}]
    assert incidents_line(incidents) == "incidents: 3, 2 recovered, mean MTTR 2.00 s"
    assert incidents_line([]) == "incidents: none"


@pytest.mark.parametrize(("step_api", "planned", "committed", "expected"), [
    (False, False, False, False), (True, False, False, True), (False, True, False, True),
    (False, False, True, True)])
def test_a_job_has_steps_when_its_script_uses_them(step_api: bool, planned: bool, committed: bool,
                                                   expected: bool) -> None:
    assert has_steps(step_api=step_api, planned=planned, committed=committed) is expected


def test_incidents_of_one_round_are_one_restart(tmp_path: Path) -> None:
    """Two ranks lost in the same round (a node's): one restart, both causes."""
    both = [{"id": 1, "recovery": 1, "fault_t": 5.0, "status": "recovered", "action": "restart",
             "detail": {"restart": 1}, "phases": {"replacement_ready": 0.2}},
            {"id": 2, "recovery": 1, "fault_t": 5.1, "status": "recovered", "action": "", "detail": {}},
            {"id": 3, "recovery": 0, "fault_t": 6.0, "status": "observed"}]
    [only] = rounds(both)
    assert only.restart == 1 and only.after_s == 0.2 and [i["id"] for i in only.incidents] == [1, 2]
    assert only.status == "recovered"


def test_undying_status_of_the_running_job_says_how_long_it_runs_and_its_restarts(tmp_path: Path) -> None:
    """The manager's live status (what `undying status` and --watch draw while the job runs)."""
    manager, _ = torchrun_job(tmp_path)
    crash(manager, 1, time.time())
    status = {**manager.status(), "live": True}
    manager.close()
    assert status["has_steps"] is False and status["max_restarts"] == 3
    out = io.StringIO()
    render(status, Console(file=out, width=80, color_system=None, force_terminal=False))
    text = out.getvalue()
    flat = " ".join(line.strip() for line in text.splitlines())
    assert "running for" in flat and "whole-group restarts: 1 (at most 3: --max-restarts)" in flat, text
    assert "crash of rank 1 (killed by SIGKILL); all 2 ranks started again" in flat, text
    for word in ("step 0", "goodput", "progress:", "ETA"):
        assert word not in text, (word, text)
