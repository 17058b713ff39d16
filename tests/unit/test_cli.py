"""The CLI's answers to bad input: exit code 2 and one line naming the problem, before anything starts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from undying.cli.main import main
from undying.config import JobConfig


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('training')\n")
    return path


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    # Never created by these tests: every command must fail before preparing it.
    return tmp_path / "job"


def fails(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("undying: error: "), err
    for word in words:
        assert word in lines[0], err
    return lines[0]


def test_run_with_a_missing_script(capsys: pytest.CaptureFixture[str], tmp_path: Path, job_dir: Path) -> None:
    missing = tmp_path / "nope.py"
    fails(capsys, ["run", "--job-dir", str(job_dir), str(missing)], f"training script {missing} does not exist")
    assert not job_dir.exists()


def test_run_with_a_folder_as_script(capsys: pytest.CaptureFixture[str], tmp_path: Path, job_dir: Path) -> None:
    fails(capsys, ["run", "--job-dir", str(job_dir), str(tmp_path)], "is a folder, not a file")  # (said: "does not exist")


@pytest.mark.parametrize("n", ["0", "-1"])
def test_run_with_no_processes(capsys: pytest.CaptureFixture[str], script: Path, job_dir: Path, n: str) -> None:
    fails(capsys, ["run", "-n", n, "--job-dir", str(job_dir), str(script)], "--nproc-per-node must be at least 1")
    assert not job_dir.exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--nnodes", "2"], ["--nnodes > 1 needs --manager", "undying manager"]),
        (["--node-rank", "1"], ["needs --manager"]),
        (["--manager", "h:1"], ["--manager needs --job-id"]),
        (["--manager", "nohost", "--job-id", "j"], ["expected HOST:PORT"]),
        (["--manager", "h:99999", "--job-id", "j"], ["expected HOST:PORT"]),
        (["--nnodes", "2", "--node-rank", "2", "--manager", "h:1", "--job-id", "j"], ["--node-rank must be in [0, 2)"]),
        (["--nnodes", "2", "--manager", "h:1", "--job-id", "j"], ["no token", "--token-file"]),
        (["--nnodes", "3:2", "--manager", "h:1", "--job-id", "j"], ["--nnodes 3:2", "1 <= MIN <= MAX"]),
        (["--nnodes", "0:2", "--manager", "h:1", "--job-id", "j"], ["1 <= MIN <= MAX"]),
        (["--nnodes", "two", "--manager", "h:1", "--job-id", "j"], ["expected N or MIN:MAX", "'two'"]),
        (["--nnodes", "1:2"], ["needs --manager"]),
    ],
)
def test_run_multi_node_bad_input(capsys: pytest.CaptureFixture[str], script: Path, job_dir: Path,
                                  flags: list[str], words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNDYING_TOKEN", raising=False)
    fails(capsys, ["run", *flags, "--job-dir", str(job_dir), str(script)], *words)
    assert not job_dir.exists()


@pytest.mark.parametrize(
    "flag",
    ["--rendezvous-timeout", "--connect-timeout", "--collective-timeout", "--recovery-timeout",
     "--comm-error-grace", "--stop-grace"],
)
@pytest.mark.parametrize("value", ["0", "-5", "1e6"])
def test_run_with_a_bad_timeout(capsys: pytest.CaptureFixture[str], script: Path, job_dir: Path, flag: str,
                                value: str) -> None:
    fails(capsys, ["run", flag, value, "--job-dir", str(job_dir), str(script)], f"{flag} must be > 0")
    assert not job_dir.exists()


@pytest.mark.parametrize(("flags", "words"), [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--step-timeout", "0"], "must be > 0 seconds (or 'auto')"),
    (["--step-timeout", "soon"], "expected seconds or 'auto'"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["--job-id", "a/b"], "--job-id 'a/b'"),
    (["--job-id", ".."], "--job-id '..'"),
])
def test_run_with_other_bad_flags(capsys: pytest.CaptureFixture[str], script: Path, job_dir: Path,
                                  flags: list[str], words: str) -> None:
    fails(capsys, ["run", *flags, "--job-dir", str(job_dir), str(script)], words)
    assert not job_dir.exists()


def test_run_in_a_read_only_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path, script: Path) -> None:
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        probe = parent / "probe"
        try:
            probe.mkdir()
        except OSError:
            pass
        else:
            probe.rmdir()
            pytest.skip("the folder is writable despite mode 0o500 (running as root)")
        job = parent / "job"
        fails(capsys, ["run", "--port", "0", "--job-dir", str(job), str(script)], f"job dir {job} is not writable")
    finally:
        parent.chmod(0o700)


def test_run_with_a_job_dir_under_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, script: Path) -> None:
    # Not writable for anyone, root included.
    job = script / "job"
    # (refused before anything, by the folder check: it said "job dir JOB is not writable" once it tried)
    fails(capsys, ["run", "--port", "0", "--job-dir", str(job), str(script)], f"--job-dir {job} is not a folder")


def test_inject_without_a_running_job(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    fails(capsys, ["inject", "crash", "--rank", "0", "--job-dir", str(empty)], f"no running job in {empty}")


def test_inject_with_a_stale_manager_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "manager.json").write_text('{"url": "http://127.0.0.1:9", "pid": 999999999}')
    fails(capsys, ["inject", "crash", "--rank", "0", "--job-dir", str(tmp_path)], "no running job")


def test_inject_with_a_missing_job_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fails(capsys, ["inject", "crash", "--rank", "0", "--job-dir", str(tmp_path / "nope")], "does not exist")


@pytest.mark.parametrize(("flags", "words"), [
    (["--rank", "-1"], "--rank must be >= 0, got -1"),
    (["--rank", "0", "--at-step", "0"], "--at-step must be >= 1, got 0"),
])
def test_inject_bad_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], words: str) -> None:
    fails(capsys, ["inject", "crash", *flags, "--job-dir", str(tmp_path)], words)


@pytest.mark.parametrize(("argv", "words"), [
    (["slow", "--rank", "1"], "slow needs --factor F"),
    (["slow", "--rank", "1", "--factor", "1.2", "--phase", "backward"], "slow's --phase must be one of compute"),
    (["crash", "--rank", "1", "--factor", "1.2"], "--factor applies to slow only"),
    (["crash", "--rank", "1", "--phase", "data"], "--phase data applies to slow only"),
])
def test_inject_slow_bad_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str],
                               words: str) -> None:
    fails(capsys, ["inject", *argv, "--job-dir", str(tmp_path)], words)


def test_trace_without_a_running_job(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fails(capsys, ["trace", "on", "--job-dir", str(tmp_path / "nope")], "does not exist")


@pytest.mark.parametrize(("flags", "words"), [
    (["--trace-max-file-mb", "0"], "--trace-max-file-mb must be > 0"),
    (["--trace-max-file-mb", "50", "--trace-max-dir-mb", "10"], "--trace-max-dir-mb (10.0) must be at least"),
])
def test_run_with_bad_trace_flags(capsys: pytest.CaptureFixture[str], script: Path, job_dir: Path,
                                  flags: list[str], words: str) -> None:
    fails(capsys, ["run", *flags, "--job-dir", str(job_dir), str(script)], words)
    assert not job_dir.exists()


@pytest.mark.parametrize(("where", "words"), [
    ("s3:bucket/ckpt", "s3://"),
    ("nosuchproto://x/y", "nosuchproto"),
])
def test_run_with_a_bad_checkpoint_location(capsys: pytest.CaptureFixture[str], script: Path, job_dir: Path,
                                            where: str, words: str) -> None:
    fails(capsys, ["run", "--checkpoint-dir", where, "--job-dir", str(job_dir), str(script)], words)


def test_run_with_a_checkpoint_dir_under_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                script: Path, job_dir: Path) -> None:
    (tmp_path / "afile").write_text("x")
    fails(capsys, ["run", "--checkpoint-dir", str(tmp_path / "afile" / "ckpt"), "--job-dir", str(job_dir),
                   str(script)], "afile")


def test_inject_no_job_found_here(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fails(capsys, ["inject", "crash", "--rank", "0"], "no job found")


def test_demo_with_an_unknown_fault(capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, ["demo", "--fault", "nope"], "unknown fault 'nope'", "crash")


def test_demo_with_no_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, ["demo", "--epochs", "0"], "--epochs must be >= 1")


def test_status_with_a_missing_job_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fails(capsys, ["status", "--job-dir", str(tmp_path / "nope")], "does not exist")


def test_status_of_a_folder_that_holds_no_job(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fails(capsys, ["status", "--job-dir", str(tmp_path)], str(tmp_path))


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: undying" in capsys.readouterr().err


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["inject", "explode", "--rank", "0"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# --- torchrun's command line ------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "words"), [
    (["--rdzv-id", "a/b"], ["--rdzv-id 'a/b' is not a valid job id"]),
    (["--rdzv_id", "j1", "--job-id", "j2"], ["--rdzv-id j1 and --job-id j2 name different jobs"]),
    (["--rdzv-backend", "etcd"], ["--rdzv-backend 'etcd'", "undying's manager is the rendezvous", "c10d"]),
    (["--standalone", "--nnodes", "2"], ["--standalone runs one node"]),
    (["--standalone", "--rdzv-endpoint", "h:1"], ["--standalone runs one node"]),
    (["--nproc_per_node", "0"], ["--nproc-per-node must be at least 1"]),
    (["--redirects", "5"], ["--redirects: each value must be 0-3"]),
    (["--tee", "0:x"], ["--tee: expected 0-3"]),
    (["--redirects", "3"], ["--redirects/--tee need --log-dir"]),
    (["-m", "--no-python"], ["-m/--module and --no-python exclude each other"]),
    (["--local-ranks-filter", "a"], ["--local-ranks-filter: expected local ranks"]),
    (["--rdzv-conf", "nonsense"], ["--rdzv-conf: expected KEY=VALUE"]),
    (["--rdzv-conf", "join_timeout=-3"], ["--rdzv-conf join_timeout must be > 0"]),
    (["--monitor-interval", "0"], ["--monitor-interval must be > 0"]),
    (["--max-step-recoveries", "-1"], ["--max-step-recoveries must be >= 0"]),
    (["--master-port", "70000"], ["--master-port must be in [0, 65535]"]),
    (["--exit-grace", "0"], ["--exit-grace must be > 0"]),
])
def test_run_with_bad_torchrun_flags(capsys: pytest.CaptureFixture[str], script: Path, job_dir: Path,
                                     flags: list[str], words: list[str]) -> None:
    fails(capsys, ["run", *flags, "--job-dir", str(job_dir), str(script)], *words)
    assert not job_dir.exists()


def test_a_word_for_nproc_per_node_that_torchrun_does_not_take(capsys: pytest.CaptureFixture[str],
                                                                 script: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--nproc-per-node", "lots", str(script)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nproc-per-node" in err and "expected a number or one of auto, cpu, gpu" in err


def _config(argv: list[str]) -> tuple[argparse.Namespace, JobConfig]:
    from undying.cli.main import build_parser
    from undying.cli.run_config import config_from_args

    args = build_parser().parse_args(["run", *argv])
    return args, config_from_args(args)


def test_torchruns_rendezvous_maps_onto_the_manager_and_the_job_id(capsys: pytest.CaptureFixture[str],
                                                                    script: Path) -> None:
    args, config = _config(["--nnodes", "2", "--node_rank", "1", "--rdzv_backend", "c10d",
                            "--rdzv_endpoint", "host0:29411", "--rdzv_id", "tutorial-7",
                            "--rdzv_conf", "join_timeout=45,read_timeout=5,is_host=1", str(script), "--n", "3"])
    assert args.manager == "host0:29411" and config.job_id == "tutorial-7" and config.node_rank == 1
    assert config.timeouts.node_wait == 45 and config.nnodes == 2
    assert args.script_args == ["--n", "3"]
    err = capsys.readouterr().err
    assert err.strip() == ("undying: note: --rdzv-conf read_timeout, is_host: no meaning here (undying's manager "
                           "is the rendezvous); ignored")
    args, _ = _config(["--nnodes", "2", "--rdzv-endpoint", "host0", "--rdzv-id", "j", str(script)])
    assert args.manager == "host0:29400"  # torchrun's default port, and `undying manager`'s


def test_one_node_picks_a_free_port_unless_one_is_fixed_and_nproc_words_resolve(script: Path) -> None:
    _, config = _config(["--standalone", "--nproc-per-node", "cpu", str(script)])
    assert config.port == 0 and config.nproc_per_node == (os.cpu_count() or 1)
    # Without --standalone too, as torchrun --standalone: a second job on the machine just works.
    _, config = _config(["--nproc-per-node", "2", str(script)])
    assert config.port == 0 and config.nproc_per_node == 2
    _, config = _config(["--port", "29555", str(script)])
    assert config.port == 29555
    _, config = _config(["--rdzv-endpoint", "localhost:29556", str(script)])
    assert config.port == 29556


def test_torchruns_launch_flags_reach_the_config(script: Path, tmp_path: Path) -> None:
    _, config = _config(["--log_dir", str(tmp_path), "-r", "1", "--tee", "0:2,1:3", "--local_ranks_filter", "1,0",
                         "--role", "trainer", "--master_addr", "10.0.0.1", "--master_port", "29600", "--seed", "7",
                         "--max_restarts", "5", "--max-step-recoveries", "2", "--monitor_interval", "5",
                         "--start_method", "fork", "--run_path", "--exit-grace", "4", str(script)])
    launch = config.launch
    assert (launch.redirects, launch.tee, launch.local_ranks_filter) == ({-1: 1}, {0: 2, 1: 3}, (0, 1))
    assert (launch.role, launch.master_addr, launch.master_port) == ("trainer", "10.0.0.1", 29600)
    assert (config.seed, config.max_restarts, config.max_step_recoveries) == (7, 5, 2)
    assert config.timeouts.exit_grace == 4
    assert config.step_api is False  # the script does not import undying


def test_a_script_that_imports_undying_uses_the_step_api(tmp_path: Path) -> None:
    from undying.cli.step_api import uses_step_api

    plain, adopted, nested = tmp_path / "plain.py", tmp_path / "adopted.py", tmp_path / "nested.py"
    plain.write_text("import torch\nprint('undying')\n")
    adopted.write_text("import os\nimport undying\n")
    nested.write_text("def main():\n    from undying import init\n")
    assert not uses_step_api(str(plain))
    assert uses_step_api(str(adopted)) and uses_step_api(str(nested))
    assert not uses_step_api("/bin/true", no_python=True)


def test_max_restarts_given_to_a_step_api_script_says_its_new_meaning(capsys: pytest.CaptureFixture[str],
                                                                        tmp_path: Path, script: Path) -> None:
    adopted = tmp_path / "adopted.py"
    adopted.write_text("import undying\n")
    _, config = _config(["--max-restarts", "2", str(adopted)])
    assert (config.max_restarts, config.max_step_recoveries) == (2, 3)
    assert capsys.readouterr().err.strip() == (
        "undying: note: --max-restarts 2 bounds whole-group restarts (torchrun's meaning); recoveries at one step "
        "are bounded by --max-step-recoveries (3)")
    _config(["--max-restarts", "2", str(script)])  # a torchrun script: the flag means what it always meant
    _config([str(adopted)])
    assert capsys.readouterr().err == ""
