"""The metrics as Prometheus scrapes them from a real job's /metrics: before and after a crash, with saves."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.jobs import manager_url, start_job, wait_for
from undying.cli.client import api_get, api_post
from undying.jobfiles.records import IncidentKind
from undying.jobfiles.tokens import TOKEN_FILE, read_token_file

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# 2 ranks, 4 epochs of 32 steps at about 0.03 s, a checkpoint every 20 steps; stopped once checked.
JOB_ARGS = ["--epochs", "4", "--step-seconds", "0.03"]


def scrape(url: str, token: str) -> Samples:
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_real_jobs_metrics(tmp_path: Path, reap: list[int]) -> None:
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, JOB_ARGS, ranks=2, run_args=["--save-every", "20"], reap=reap)
    url = manager_url(job_dir)
    token = read_token_file(job_dir / TOKEN_FILE)
    wait_for(lambda: api_get(url, "/api/status", token=token)["step"] >= 5, 60, "the job to pass step 5")
    api_post(url, "/api/inject", {"kind": "crash", "rank": 1, "at_step": 50}, token=token)

    early = scrape(url, token)
    for kind in IncidentKind:  # every kind there, at 0, before the first incident
        assert early[("undying_incidents_total", (("kind", kind.value),))] == 0, kind
    assert early[("undying_step_seconds_count", ())] == early[("undying_step", ())] - 1 >= 4
    assert early[("undying_rank_step_seconds_count", (("rank", "1"),))] >= 3
    assert early[("undying_step_seconds_bucket", (("le", "+Inf"),))] == early[("undying_step_seconds_count", ())]

    wait_for(lambda: (s := api_get(url, "/api/status", token=token))["step"] >= 70 and s["incidents"]
             and s["incidents"][0]["status"] == "recovered", 90, "the crash recovered and step 70")
    got = scrape(url, token)
    status = api_get(url, "/api/status", token=token)
    api_post(url, "/api/stop", {}, token=token)
    launcher.wait(timeout=30)

    step = got[("undying_step", ())]
    assert got[("undying_incidents_total", (("kind", "crash"),))] == 1
    assert sum(v for (name, _), v in got.items() if name == "undying_incidents_total") == 1
    assert got[("undying_incident_actions_total", (("action", "replace"), ("kind", "crash")))] == 1
    assert got[("undying_recovery_seconds_count", ())] == 1
    # Each step of the job counted once (the first has no step before it), the crashed one included.
    assert got[("undying_step_seconds_count", ())] == step - 1
    assert got[("undying_step_seconds_sum", ())] >= 0.03 * (step - 1)
    # The recovery is inside a step's time (fault to first step done falls between two commits), so the
    # histogram's sum holds it: not a timing threshold (a warm recovery may take under 0.25 s here).
    mttr = status["incidents"][0]["mttr_s"]
    assert mttr is not None and got[("undying_step_seconds_sum", ())] >= mttr
    assert got[("undying_step_seconds_bucket", (("le", "+Inf"),))] == step - 1
    for rank in ("0", "1"):
        assert got[("undying_rank_step_seconds_count", (("rank", rank),))] >= step - 3
    assert got[("undying_checkpoint_last_step", ())] >= 60 and got[("undying_checkpoint_last_step", ())] % 20 == 0
    assert got[("undying_checkpoint_save_seconds_count", (("part", "write"),))] >= 3
    assert got[("undying_checkpoint_save_seconds_count", (("part", "blocking"),))] >= 3
    assert got[("undying_checkpoint_written_bytes_total", ())] >= 3 * got[("undying_checkpoint_bytes", ())] > 0
    assert got[("undying_checkpoint_failures_total", ())] == 0
    assert 0 < got[("undying_step_value", (("name", "loss"),))] < early[("undying_step_value", (("name", "loss"),))]
    # (read a moment apart from the status: a spare may have warmed up in between)
    assert abs(got[("undying_spares_ready", ())] - status["spares_ready"]) <= 1
