"""A collective that fails while every process lives is retried in place, and so is a generation that fails to
form."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from tests.integration.jobs import events, manager_url, rank_events, start_job, wait_for
from tests.oracle import Oracle, comm_error
from undying.cli.client import api_get, api_post
from undying.demo.oracle import compare_runs, load_run
from undying.jobfiles.tokens import TOKEN_FILE, read_token_file

# Both in one job, one after the other: the first's retry is over long before the second's step.
COMM_ERRORS = [comm_error(1, 6, "backward"), comm_error(0, 11, "forward")]


def test_comm_error_is_retried_with_the_same_processes(oracle: Oracle, tmp_path: Path) -> None:
    outcome = oracle.assert_survives(tmp_path / "job", COMM_ERRORS)
    assert [(i["kind"], i["action"], i["rank"]) for i in outcome.incidents] == [
        ("comm-error", "retry", e.rank) for e in COMM_ERRORS], outcome.incidents
    assert all(i["detail"]["injected"] is True for i in outcome.incidents)
    assert not [e for e in outcome.events("spawned") if e["joining"]], "no process was replaced"
    assert not [e for e in outcome.events("exited") if e["returncode"] != 0], "no process died"
    assert [e["generation"] for e in outcome.events("generation_opened")] == [0, 1, 2], "a generation per retry"


def test_a_comm_error_that_repeats_past_max_retries_replaces_the_rank(oracle: Oracle, tmp_path: Path) -> None:
    """Retry, retry, then the ladder's next rung: the rank whose links keep failing is replaced."""
    faults = [comm_error(1, 6, "backward") for _ in range(3)]
    outcome = oracle.assert_survives(tmp_path / "job", faults,
                                     extra_run_args=("--spares", "0", "--max-retries", "2"))
    actions = [(i["kind"], i["rank"], i["step"], i["action"]) for i in outcome.incidents]
    assert actions == [("comm-error", 1, 6, "retry")] * 2 + [("comm-error", 1, 6, "replace")], actions
    assert "--max-retries 2" in outcome.incidents[-1]["detail"]["reason"]
    replaced = [e for e in outcome.events("spawned") if e["joining"]]
    assert [e["rank"] for e in replaced] == [1]
    killed = [e for e in outcome.events("exited") if e["rank"] == 1 and e["returncode"] == -9]
    assert len(killed) == 1


# 4 ranks, 2 epochs of 32 steps paced at 0.05 s (the reference runs unpaced, the suite's 4-rank one): the faults
# land mid-job. gloo waits for a generation's
# members as long as for a collective (--collective-timeout, 10 s here); the stopped rank beats again long
# before --heartbeat-timeout (60 s).
FORMING_ARGS = ["--epochs", "2", "--step-seconds", "0.05"]


def test_a_generation_that_fails_to_form_is_told_and_replaced_not_waited_out(
        oracle: Oracle, tmp_path: Path, reap: list[int]) -> None:
    """Rank 3 dies at step 8. Rank 1 leaves the old generation and stops (SIGSTOP) before it joins the next:
    the others give that generation up after --collective-timeout, with every process alive. Nothing else
    tells the manager (no exit, and rank 1 is not silent for long): each such rank reports the generation it
    could not form, and the manager opens the next one at once, blaming the rank that never came (the one
    replaced should it keep failing). Before, they waited for a replacement that never came, up to
    --rendezvous-timeout (5 minutes), and failed. Rank 1, continued, meets the others in
    it; the losses are those of the run without faults."""
    job_dir = tmp_path / "job"
    db = job_dir / "events.db"
    launcher = start_job(job_dir, FORMING_ARGS, ranks=4, reap=reap,
                         run_args=["--spares", "0", "--collective-timeout", "10", "--heartbeat-timeout", "60"])
    url = manager_url(job_dir)
    token = read_token_file(job_dir / TOKEN_FILE)
    wait_for(lambda: api_get(url, "/api/status", token=token)["step"] >= 2, 60, "the job to pass step 2")
    api_post(url, "/api/inject", {"kind": "hang", "rank": 1, "at_step": 1, "phase": "join"}, token=token)
    api_post(url, "/api/inject", {"kind": "crash", "rank": 3, "at_step": 8}, token=token)

    def opened(after: int) -> list[dict[str, Any]]:
        return [e for e in rank_events(db, "generation_opened") if e["generation"] > after]

    wait_for(lambda: [e for e in rank_events(db, "fault_injected") if e["rank"] == 1 and e["phase"] == "join"], 60,
             "rank 1 to stop at its join")
    (stopped,) = [e["pid"] for e in rank_events(db, "spawned") if e["rank"] == 1]
    try:
        [crash_round] = [e["generation"] for e in opened(-1) if e["reason"].startswith("crash of rank 3")]
        unformed = wait_for(lambda: [e for e in rank_events(db, "comm_failure")
                                     if e["generation"] == crash_round and "failed to form" in e["error"]], 60,
                            "a rank to report the generation it could not form")
        assert {e["rank"] for e in unformed} <= {0, 2, 3}, unformed
        # (rank 1 continues once the next one is open: it meets the others there, not half-way through)
        wait_for(lambda: opened(crash_round), 30, "the manager to open the next generation")
    finally:
        os.kill(stopped, signal.SIGCONT)
    assert launcher.wait(timeout=120) == 0, (job_dir.parent / "job.log").read_text()[-3000:]
    run = load_run(db)
    comparison = compare_runs(oracle.baseline(FORMING_ARGS, 4), run)
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons
    crashed = [i for i in run.incidents if i["kind"] == "crash"]
    assert [(i["rank"], i["action"]) for i in crashed] == [(3, "replace")], run.incidents
    retried = [i for i in run.incidents if i["kind"] != "crash"]
    assert retried and all(i["kind"] == "comm-error" and i["action"] == "retry" and i["rank"] == 1
                           and "failed to form: rank 1 never came" in i["error"] for i in retried), run.incidents
    assert all(i["status"] == "recovered" for i in run.incidents), run.incidents
    assert [e["rank"] for e in rank_events(db, "spawned") if e["joining"]] == [3], "rank 1 kept its process"
    assert events(db, "hang_detected") == [] and events(db, "left_behind") == []
