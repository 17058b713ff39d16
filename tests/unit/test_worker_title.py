"""A worker's process title (undying.worker.title): the job and the rank, read back from /proc."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from undying.protocol.env import JOB_ID_ENV
from undying.worker.title import title_of


def test_the_title_names_the_job_the_rank_and_the_script() -> None:
    env = {JOB_ID_ENV: "job-1", "RANK": "3"}
    assert title_of(env, "/home/me/train.py") == "undying: job job-1 rank 3: train.py"
    assert title_of({}, "train.py") == "undying: job ? rank ?: train.py"


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="Linux's /proc")
def test_a_process_whose_environment_was_replaced_after_prepare_is_named() -> None:
    """As a zygote's child: prepare() at start, the environment replaced, then the title set."""
    code = textwrap.dedent(f"""
        import os
        from undying.worker.title import name_process, prepare
        prepare()
        os.environ.clear()
        os.environ.update({{"{JOB_ID_ENV}": "job-7", "RANK": "1", "PATH": "/usr/bin"}})
        name_process("/x/train.py")
        print(open("/proc/self/cmdline", "rb").read().split(b"\\0")[0].decode())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "undying: job job-7 rank 1: train.py", done.stderr
