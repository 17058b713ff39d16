"""``undying status`` reads at 80 columns and at 200; progress, goodput and a slow rank's finding in words."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tests.unit.test_status_watch import Scripted, scripted, status  # noqa: F401 - scripted is a fixture
from undying.cli.main import main
from undying.cli.status import watch
from undying.cli.status_view import render, slow_finding

SLOW = {"id": 2, "kind": "slow_rank", "rank": 2, "step": 240, "action": "", "status": "observed", "mttr_s": None,
        "phases": {"detected": 0.412}, "error": "", "traceback": "",
        "detail": {"rank": 2, "phase": "compute", "factor": 1.5, "excess_s": 0.0077, "since_step": 233,
                   "evidence": {"window": [233, 240]}}}
CRASH = {"id": 1, "kind": "checkpoint_failed", "rank": 0, "step": 17, "action": "replace", "status": "recovered",
         "mttr_s": 12.345,
         "phases": {"detected": 0.012, "decided": 0.02, "replacement_ready": 1.101, "group_rebuilt": 1.2,
                    "state_restored": 1.31, "first_step_done": 12.345},
         "error": "RuntimeError: " + "a long message from the user's script that goes on " * 3, "traceback": ""}
PROGRESS = {"step": 240, "total_steps": 10000, "fraction": 0.024, "epoch": 0, "epochs": 3, "steps_per_s": 12.5,
            "samples_per_s": 800.0, "eta_s": 780.8, "values_step": 240,
            "values": {"loss": 0.2125, "grad_norm": 1.75, "learning_rate": 3e-4}}
GOODPUT = {"ratio": 0.861, "wall_s": 41.2, "goodput_s": 35.5,
           "losses": {"startup": 3.1, "checkpoint": 0.4, "detection": 0.01, "recovery": 0.3, "spare_wait": 1.1,
                      "rerun": 0.05, "preemption": 0.0, "shutdown": 0.0, "in_flight": 0.74},
           "incidents": [{"id": 1, "kind": "crash", "detection_s": 0.01, "recovery_s": 0.3, "spare_wait_s": 1.1,
                          "rerun_s": 0.05}]}


def busy_status() -> dict[str, Any]:
    """A job with everything the view can show, with long values where a job can have them."""
    base = status("running", 240, [CRASH, SLOW])
    return dict(base, job_id="a-job-id-of-some-length-2026-11-25", progress=PROGRESS, goodput=GOODPUT,
                started_at=time.time() - 41, live=True, world_size=4,
                ranks=[{"rank": r, "node": r // 2, "pid": 4_000_000 + r, "state": "recovering", "step": 1_000_000,
                        "generation": 12, "restarts": 3, "phase": "checkpoint"} for r in range(4)])


def rendered(data: dict[str, Any], width: int) -> str:
    out = io.StringIO()
    render(data, Console(file=out, width=width, color_system=None, force_terminal=False))
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 200])
def test_every_line_of_the_status_fits_and_nothing_is_cut(width: int) -> None:
    text = rendered(busy_status(), width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text, "a cell was cut short"
    flat = " ".join(line.strip() for line in lines)
    # Every cell and detail is there whole (folded or wrapped at 80, but whole).
    for needle in ("checkpoint_failed", "observed", "12.345", "4000003", "1000000", "recovering",
                   "first_step_done 12.345", "grad_norm 1.75", "learning_rate 0.0003", "ETA 13 min 1 s",
                   "goodput 86.1%"):
        assert needle in flat.replace(" ", "") or needle in flat, (needle, text)
    assert "rank 2 slower since step 233, +7.7 ms a step (x1.50) in compute" in flat


def test_at_200_columns_each_incident_detail_is_one_line() -> None:
    lines = rendered(busy_status(), 200).splitlines()
    assert any(line.startswith("  #1 timeline (s since fault): detected 0.012") and line.endswith("12.345")
               for line in lines)
    assert any(line.strip().startswith("progress: step 240 of 10000 (2%), epoch 1 of 3, 12.5 steps/s, "
                                       "800 samples/s, ETA 13 min 1 s") for line in lines)
    assert any("cost in wall time: detection 0.01 s, recovery 0.30 s, waiting for a replacement 1.10 s, "
               "re-run work 0.05 s" in line for line in lines)


def test_a_slow_finding_in_words_and_other_incidents_have_none() -> None:
    assert slow_finding(SLOW) == "rank 2 slower since step 233, +7.7 ms a step (x1.50) in compute"
    node = dict(SLOW, kind="slow_node", detail={"node": "host-b", "ranks": [2, 3], "phase": "data",
                                                "excess_s": 0.02, "since_step": 10, "factor": None})
    assert slow_finding(node) == "node host-b (ranks 2, 3) slower since step 10, +20.0 ms a step in data"
    assert slow_finding(CRASH) == ""
    # An older manager's finding without details still says whose and since when.
    assert slow_finding(dict(SLOW, detail={})) == "rank 2 slower since step 240"


def test_a_status_without_progress_or_goodput_still_renders() -> None:
    """An older manager's /api/status has neither field: the view shows what there is."""
    text = rendered(status("running", 3), 80)
    assert "job w1: running" in text and "progress" not in text and "goodput" not in text


def test_watch_draws_a_progress_bar_and_ends_with_the_job(scripted: list[Scripted]) -> None:  # noqa: F811
    first = dict(status("running", 2), progress=dict(PROGRESS, step=2, fraction=0.5, total_steps=4))
    last = dict(status("succeeded", 4), progress=dict(PROGRESS, step=4, fraction=1.0, total_steps=4, eta_s=None),
                goodput=GOODPUT)
    api = Scripted([first, last])
    scripted.append(api)
    out = io.StringIO()
    con = Console(file=out, width=80, color_system=None, force_terminal=False)
    assert watch(None, api.url, con, interval=0.1) == 0
    text = out.getvalue()
    assert "━" in text and "4/4" in text, "a progress bar"
    assert "progress: step 4 of 4 (100%)" in text and "goodput 86.1%" in text
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("value", ["0", "0.01", "-1", "nan", "inf", "5000", "soon"])
def test_watch_interval_is_bounded(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--watch", "--interval", value, "--manager", "127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "--interval must be" in err and value in err and err.count("\n") == 1


def test_steps_needs_the_job_dir_and_does_not_mix_with_watch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--steps", "--manager", "127.0.0.1:9"]) == 2
    assert "--steps reads the job's event log: pass --job-dir" in capsys.readouterr().err
    assert main(["status", "--steps", "--watch", "--manager", "127.0.0.1:9"]) == 2
    assert "does not mix with --watch" in capsys.readouterr().err


@pytest.mark.parametrize("width", [80, 200])
def test_the_checkpoint_listing_fits_and_names_each_problem(width: int, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from undying.checkpoint import save_replicated
    from undying.checkpoint.mac import key_from_token, using_key

    root = tmp_path / ("a-checkpoint-root-whose-path-is-long-" * 3) / "checkpoints"
    with using_key(key_from_token(os.environ["UNDYING_TOKEN"])):  # signed as a job of the session's token
        save_replicated(root, 10, {"w": torch.ones(10)}, job_id="j", world_size=4)
        save_replicated(root, 20, {"w": torch.ones(10)}, job_id="j", world_size=4, kind="dying-gasp")
    state = root / "step-000000020" / "state.pt"
    with open(state, "r+b") as f:
        f.truncate(10)
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(["checkpoints", "list", "--root", str(root)]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= width and "…" not in text
    flat = "".join(line.strip() for line in text.splitlines())
    assert "dying-gasp" in flat and "periodic" in flat and str(root).replace(" ", "") in flat
    assert "step 20 (step-000000020): file state.pt has size 10, manifest says" in " ".join(text.split())


def test_the_banner_names_the_job_its_folder_page_and_status_command() -> None:
    from undying.cli.summary import banner

    lines = banner("j1", "/jobs/j1", "http://127.0.0.1:8080", ranks=4)
    assert lines[0] == "undying: job j1 started, 4 ranks"
    assert "job dir:     /jobs/j1" in lines[1]
    # The page's URL on a line of its own (a terminal makes it a link), how to open it below it.
    assert lines[2] == "  status page: http://127.0.0.1:8080/"
    assert lines[3] == "               (add ?token=<the token in /jobs/j1/token>)"
    assert "status:      undying status --job-dir /jobs/j1" in lines[4]
    assert "open to anyone" in banner("j1", "/jobs/j1", "http://h:1/", ranks=1, open_status=True)[3]
    assert all(len(line) <= 80 for line in lines)


def test_durations_and_losses_in_words() -> None:
    from undying.cli.summary import duration, loss_words

    assert [duration(s) for s in (0.4213, 41.25, 725, 11045, None)] == ["0.42 s", "41.2 s", "12 min 5 s",
                                                                       "3 h 4 min", "-"]
    words = loss_words({"wall_s": 100.0, "losses": {"startup": 3.0, "rerun": 0.01, "spare_wait": 5.0}})
    assert words == "waiting for a replacement 5.00 s, start-up 3.00 s"  # (0.01 s of 100 s: below notice)


def test_an_end_summary_of_a_log_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    from undying.cli.summary import print_end_summary

    out = io.StringIO()
    print_end_summary(tmp_path / "no-such-job", out=out)
    assert out.getvalue().startswith("undying: no summary: the job's log in ") and out.getvalue().count("\n") == 1


def test_the_demos_report_fits_80_columns_with_nothing_cut() -> None:
    """The demo's incidents at 80 columns: no cell cut to "…", each timeline on a line of its own."""
    from undying.cli.demo import _render

    phases = {"detected": 0.012, "decided": 0.013, "replacement_ready": 0.121, "group_rebuilt": 0.187,
              "state_restored": 0.203, "first_step_done": 0.254}
    result = {"incidents": [{"kind": "crash", "rank": 2, "step": 11, "action": "replace", "status": "recovered",
                             "mttr_s": 0.254, "phases": phases}],
              "identical": True, "steps": 384, "final_state_identical": True, "lost_steps": 0, "wall_s": 18.9,
              "reasons": [], "ok": True}
    out = io.StringIO()
    _render(result, Console(file=out, width=80, color_system=None))
    text = out.getvalue()
    assert "…" not in text, text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    for word in ("crash", "replace", "recovered", "0.254", "first_step_done 0.254", "detected 0.012"):
        assert word in text, (word, text)
