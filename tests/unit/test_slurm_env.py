"""Slurm's environment read (launch/slurm.py), the flags it fills (cli/run_slurm.py) and the first
node's manager child (launch/slurm_node.py), without a cluster (test_slurm.py has one)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from undying.cli.main import build_parser
from undying.cli.run_slurm import apply_slurm
from undying.errors import UsageError
from undying.launch.slurm import expand_hostlist, manager_port, read_slurm
from undying.launch.slurm_node import ManagerChild, listen_address, wait_for_token

STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-09]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_NODEID": "1",
        "SLURM_SUBMIT_DIR": "/shared/me", "SLURM_RESTART_COUNT": "2"}


@pytest.mark.parametrize(("text", "names"), [
    ("n0", ["n0"]),
    ("n[0-2]", ["n0", "n1", "n2"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("x-[1-2].cl", ["x-1.cl", "x-2.cl"]),
])
def test_node_lists_expand_as_slurm_writes_them(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["n[1-", "n]1", "n[2-1]", "n[a]", "n[0-99999999]", "a,,b", ""])
def test_a_malformed_node_list_is_an_error_naming_it(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


@given(st.lists(st.tuples(st.sampled_from(["n", "gpu", "r1-"]), st.integers(0, 300),
                          st.integers(1, 4)), min_size=1, max_size=6))
def test_a_compressed_list_expands_to_the_names_it_was_made_from(
        parts: list[tuple[str, int, int]]) -> None:
    items, names = [], []
    for prefix, low, width in parts:
        high = low + 3
        items.append(f"{prefix}[{low:0{width}d}-{high:0{width}d}]")
        names += [f"{prefix}{n:0{width}d}" for n in range(low, high + 1)]
    assert expand_hostlist(",".join(items)) == names


def test_outside_slurm_nothing_is_read() -> None:
    assert read_slurm({"HOME": "/root"}) is None


def test_a_step_gives_the_job_its_nodes_this_nodes_rank_and_a_stable_job_id() -> None:
    step = read_slurm(STEP)
    assert step is not None
    assert step.nodes == ("gpu07", "gpu08", "gpu09") and step.node_rank == 1
    assert step.undying_job_id == "slurm-4242" and step.restart_count == 2
    assert step.job_dir == "/shared/me/undying-jobs/slurm-4242"
    assert manager_port("4242") == 29400 + 3 * (4242 % 500)
    assert 29400 <= manager_port("999999999") < 32768 - 2  # below the ephemeral ports


def test_a_batch_or_salloc_shell_is_refused_saying_what_to_write() -> None:
    shell = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(UsageError, match="srun --ntasks-per-node=1 undying run .*--standalone"):
        read_slurm(shell)


def test_several_tasks_on_a_node_are_refused_saying_what_to_write() -> None:
    with pytest.raises(UsageError, match=r"2 tasks on a node .*-n RANKS_PER_NODE"):
        read_slurm({**STEP, "SLURM_STEP_TASKS_PER_NODE": "1,2(x2)"})


@pytest.mark.parametrize(("name", "value"), [
    ("SLURM_NODEID", "7"), ("SLURM_NODEID", "one"), ("SLURM_STEP_NODELIST", "gpu[07-09"),
    ("SLURM_STEP_NODELIST", "gpu07,gpu07,gpu08"), ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
    ("SLURM_STEP_TASKS_PER_NODE", "x"), ("SLURM_JOB_ID", "12;rm"),
])
def test_step_variables_that_disagree_or_do_not_parse_are_named(name: str, value: str) -> None:
    with pytest.raises(UsageError, match=name):
        read_slurm({**STEP, name: value})


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv, "train.py"])


def test_slurm_fills_the_flags_left_open_and_a_given_flag_wins() -> None:
    args = _args("-n", "2")
    step = apply_slurm(args, {**STEP, "SLURM_NODEID": "0"})
    assert step is not None
    assert args.nnodes == (3, 3) and args.node_rank == 0
    assert args.job_id == "slurm-4242" and args.job_dir == "/shared/me/undying-jobs/slurm-4242"
    assert args.manager == f"gpu07:{manager_port('4242')}"
    given_args = _args("--nnodes", "2:3", "--job-id", "mine", "--job-dir", "/d", "--port", "31000")
    apply_slurm(given_args, STEP)
    assert given_args.nnodes == (2, 3) and given_args.job_id == "mine"
    assert given_args.job_dir == "/d" and given_args.manager == "gpu07:31000"
    assert given_args.node_rank == 1


@pytest.mark.parametrize("layout", [["--standalone"], ["--manager", "h:29400", "--nnodes", "2"],
                                    ["--rdzv-endpoint", "h:29400"]])
def test_a_layout_chosen_with_flags_keeps_slurm_out(layout: list[str]) -> None:
    args = _args(*layout)
    before = vars(args).copy()
    shell = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}  # would be refused
    assert apply_slurm(args, shell) is None
    assert vars(args) == before


def test_the_manager_listens_where_its_node_name_points_or_everywhere() -> None:
    assert listen_address("localhost") == "0.0.0.0"  # loopback is no use to other nodes
    assert listen_address("no-such-host.invalid") == "0.0.0.0"


def test_the_token_wait_is_bounded_and_says_why(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not on a filesystem every node shares"):
        wait_for_token(tmp_path, 0.3, lambda: None)
    with pytest.raises(UsageError, match="manager exited"):
        wait_for_token(tmp_path, 30, lambda: "the job's manager exited (1) before it started")
    (tmp_path / "token").write_text("x")
    os.chmod(tmp_path / "token", 0o600)  # as the manager writes it (test_slurm_node.py: others)
    wait_for_token(tmp_path, 0.3, lambda: None)


def test_a_killed_manager_child_is_started_again_and_ends_with_the_job(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    code = (f"import os, time; open({str(starts)!r}, 'a').write('x');"
            f"time.sleep(0.5 if os.path.getsize({str(starts)!r}) > 1 else 60); raise SystemExit(75)")
    child = ManagerChild([sys.executable, "-c", code])
    child.start()
    try:
        deadline = time.monotonic() + 30
        while not starts.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.process is not None
        first = child.process.pid
        os.kill(first, signal.SIGKILL)
        while (child.process.pid == first or starts.read_text() != "xx") \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.restarts == 1 and child.process.pid != first
        assert child.exited() is None  # restarted: not "exited before it started"
        assert child.finish(0) == 75  # the node's exit code is the manager's (the job's)
    finally:
        child.stop()


def _script(*argv: str) -> str:
    args = build_parser().parse_args(["slurm", *argv])
    from undying.cli.slurm import batch_script

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return batch_script(args, command)


def test_the_batch_script_has_each_line_a_preemptible_job_needs() -> None:
    text = _script("--nodes", "3", "-n", "4", "--min-nodes", "2", "--time", "1:00:00",
                   "--grace", "90", "--undying", "python3 -m undying", "--", "train.py", "--x",
                   "a b")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in ("--nodes=3", "--ntasks-per-node=1", "--time=1:00:00", "--requeue",
                   "--signal=B:TERM@90", "--open-mode=append"):
        assert any(line.startswith(f"#SBATCH {option}") for line in lines), (option, text)
    assert "trap 'scancel --signal=TERM \"$SLURM_JOB_ID\"' TERM" in lines
    (srun,) = [line for line in lines if line.startswith("srun ")]
    assert srun == ("srun --ntasks-per-node=1 --kill-on-bad-exit=0 python3 -m undying run -n 4 "
                    "--nnodes 2:3 --max-requeues 20 --save-interval 600 train.py --x 'a b' &")
    assert "--requeue" not in _script("--nodes", "1", "-n", "1", "--no-requeue", "--", "t.py")


@pytest.mark.parametrize("argv", [["--nodes", "0", "-n", "1"], ["--nodes", "1", "-n", "1",
                                   "--time", "1h"], ["--nodes", "1", "-n", "1", "--partition",
                                   "a;b"], ["--nodes", "1", "-n", "1", "--job-name", "$(x)"]])
def test_the_batch_script_refuses_what_sbatch_would_not_take(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["slurm", *argv, "--", "t.py"])


def test_undying_slurm_writes_a_new_file_or_says_why_not(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from undying.cli.main import main

    out = tmp_path / "job.sh"
    assert main(["slurm", "--nodes", "2", "-n", "2", "--out", str(out), "--", "t.py"]) == 0
    assert out.read_text().startswith("#!/bin/bash") and "sbatch" in capsys.readouterr().err
    assert main(["slurm", "--nodes", "2", "-n", "2", "--out", str(out), "--", "t.py"]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["slurm", "--nodes", "2", "-n", "2"]) == 2
    assert "after --" in capsys.readouterr().err


def test_spare_nodes_are_the_step_s_last_nodes_and_join_as_standbys() -> None:
    three = {**STEP, "SLURM_NODEID": "2"}
    last = _args("--spare-nodes", "1")
    apply_slurm(last, three)
    assert last.nnodes == (2, 2) and last.standby and last.node_rank == 0
    first = _args("--spare-nodes", "1")
    apply_slurm(first, {**STEP, "SLURM_NODEID": "1"})
    assert first.nnodes == (2, 2) and not first.standby and first.node_rank == 1
    fewer = _args("--nnodes", "2")  # the same, said as --nnodes below the step's node count
    apply_slurm(fewer, three)
    assert fewer.standby
    with pytest.raises(UsageError, match="leaves no node to train on"):
        apply_slurm(_args("--spare-nodes", "3"), STEP)
    with pytest.raises(UsageError, match="disagree"):
        apply_slurm(_args("--spare-nodes", "1", "--nnodes", "3"), STEP)


def test_the_batch_script_asks_for_spare_nodes_and_keeps_the_job_when_one_fails() -> None:
    text = _script("--nodes", "2", "-n", "2", "--spare-nodes", "1", "--", "t.py")
    assert "#SBATCH --nodes=3" in text and "#SBATCH --no-kill" in text
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    assert "--no-kill" in srun and "--spare-nodes 1" in srun
