"""``undying checkpoints list|verify|show`` on real folders, and its answers to bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from undying.checkpoint import save_replicated
from undying.checkpoint.mac import key_from_token, using_key
from undying.cli.main import main


@pytest.fixture
def job(tmp_path: Path) -> Path:
    job_dir = tmp_path / "job"
    root = job_dir / "checkpoints"
    # Written as a job writes them: signed under the key of its token (the session's, from env).
    with using_key(key_from_token(os.environ["UNDYING_TOKEN"])):
        save_replicated(root, 10, {"w": torch.ones(100)}, job_id="j", world_size=4)
        save_replicated(root, 20, {"w": torch.ones(100)}, job_id="j", world_size=4, kind="dying-gasp")
    return job_dir


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["checkpoints", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_list(capsys: pytest.CaptureFixture[str], job: Path) -> None:
    rc, out, _ = run(capsys, "list", "--job-dir", str(job))
    assert rc == 0
    assert "dying-gasp" in out and "periodic" in out and "yes" in out
    rc, out, _ = run(capsys, "list", "--root", str(job / "checkpoints"), "--json")
    rows = json.loads(out)["checkpoints"]
    assert [(r["step"], r["kind"], r["world_size"], r["valid"]) for r in rows] == [
        (10, "periodic", 4, True),
        (20, "dying-gasp", 4, True),
    ]
    assert all(r["bytes"] > 400 and 0 <= r["age_s"] < 60 for r in rows)


def test_verify_names_every_problem(capsys: pytest.CaptureFixture[str], job: Path) -> None:
    rc, out, _ = run(capsys, "verify", "--job-dir", str(job))
    assert rc == 0 and out.count("ok ") == 2
    state = job / "checkpoints" / "step-000000020" / "state.pt"
    size = state.stat().st_size
    with open(state, "r+b") as f:
        f.truncate(10)
    (job / "checkpoints" / "step-000000010" / "manifest.json").unlink()
    rc, out, _ = run(capsys, "verify", "--job-dir", str(job))
    assert rc == 1
    assert f"step-000000020: file state.pt has size 10, manifest says {size}" in out
    assert "step-000000010: no manifest.json" in out
    assert "2 of 2 checkpoints invalid" in out
    rc, out, _ = run(capsys, "verify", "--job-dir", str(job), "--json")
    assert rc == 1 and json.loads(out)["ok"] is False
    rc, out, _ = run(capsys, "list", "--job-dir", str(job))
    assert rc == 0 and "no" in out


def test_show(capsys: pytest.CaptureFixture[str], job: Path) -> None:
    rc, out, _ = run(capsys, "show", "--job-dir", str(job), "--json")
    data = json.loads(out)
    assert rc == 0 and data["valid"] and data["manifest"]["step"] == 20
    assert data["manifest"]["files"][0]["path"] == "state.pt"
    rc, out, _ = run(capsys, "show", "--job-dir", str(job), "--step", "10")
    assert rc == 0 and '"kind": "periodic"' in out and "valid" in out.splitlines()[0]


def bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (out, err)
    assert err.startswith("undying: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_input(capsys: pytest.CaptureFixture[str], job: Path, tmp_path: Path) -> None:
    assert "job dir" in bad(capsys, "list", "--job-dir", str(tmp_path / "missing"))
    empty = tmp_path / "empty-job"
    empty.mkdir()
    err = bad(capsys, "list", "--job-dir", str(empty))
    assert "has no checkpoints folder" in err and "--root" in err
    assert f"checkpoint root {tmp_path / 'nope'} does not exist" in bad(capsys, "verify", "--root", str(tmp_path / "nope"))
    assert "nosuchproto://x" in bad(capsys, "list", "--root", "nosuchproto://x")
    assert "no checkpoint at step 99" in bad(capsys, "show", "--job-dir", str(job), "--step", "99")


def test_subprocess_entry_point(job: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "undying", "checkpoints", "verify", "--job-dir", str(job)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok ") == 2


def test_list_names_a_live_owner_and_what_was_set_aside(capsys: pytest.CaptureFixture[str], job: Path) -> None:
    """The folder's owner while a job holds it (a real process holding the lock), none once it is killed (its
    file left behind is no owner), and the rejected checkpoints a --start-fresh set aside, where they are."""
    import subprocess
    import sys

    from undying.checkpoint.aside import set_aside
    from undying.checkpoint.store import Store

    root = job / "checkpoints"
    set_aside(Store.open(root), "step-000000010", "a test", batch="B")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom undying.checkpoint import lock\n"
                               "lock.hold(sys.argv[1], job_id='busy'); print('HELD', flush=True)\n"
                               "time.sleep(60)", str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"
        rc, out, _ = run(capsys, "list", "--root", str(root), "--json")
        listing = json.loads(out)
        assert rc == 0 and [r["step"] for r in listing["checkpoints"]] == [20]
        assert listing["owner"].startswith(f"job busy (pid {holder.pid} on host")
        assert listing["rejected"] == [{"path": str(root / "rejected" / "B"), "checkpoints": 1}]
        rc, out, _ = run(capsys, "list", "--root", str(root))
        assert f"in use by job busy (pid {holder.pid}" in out
        assert f"set aside: 1 rejected checkpoint(s) in {root / 'rejected' / 'B'}" in out.replace("\n", "")
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert (root / "undying.lock").exists()  # (killed: its file stays, and holds nothing)
    rc, out, _ = run(capsys, "list", "--root", str(root), "--json")
    assert json.loads(out)["owner"] is None
