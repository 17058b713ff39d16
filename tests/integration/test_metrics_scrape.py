"""The metrics as Prometheus scrapes them from a real job's /metrics: before and after a crash, with saves;
and a job found through its file_sd target file and scraped with the user's credential, as docs/metrics.md
configures Prometheus (by the real Prometheus, where it is installed)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.jobs import manager_url, start_job, wait_for
from undying.cli.client import api_get, api_post
from undying.demo import TRAIN_SCRIPT
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.records import IncidentKind
from undying.jobfiles.tokens import TOKEN_FILE, read_token_file
from undying.protocol.env import PROMETHEUS_DIR_ENV

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


ROOT = Path(__file__).resolve().parents[2]
# The docs' folder, for the user "alice" they write it for; the test's own folder takes its place.
DOCS_FOLDER = "/home/alice/.local/state/undying/prometheus"


def docs_scrape_config() -> str:
    """The scrape config of docs/metrics.md that finds every job (the YAML block with file_sd_configs)."""
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "metrics.md").read_text(), re.S)
    (block,) = [b for b in blocks if "file_sd_configs" in b]
    assert DOCS_FOLDER in block
    return block


def http(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_job_found_by_its_target_file_and_scraped_with_the_credential_as_the_docs_configure_prometheus(
        tmp_path: Path, reap: list[int]) -> None:
    folder, job_dir = tmp_path / "prometheus", tmp_path / "job"
    config_text = docs_scrape_config().replace(DOCS_FOLDER, str(folder))
    (config,) = yaml.safe_load(config_text)["scrape_configs"]
    (files,) = config["file_sd_configs"][0]["files"]
    # The port a job used to take by default is held (by a first job, say): a job on one node takes a free one.
    holder = socket.socket()
    with contextlib.suppress(OSError):  # (held by someone else already: just as good)
        holder.bind(("127.0.0.1", 29500))
        holder.listen()
    argv = [sys.executable, "-m", "undying", "run", "-n", "2", "--job-dir", str(job_dir), "--stop-grace", "3",
            str(TRAIN_SCRIPT), "--epochs", "40", "--step-seconds", "0.03"]
    with open(tmp_path / "job.log", "wb") as log:
        launcher = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, PROMETHEUS_DIR_ENV: str(folder)})
    reap.append(launcher.pid)
    # The real Prometheus where there is one, started beside the job on the folder made first, as the docs say.
    folder.mkdir(mode=0o755)
    prometheus, api = _start_prometheus(tmp_path, config_text, reap) if shutil.which("prometheus") else (None, "")
    try:
        url = manager_url(job_dir)
        job_id = (JobDir(job_dir).read_manager() or {})["job_id"]
        (target_file,) = wait_for(lambda: glob.glob(files), 30, "the job's target file")
        (group,) = json.loads(Path(target_file).read_text())
        assert [f"http://{t}" for t in group["targets"]] == [url]
        assert group["labels"]["undying_job"] == job_id
        token = read_token_file(job_dir / TOKEN_FILE)
        wait_for(lambda: api_get(url, "/api/status", token=token)["step"] >= 2, 60, "the job to pass step 2")

        # As the config says: Bearer, from credentials_file, to each target of the file_sd files.
        credential = Path(config["authorization"]["credentials_file"]).read_text().strip()
        assert credential != token
        target = f"http://{group['targets'][0]}"
        code, text = http(target + "/metrics", {"Authorization": f"Bearer {credential}"})
        assert code == 200, text
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"undying_step", "undying_incidents"} <= names, names
        assert http(target + "/metrics")[0] == 401
        assert http(target + "/api/status", {"Authorization": f"Bearer {credential}"})[0] == 401

        if prometheus is not None:
            seen = wait_for(lambda: _up(api), 60, "Prometheus to scrape the job (see prometheus.log)")
            assert seen["scrapeUrl"] == url + "/metrics" and seen["labels"]["undying_job"] == job_id, seen
            assert not [k for k in seen["labels"] if k.startswith("__")], seen
            series = wait_for(lambda: _query(api, "undying_step"), 30, "the job's undying_step in Prometheus")
            assert series[0]["metric"]["undying_job"] == job_id, series
    finally:
        holder.close()
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
    api_post(url, "/api/stop", {}, token=token)
    assert launcher.wait(timeout=60) in (0, 130)
    assert glob.glob(files) == []  # the job is over: its target file is gone
    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus here (apt-get install prometheus): the docs' config was followed by hand, "
                    "not run by the real Prometheus")


def _start_prometheus(tmp_path: Path, config_text: str, reap: list[int]) -> tuple[subprocess.Popen[bytes], str]:
    """The real Prometheus on the docs' config, on a free loopback port; it and its API's URL."""
    (tmp_path / "prometheus.yml").write_text(config_text)
    port = free_port()
    argv = ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}"]
    with open(tmp_path / "prometheus.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    reap.append(process.pid)
    return process, f"http://127.0.0.1:{port}"


def _up(api: str) -> dict[str, Any] | None:
    """The first target Prometheus scraped successfully, or None."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        code, text = http(api + "/api/v1/targets")
        if code == 200:
            return next((t for t in json.loads(text)["data"]["activeTargets"] if t["health"] == "up"), None)
    return None


def _query(api: str, query: str) -> list[dict[str, Any]] | None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        code, text = http(f"{api}/api/v1/query?query={query}")
        if code == 200:
            return list(json.loads(text)["data"]["result"]) or None
    return None
