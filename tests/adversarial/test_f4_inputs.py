"""Finding 4 of issue 14, "Inputs": a non-ASCII --job-id was accepted and then every command on that
job crashed (UnicodeEncodeError); deep or huge-integer JSON was a 500; ``at_step`` -5 was accepted;
nan and inf passed every float option.

The CLI is driven in-process through its real argparse parsers (``undying.cli.main``), the HTTP API
through a real Manager served by ``start_http`` on a loopback socket (``tests.unit.test_http_auth``'s
``Served``), with chosen and with random (hypothesis) input: a bad input is one line and exit 2 with
nothing created, or a 4xx naming the field; never a 500, never a traceback, never a changed job.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import string
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_http_auth import Served, bearer, raw
from undying.cli import run_config
from undying.cli.client import api_for
from undying.cli.limits import connection_limits
from undying.cli.main import build_parser, main
from undying.errors import UsageError
from undying.inputs import JOB_ID_RULE, check_job_id
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.tokens import TOKEN_ENV, TOKEN_FILE

BAD_IDS = ["jöb", "ジョブ", ".hidden", "..", "-rf", "", "a" * 65, "a/b", "a b", "a\nb", "a\x00b", "job$", "é1"]
GOOD_IDS = ["a", "my-job-1", "Job_2.run", "_x", "9", "a" * 64]


def _argv(command: str, job_id: str) -> list[str]:
    return {
        "run": ["run", f"--job-id={job_id}", "train.py"],
        "manager": ["manager", f"--job-id={job_id}", "--job-dir", "jobdir"],
        "k8s": ["k8s", f"--job-id={job_id}", "--nodes", "1", "--nproc-per-node", "1", "--image", "img", "train.py"],
    }[command]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    yield tmp_path


@pytest.mark.parametrize("command", ["run", "manager", "k8s"])
@pytest.mark.parametrize("job_id", BAD_IDS)
def test_a_job_id_outside_the_alphabet_is_one_line_exit_2_and_nothing_created(
        command: str, job_id: str, in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Finding 4: a non-ASCII (or otherwise unsafe) --job-id is refused before anything exists."""
    assert main(_argv(command, job_id)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("undying: error: --job-id"), err
    assert "valid job id" in err and err.isascii()
    assert list(in_tmp.iterdir()) == [], "a refused job id created something"


@pytest.mark.parametrize("job_id", GOOD_IDS)
def test_the_documented_alphabet_is_accepted(job_id: str) -> None:
    """Finding 4: the alphabet the help and docs/security.md promise."""
    assert check_job_id(job_id) == job_id


def test_the_job_id_rule_is_in_the_help_and_the_docs() -> None:
    """Finding 4: the alphabet is documented where users look."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("run", "manager"):
        # argparse wraps lines (at hyphens too): compare without whitespace.
        assert "".join(JOB_ID_RULE.split()) in "".join(sub.choices[command].format_help().split()), command
    docs = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    assert "[A-Za-z0-9._-]" in docs and "64" in docs


FLOAT_OPTIONS = ["--save-interval", "--grace-period", "--gasp-reuse-within", "--rendezvous-timeout",
                 "--connect-timeout", "--collective-timeout", "--recovery-timeout", "--comm-error-grace",
                 "--heartbeat-timeout", "--init-timeout", "--node-wait", "--stop-grace", "--step-timeout",
                 "--trace-max-file-mb", "--trace-max-dir-mb", "--http-header-timeout", "--http-idle-timeout"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
@pytest.mark.parametrize("option", FLOAT_OPTIONS)
def test_float_options_refuse_nan_and_inf_by_name(option: str, value: str, in_tmp: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Finding 4: nan and inf passed every `x < 0` check; now one line naming the option, exit 2."""
    assert main(["run", f"{option}={value}", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and option in err, err
    assert list(in_tmp.iterdir()) == []


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path)
    yield s
    s.close()


def _post(served: Served, path: str, body: bytes) -> tuple[int, Any]:
    return raw(served.url + path, "POST", body, {**bearer(served.token), "Content-Type": "application/json"})


@pytest.mark.parametrize("body, names", [
    (b"[" * 100_000 + b"]" * 100_000, "413"),  # over the body limit
    (b"[" * 5000 + b"]" * 5000, "nests deeper"),
    (b'{"rank": ' + b"[" * 20 + b"]" * 20 + b"}", "nests deeper"),
    (b'{"rank": ' + b"9" * 5000 + b"}", "digits"),
    (b'{"rank": 1, "at_step": ' + b"1" * 40 + b"}", "digits"),
    (b'{"rank": NaN}', "NaN"),
    (b'{"rank": 0, "kind": "slow", "factor": Infinity}', "Infinity"),
    (b'{"rank": 0, "kind": "slow", "factor": 1e999}', "out of range"),
    (b'{"rank": 0, "at_step": -5}', "at_step"),
    (b'{"rank": 0, "at_step": 0}', "at_step"),
    (b'{"rank": -1}', "rank"),
    (b'{"rank": 1048577}', "rank"),
    (b'{"rank": 0, "at_step": 9007199254740993}', "at_step"),
    (b"\xff\xfe", "UTF-8"),
])
def test_hostile_json_is_a_4xx_that_names_the_problem_and_changes_nothing(
        served: Served, body: bytes, names: str) -> None:
    """Finding 4: deep or huge-integer JSON was a 500, at_step -5 was armed; now 4xx and no change."""
    before = served.snapshot()
    code, answer = _post(served, "/api/inject", body)
    assert 400 <= code < 500, (code, answer)
    assert names == "413" and code == 413 or names in str(answer), answer
    assert served.snapshot() == before


def test_a_valid_inject_still_works(served: Served) -> None:
    """The checks refuse only what is wrong: at_step in range arms the fault."""
    code, answer = _post(served, "/api/inject", b'{"rank": 1, "at_step": 7}')
    assert code == 200 and isinstance(answer, dict) and answer["at_step"] == 7, answer


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(["kind", "rank", "at_step", "phase", "how", "factor", "on", "comm", "step", "by",
                               "x"])
inject_like = st.dictionaries(field_names, json_values | st.sampled_from(
    ["crash", "hang", "slow", "kill", "step", "forward", "spin", -5, 0, 1, 2**63, 1.5]), max_size=5)
bodies = (
    inject_like.map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=200)
    | st.sampled_from([b"[" * 3000, b'{"rank": ' + b"7" * 4400 + b"}", b'{"rank": NaN}', b"", b"{"])
)
paths = st.sampled_from(["/api/inject", "/api/trace", "/api/status", "/api/ranks", "/api/incidents", "/metrics",
                         "/", "/api/nothing"]) | st.text(alphabet=string.printable, max_size=30).map(
                             lambda t: "/" + urllib.parse.quote(t))


def test_random_requests_never_a_500_never_a_change_unless_accepted(served: Served) -> None:
    """Finding 4, property-based: random methods, paths, bodies, with and without the token."""

    @settings(max_examples=150, deadline=3000, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]), path=paths, body=bodies,
           with_token=st.booleans())
    def one(method: str, path: str, body: bytes, with_token: bool) -> None:
        before = served.snapshot()
        headers = {"Content-Type": "application/json", **(bearer(served.token) if with_token else {})}
        code, answer = raw(served.url + path, method, body if method != "GET" else None, headers)
        assert code < 500, (method, path, body[:100], code, answer)
        assert "Traceback" not in str(answer)
        if not (200 <= code < 300 and method in ("POST", "PUT")):
            assert served.snapshot() == before, (method, path, body[:100], code, answer)
        elif path == "/api/stop":
            pytest.fail("random input stopped the job")

    one()


_RUN_OPTIONS = ["--job-id", "-n", "--save-interval", "--grace-period", "--gasp-reuse-within", "--recovery-timeout",
                "--step-timeout", "--nnodes", "--node-rank", "--port", "--http-port", "--spares", "--keep",
                "--max-connections", "--http-header-timeout", "--trace", "--replicate-every", "--save-every"]
_values = (st.sampled_from(["nan", "inf", "-1", "0", "1", "1e999", "auto", "2:4", "jöb", "", "-x", "9" * 400,
                            "0x10", "1_000"])
           | st.text(max_size=12) | st.integers(-(10**30), 10**30).map(str) | st.floats().map(str))


def test_random_arguments_to_the_parsers_are_one_line_errors_or_valid_configs(in_tmp: Path) -> None:
    """Finding 4, property-based: the real argparse of run and manager with random options and values;
    every outcome is a valid configuration, argparse's own exit 2, or a UsageError of one line."""

    @settings(max_examples=300, deadline=2000, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(command=st.sampled_from(["run", "manager"]),
           pairs=st.lists(st.tuples(st.sampled_from(_RUN_OPTIONS), _values), max_size=4))
    def one(command: str, pairs: list[tuple[str, str]]) -> None:
        argv = [command] + [f"{option}={value}" for option, value in pairs]
        argv += ["train.py"] if command == "run" else ["--job-id=j1"]
        try:
            args = build_parser().parse_args(argv)
            if command == "run":
                run_config.config_from_args(args).validate()
            else:
                check_job_id(args.job_id)
                connection_limits(args)
        except SystemExit as e:
            assert e.code in (0, 2)
        except UsageError as e:
            assert "\n" not in str(e) and str(e).isprintable(), str(e)
        assert list(in_tmp.iterdir()) == []

    one()


def test_a_job_dir_of_an_old_non_ascii_job_id_does_not_crash_the_commands(served: Served, in_tmp: Path) -> None:
    """Finding 4: a job id a former version let in (non-ASCII) made every command crash on its header."""
    old = in_tmp / "old-job"
    old.mkdir()
    (old / TOKEN_FILE).write_text(served.token)
    (old / TOKEN_FILE).chmod(0o600)
    JobDir(old).write_manager({"url": served.url, "pid": os.getpid(), "job_id": "jöb"})
    api = api_for(JobDir(old))
    assert api.job_id is None
    assert api.get("/api/status")["job_id"] == "authjob"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("argv", [
    ["run", "--job-id", "-rf", "train.py"],  # the id taken for an option: argparse's "expected one argument"
    ["run", "--no-such-option", "train.py"],
    ["run", "--backend", "mpi", "train.py"],
    ["run", "-n", "two", "train.py"],
    ["manager"],  # --job-id is required
    ["inject", "explode", "--rank", "0"],
    ["status", "--job-dir", "a", "--manager", "b"],  # exclusive
    ["nonsense"],
])
def test_argparse_own_errors_are_one_line_exit_2_and_nothing_created(
        argv: list[str], in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Finding 4: "anything else is one line, exit 2" holds for argparse's own refusals too (they printed the usage)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "--help" in err, err
    assert list(in_tmp.iterdir()) == []


_any_value = (st.sampled_from(["nan", "inf", "-inf", "-5", "0", "1", "1e999", "jöb", "", "-", ".x", "a" * 70,
                               "train.py", "auto", "1:2", "3:1", "crash", "on"])
              | st.text(max_size=10) | st.integers(-(10**30), 10**30).map(str))


def test_random_arguments_to_every_subcommand_parser(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Finding 4, property-based: every subcommand's real parser (not only run's and manager's) with random
    options and values; a refusal is exit 2 and one line, a parse holds only finite numbers; nothing is created."""
    parsers = _subcommands()

    @settings(max_examples=300, deadline=2000, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(parsers)))
        options = sorted({o for a in parsers[name]._actions for o in a.option_strings if o not in ("-h", "--help")})
        pairs = data.draw(st.lists(st.tuples(st.sampled_from(options), _any_value), max_size=4))
        argv = [name, *(f"{o}={v}" for o, v in pairs), *data.draw(st.lists(_any_value, max_size=2))]
        capsys.readouterr()
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:
            assert e.code in (0, 2), argv
            if e.code == 2:
                err = capsys.readouterr().err
                assert err.count("\n") == 1, (argv, err)
        except UsageError as e:
            assert "\n" not in str(e) and str(e).isprintable(), str(e)
        else:
            finite = [v for v in vars(args).values() if isinstance(v, float)]
            assert all(math.isfinite(v) for v in finite), argv
        assert list(in_tmp.iterdir()) == []

    one()
