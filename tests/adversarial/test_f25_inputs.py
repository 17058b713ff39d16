"""Issue 25, "Bad input, one line each": each is one line on stderr, exit 2, and nothing changed on disk.

A FIFO given as the script hung forever; a corrupt ``events.db`` (``status``,
``trace export``), a malformed ``--manager`` and a ``--token-file`` naming a
folder ended in tracebacks; ``--rdzv-endpoint :`` was accepted; a run refused
late left ``events.db`` and ``token`` behind; a bad ``UNDYING_VERIFY_EVERY`` or
``UNDYING_NUMERICS`` was a traceback in every rank; ``undying k8s --out``
deleted a user's file and wrote through a link. (``undying drain`` of a host
a one-node job does not know: tests/integration/test_migrate.py and
tests/unit/test_hosts.py.)

Real files throughout: a real FIFO, a real file that is no SQLite database,
real symbolic links, a real port held by another socket. The CLI in-process
(``undying.cli.main``) where the answer is the point, in a subprocess where a
hang or a traceback is; and the property: every ``UNDYING_`` variable undying
reads, with random values, is either read or refused in one line, and a value
``undying run`` lets through is one every process that reads it accepts.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from undying.agent.zygote import start_mode
from undying.cli.main import main
from undying.config import Timeouts, checkpoint_from_env, timeouts_from_env, trace_from_env
from undying.errors import UsageError
from undying.inputs import ENV_VARS, check_environment, env_value
from undying.jobfiles.tokens import TOKEN_ENV
from undying.protocol.env import TIMEOUT_ENVS
from undying.worker.numerics import Numerics
from undying.worker.replica import ReplicationConfig
from undying.worker.seed import seed_from_env
from undying.worker.verify_plan import check_every
from undying.worker.virtual import virtual_ranks_from_env

SCRIPT = "print('hello')\n"


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: its kind and, for a file, its content's hash (what "unchanged" compares)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = f"link:{os.readlink(path)}"
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "fifo" if path.is_fifo() else "dir"
    return out


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    (tmp_path / "train.py").write_text(SCRIPT)
    yield tmp_path


def _refused(argv: list[str], root: Path, capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """``undying ARGV`` in-process: exit 2, one line naming ``words``, and ``root`` as it was."""
    before = _tree(root)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusal
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (argv, code, err)
    assert all(w in err for w in words), (words, err)
    assert _tree(root) == before, "a refused command changed the disk"
    return err


def _cli(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "undying", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_a_fifo_as_the_script_is_refused_at_once_not_waited_on(here: Path) -> None:
    """A FIFO blocks an ordinary open until a writer comes: the run hung forever before any output."""
    os.mkfifo(here / "fifo.py")
    before = _tree(here)
    done = _cli(["run", "--job-id", "f", "fifo.py"], here, timeout=20)  # (hung: the timeout would raise)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done
    assert "training script fifo.py is a FIFO" in done.stderr, done.stderr
    assert _tree(here) == before


@pytest.mark.parametrize("argv", [
    ["status", "--job-dir", "job"],
    ["status", "--job-dir", "job", "--json"],
    ["status", "--job-dir", "job", "--steps"],
    ["trace", "export", "--job-dir", "job", "--perfetto", "out.json"],
])
def test_a_corrupt_event_log_is_one_line(here: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A job dir whose events.db is not an SQLite database (a real file of garbage): a traceback before."""
    (here / "job").mkdir()
    (here / "job" / "events.db").write_bytes(b"this is not a database\n" * 100)
    _refused(argv, here, capsys, "job/events.db is not a readable undying event log", "move it aside")


def test_a_corrupt_event_log_is_one_line_from_the_command_itself(here: Path) -> None:
    """The same, as a user runs it (a subprocess): no traceback on the way out either."""
    (here / "job").mkdir()
    (here / "job" / "events.db").write_bytes(b"SQLite format 3\x00" + os.urandom(4080))  # a header, then noise
    done = _cli(["status", "--job-dir", "job"], here)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not a readable undying event log" in done.stderr, done


@pytest.mark.parametrize("manager", ["http://[::1", "a:b:c", "host:99999", ":", "http://", "ftp://h:1", "h:1?x",
                                     "h", "[::1]", " :80", "h:-1", "h:0x50"])
def test_a_malformed_manager_address_is_one_line(here: Path, manager: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["status", "--manager", manager], ["trace", "show", "--manager", manager],
                 ["run", "--nnodes", "2", "--node-rank", "1", "--job-id", "j", "--manager", manager, "train.py"]):
        _refused(argv, here, capsys, "--manager", "HOST:PORT")


@pytest.mark.parametrize("endpoint", [":", ":29400", "host:", "host:70000", "a b:1"])
def test_a_malformed_rendezvous_endpoint_is_one_line(here: Path, endpoint: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["run", "--nnodes", "2", "--node-rank", "1", "--rdzv-id", "j", "--rdzv-endpoint", endpoint, "train.py"],
             here, capsys, "--rdzv-endpoint", "HOST:PORT")


def test_good_addresses_still_pass(here: Path) -> None:
    from undying.cli import run_config
    from undying.cli.main import build_parser

    for endpoint, manager in (("10.0.0.1", "10.0.0.1:29400"), ("h:5", "h:5"), ("[::1]:7", "[::1]:7")):
        args = build_parser().parse_args(["run", "--nnodes", "2", "--rdzv-id", "j", "--rdzv-endpoint", endpoint,
                                          "train.py"])
        assert run_config.config_from_args(args) and args.manager == manager


def test_a_token_file_that_is_a_folder_or_a_fifo_is_one_line(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (here / "tokens").mkdir()
    os.mkfifo(here / "token.fifo")
    for path, kind in (("tokens", "a folder"), ("token.fifo", "a FIFO")):
        _refused(["status", "--manager", "127.0.0.1:9", "--token-file", path], here, capsys, f"token file {path} is {kind}")
        _refused(["run", "--nnodes", "2", "--node-rank", "1", "--job-id", "j", "--manager", "127.0.0.1:9",
                  "--token-file", path, "train.py"], here, capsys, f"token file {path} is {kind}")


@pytest.mark.parametrize(("name", "value"), [
    ("UNDYING_VERIFY_EVERY", "abc"), ("UNDYING_VERIFY_EVERY", "0"), ("UNDYING_NUMERICS", "bogus"),
    ("UNDYING_NUMERICS", "on_persistent=maybe"), ("UNDYING_NUMERICS", "spike_factor=nan"),
    ("UNDYING_NUMERICS", "window=5,warmup=9"), ("UNDYING_VIRTUAL_RANKS", "-2"), ("UNDYING_WORKER_START", "thread"),
    ("UNDYING_REPLICATE_EVERY", "often"), ("UNDYING_HOST_NAME", "a b"), ("UNDYING_TIMEOUT_HEARTBEAT", "inf"),
    ("UNDYING_REDIRECTS", "7"), ("UNDYING_VERIFY_SERVE_DIR", "/tmp/v"),
])
def test_a_bad_environment_variable_is_refused_before_any_rank_starts(
        here: Path, name: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each was read first in a rank: a traceback in every rank, exit 1, after the job dir was made."""
    monkeypatch.setenv(name, value)
    _refused(["run", "--job-id", "e", "train.py"], here, capsys, name)


@pytest.mark.parametrize("option", ["--job-dir", "--log-dir", "--trace-dir", "--checkpoint-dir"])
def test_a_folder_option_given_a_file_is_one_line(here: Path, option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--log-dir naming a file failed in every rank (a traceback each, the group restarted 4 times, exit 1)."""
    (here / "afile").write_text("a file")
    _refused(["run", "--job-id", "d", option, "afile", "train.py"], here, capsys, f"{option} afile is not a folder")
    _refused(["run", "--job-id", "d", option, "afile/sub", "train.py"], here, capsys, "is not a folder (")


def _worker_readers() -> dict[str, Callable[[dict[str, str]], Any]]:
    """How the processes that read each variable read it (a rank, the agent), by name."""
    readers: dict[str, Callable[[dict[str, str]], Any]] = {
        "UNDYING_VERIFY_EVERY": lambda e: check_every(e["UNDYING_VERIFY_EVERY"]) if e["UNDYING_VERIFY_EVERY"] else None,
        "UNDYING_NUMERICS": Numerics.from_env,
        "UNDYING_VIRTUAL_RANKS": virtual_ranks_from_env,
        "UNDYING_SEED": seed_from_env,
        "UNDYING_WORKER_START": start_mode,
        "UNDYING_REPLICATE": ReplicationConfig.from_environ,
        "UNDYING_REPLICATE_EVERY": ReplicationConfig.from_environ,
        "UNDYING_SAVE_EVERY": checkpoint_from_env, "UNDYING_SAVE_INTERVAL": checkpoint_from_env,
        "UNDYING_KEEP": checkpoint_from_env,
        "UNDYING_TRACE_MAX_FILE_MB": trace_from_env, "UNDYING_TRACE_MAX_DIR_MB": trace_from_env,
        "UNDYING_GENERATION": lambda e: int(e["UNDYING_GENERATION"]),  # (worker.env; set by the agent)
    }
    readers.update({name: timeouts_from_env for name in TIMEOUT_ENVS.values()})
    return readers


def test_the_table_names_every_timeout() -> None:
    # Those a rank reads (the others are not sent to it), each a field of Timeouts.
    assert set(TIMEOUT_ENVS) <= set(Timeouts.__dataclass_fields__)
    assert all(name.startswith("UNDYING_TIMEOUT_") for name in TIMEOUT_ENVS.values())
    assert set(_worker_readers()) <= set(ENV_VARS)


_env_values = (st.sampled_from(["", " ", "0", "1", "-1", "3", "64", "65", "nan", "inf", "-inf", "1e999", "1e-9", "0.5",
                                "1_000", "+5", " 7 ", "٣", "abc", "zygote", "SPAWN", "ring", "off", "skip", "a b",
                                "on_persistent=rollback,rollback_steps=3", "spike_factor=10", "window=5,warmup=9",
                                "x=1", "on_persistent=skip,", "=", ",", "127.0.0.1:80", ":", "host-1", "9" * 30])
               | st.text(max_size=16) | st.integers(-(10**20), 10**20).map(str) | st.floats().map(repr))


def test_random_values_of_every_variable_are_read_or_refused_in_one_line() -> None:
    """Property: for every UNDYING_ variable undying reads and any value, ``check_environment`` (what ``undying
    run`` does before anything) reads it or refuses it in one printable line; and a value it lets through is one
    the process that reads it accepts (so no rank fails on it later)."""
    readers = _worker_readers()

    @settings(max_examples=200, deadline=2000, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(name=st.sampled_from(sorted(ENV_VARS)), value=_env_values)
    def one(name: str, value: str) -> None:
        env = {name: value}
        try:
            check_environment(env)
        except UsageError as e:
            text = str(e)
            assert "\n" not in text and text.isprintable() and name in text, text
            return
        if name in readers:
            readers[name](env)  # accepted here: accepted where it is read (raises otherwise)
        env_value(name, env)

    one()


def test_a_run_refused_late_leaves_nothing_behind(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A port another process holds is found only once the manager listens: by then the job dir, its token and
    event log existed, and stayed. Now what the launch created goes; an older launch's log is put back whole.
    (In-process: the launcher's real path, its real SQLite log and a real socket holding the port.)"""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = str(holder.getsockname()[1])
        _refused(["run", "--job-id", "late", "--port", port, "--spares", "0", "train.py"], here, capsys,
                 f"port {port} is in use")
        assert not (here / "undying-jobs").exists()

        job = here / "kept"  # a job dir of an earlier launch: its log, token and the user's file stay as they were
        job.mkdir()
        (job / "events.db").write_bytes(b"an earlier launch's log")
        (job / "token").write_text("earlier-token\n")
        (job / "token").chmod(0o600)
        (job / "notes.txt").write_text("the user's")
        _refused(["run", "--job-dir", str(job), "--job-id", "late", "--port", port, "--spares", "0", "train.py"],
                 here, capsys, f"port {port} is in use")
        _refused(["manager", "--job-id", "late", "--port", port], here, capsys,  # `undying manager` likewise
                 f"cannot listen for agents on 127.0.0.1:{port}")
        _refused(["manager", "--job-id", "late", "--job-dir", str(job), "--port", port], here, capsys,
                 f"cannot listen for agents on 127.0.0.1:{port}")
    finally:
        holder.close()


def _k8s(out: str, *options: str) -> list[str]:
    return ["k8s", "--job-id", "kj", "--nodes", "2", "--nproc-per-node", "1", "--image", "img", "--out", out,
            *options, "train.py"]


def test_k8s_out_never_deletes_nor_writes_through_what_it_did_not_write(
        here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--out`` deleted a user's file of a manifest's name and followed a link; now refused, or written atomically."""
    (here / "plain").write_text("a file, not a folder")
    _refused(_k8s("plain"), here, capsys, "--out plain is not a folder")
    (here / "real").mkdir()
    (here / "linked").symlink_to(here / "real")
    _refused(_k8s("linked"), here, capsys, "--out linked is a symbolic link")

    out = here / "manifests"
    out.mkdir()
    (out / "03-manager.yaml").write_text("# the user's own manager\n")
    _refused(_k8s("manifests"), here, capsys, "03-manager.yaml is there and was not written by undying k8s")
    (out / "03-manager.yaml").unlink()
    target = here / "elsewhere.yaml"
    target.write_text("the user's file a link points at\n")
    (out / "04-workers.yaml").symlink_to(target)
    _refused(_k8s("manifests"), here, capsys, "04-workers.yaml is there and was not written by undying k8s")
    (out / "04-workers.yaml").unlink()

    (out / "00-secret.yaml").write_text("# a Secret the user keeps here\n")  # a name this job does not write
    capsys.readouterr()
    assert main(_k8s("manifests", "--token-secret", "mine")) == 0
    written = sorted(p.name for p in out.iterdir())
    assert "03-manager.yaml" in written and "04-workers.yaml" in written, written
    assert not any(n.endswith(".tmp") for n in written) and not any((out / n).is_symlink() for n in written)
    assert (out / "00-secret.yaml").read_text() == "# a Secret the user keeps here\n"  # not ours: never removed
    assert target.read_text() == "the user's file a link points at\n"
    (out / "00-secret.yaml").unlink()
    assert main(_k8s("manifests")) == 0 and (out / "00-secret.yaml").is_file()  # ours, over our own files
    assert main(_k8s("manifests", "--token-secret", "mine")) == 0
    assert not (out / "00-secret.yaml").exists()  # ours, and stale now: removed


def test_a_fifo_as_the_trace_switch_file_is_reported_not_waited_on(here: Path) -> None:
    """The same class, in a running job: the manager polls --trace-switch-file; a FIFO there blocked its poll."""
    from undying.protocol.trace_switch import TraceSwitchError
    from undying.trace.switch import SwitchFileWatcher, read_switch_file

    os.mkfifo(here / "switch.json")
    with pytest.raises(TraceSwitchError, match="it is a FIFO, not a file"):
        read_switch_file(here / "switch.json")
    errors: list[str] = []
    assert SwitchFileWatcher(here / "switch.json", lambda s: None, errors.append).poll_once() is None
    assert errors and "is a FIFO" in errors[0], errors


def test_the_undo_touches_nothing_while_another_live_launcher_holds_the_job_dir(tmp_path: Path) -> None:
    """A launch refused because the job dir belongs to a running job: what appeared meanwhile is that job's."""
    from undying.cli.refusal import Ledger
    from undying.jobfiles.jobdir import JobDir

    job = tmp_path / "job"
    job.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the other job's launcher
    try:
        JobDir(job).write_manager({"url": "http://127.0.0.1:1", "pid": other.pid, "job_id": "j"})
        ledger = Ledger.take(job)
        (job / "written-by-the-running-job").write_text("x")
        ledger.undo()
        assert (job / "written-by-the-running-job").exists()
    finally:
        other.kill()
        other.wait()
    ledger.undo()  # that launcher gone: what appeared since the ledger was taken was this launch's
    assert sorted(p.name for p in job.iterdir()) == ["manager.json"]
