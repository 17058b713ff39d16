"""The commands that neither train nor read tensors never import torch (issue #17: an instant CLI).

Importing torch costs a second or more of CPU; an operator's `undying status` or
`undying inject` under load took seconds for it. Each command runs in a fresh
interpreter, as a user runs it, and reports whether torch got imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, sys
from undying.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print("\\n" + json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""

LIGHT = [
    ["--help"], ["--version"],
    ["status", "--help"], ["inject", "--help"], ["trace", "--help"], ["chaos", "--help"],
    ["checkpoints", "--help"], ["k8s", "--help"], ["diagnose", "--help"], ["run", "--help"],
    ["manager", "--help"], ["demo", "--help"],
]


def _run(argv: list[str], cwd: Path) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60,
                         cwd=cwd).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", LIGHT, ids=" ".join)
def test_help_and_version_do_not_import_torch(argv: list[str], tmp_path: Path) -> None:
    result = _run(argv, tmp_path)
    assert result["code"] in (0, None), result
    assert result["torch"] is False, f"undying {' '.join(argv)} imported torch"


def test_the_operators_commands_on_a_job_do_not_import_torch(tmp_path: Path) -> None:
    """status, inject, trace and checkpoints on a job dir (here one with no job: each says so, exit != 0)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    for argv in (["status", "--job-dir", str(job_dir)], ["inject", "crash", "--rank", "0", "--job-dir", str(job_dir)],
                 ["trace", "on", "--job-dir", str(job_dir)], ["checkpoints", "--root", str(tmp_path / "ckpts")]):
        result = _run(argv, tmp_path)
        assert result["torch"] is False, f"undying {' '.join(argv)} imported torch ({result})"
