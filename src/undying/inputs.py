"""Checks of what a user types: job ids and numbers, one rule each, used by the CLI and the config.

A job id names a folder (``./undying-jobs/<id>``), a trace folder, checkpoint
manifests, HTTP headers (``X-Undying-Job``) and Kubernetes objects. So it is
held to a small alphabet that is safe in all of them: ASCII letters, digits,
``.``, ``_`` and ``-``, 1 to 64 characters, not starting with ``.`` (no hidden
folder, no ``..``) nor ``-`` (no id read as an option). ``str.isalnum`` is not
that check: it accepts any Unicode letter, and a non-ASCII id broke every
command on its job (a header must be Latin-1).

A number option is a finite float: ``float("nan")`` and ``float("inf")`` parse,
and then pass every ``x < 0`` check, so they are refused here by name.

An address (``--manager``, ``--rdzv-endpoint``) is ``HOST:PORT`` with a host
of the host-name alphabet and a port from 1 to 65535 (``check_address``); the
CLI's ``--manager`` may also be ``http://HOST:PORT`` (``check_manager_url``).

A file the user names (a training script, a ``--token-file``) is opened by
``undying.user_files`` (without blocking, and refused unless it is a regular file).

Every ``UNDYING_`` variable a process of undying reads is in ``ENV_VARS`` with
its reader; ``check_environment`` reads each one set, so ``undying run``
refuses a bad value in one line before any rank starts, and a rank that reads
the same variable with the same reader (``env_value``) cannot fail on it.

Each raises ``UsageError``, which the CLI prints as one line and exits 2; as an
argparse ``type=`` they run while the arguments are parsed, before anything
is created.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from undying.errors import UsageError
from undying.protocol.env import (
    AGENT_ADDR_ENV,
    AGENT_PID_ENV,
    BACKEND_ENV,
    CHECKPOINT_DIR_ENV,
    CONSOLE_ENV,
    CONTROL_ADDR_ENV,
    DEMO_QUIET_ENV,
    GENERATION_ENV,
    HOST_NAME_ENV,
    INCARNATION_ENV,
    JOB_DIR_ENV,
    JOB_ID_ENV,
    JOINING_ENV,
    KEEP_ENV,
    LOG_DIR_ENV,
    NODE_NAME_ENV,
    NUMERICS_ENV,
    PROMETHEUS_DIR_ENV,
    REDIRECTS_ENV,
    REPLICATE_ENV,
    REPLICATE_EVERY_ENV,
    RESUME_DIGEST_ENV,
    RESUME_FROM_ENV,
    RETURNED_FILE_ENV,
    SAVE_EVERY_ENV,
    SAVE_INTERVAL_ENV,
    SEED_ENV,
    STORE_ADDR_ENV,
    TEE_ENV,
    TIMEOUT_ENVS,
    TRACE_DIR_ENV,
    TRACE_MAX_DIR_MB_ENV,
    TRACE_MAX_FILE_MB_ENV,
    VERBOSE_ENV,
    VERIFY_EVERY_ENV,
    VERIFY_SERVE_DIR_ENV,
    VIRTUAL_RANKS_ENV,
    WORKER_START_ENV,
)

__all__ = ["JOB_ID_RULE", "JOB_ID_MAX", "is_job_id", "check_job_id", "job_id_arg", "finite_arg",
           "check_finite", "check_host_name", "check_address", "check_manager_url", "check_every",
           "quoted", "numerics_fields", "ENV_VARS", "env_value", "check_environment"]

JOB_ID_MAX = 64
JOB_ID_RULE = (f"1 to {JOB_ID_MAX} ASCII letters, digits, '.', '_' or '-', not starting with '.' "
               "or '-' (e.g. my-job-1)")
_JOB_ID = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9._-]{{0,{JOB_ID_MAX - 1}}}")


def quoted(value: str) -> str:
    """``value`` as the error line shows it: ASCII only, escapes visible, never longer than 80."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."



def is_job_id(value: object) -> bool:
    """Whether ``value`` is a job id of the safe alphabet."""
    return isinstance(value, str) and _JOB_ID.fullmatch(value) is not None


def check_job_id(value: str, what: str = "--job-id") -> str:
    """``value`` when it is a safe job id (see the module's rule), else ``UsageError`` naming
    ``what``."""
    if not isinstance(value, str) or _JOB_ID.fullmatch(value) is None:
        shown = quoted(value) if isinstance(value, str) else type(value).__name__
        raise UsageError(f"{what} {shown} is not a valid job id: use {JOB_ID_RULE}")
    return value


def job_id_arg(value: str) -> str:
    """argparse ``type=`` for ``--job-id``."""
    return check_job_id(value)


def check_finite(option: str, value: float) -> float:
    """``value`` when it is a finite number, else ``UsageError`` naming ``option``."""
    if not math.isfinite(value):
        raise UsageError(f"{option} must be a finite number, got {value}")
    return value


def finite_arg(option: str) -> Callable[[str], float]:
    """argparse ``type=`` for the float option ``option``: a finite number, or one line naming
    it."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{option} expects a number, got {quoted(text)}") from None
        return check_finite(option, value)

    parse.__name__ = "number"  # argparse names the type in some messages
    return parse


# --- host names and addresses ---------------------------------------------------------------------

# A hostname, an IPv4 or a bracketed or bare IPv6.
_HOST = re.compile(r"[A-Za-z0-9_.:\-\[\]]{1,255}")
HOST_RULE = "letters, digits, '.', '-', '_', ':' or an IPv6 in [...], at most 255 characters"


def check_host_name(value: object, what: str = "host") -> str:
    """``value`` when it is a host name or address, else ``UsageError`` naming ``what``."""
    if not isinstance(value, str) or _HOST.fullmatch(value) is None:
        shown = quoted(value) if isinstance(value, str) else type(value).__name__
        raise UsageError(f"{what} {shown} is not a host name or address ({HOST_RULE})")
    return value


def check_address(option: str, text: str, example: str = "10.0.0.1:29400", *,
                  lowest: int = 1) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``) as (host, port), or one line naming ``option`` and
    an example.

    ``lowest``: the lowest port taken (0: "pick a free one" where the option means a port to
    listen on).
    """
    host, sep, port = text.strip().rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if (not sep or not bare or not port.isascii() or not port.isdigit() or len(port) > 5
            or not lowest <= int(port) < 65536 or _HOST.fullmatch(bare) is None
            or "[" in bare or "]" in bare):
        raise UsageError(f"{option} {quoted(text)}: expected HOST:PORT with a port from {lowest} "
                         f"to 65535, e.g. {example}")
    return bare, int(port)


def check_manager_url(option: str, text: str) -> str:
    """A manager's HTTP address, ``HOST:PORT`` or ``http(s)://HOST:PORT[/PATH]``, as a base URL
    without a final /."""
    scheme, sep, rest = text.strip().partition("://")
    if not sep:
        scheme, rest = "http", text.strip()
    netloc, slash, path = rest.partition("/")
    example = "127.0.0.1:8080 or http://127.0.0.1:8080/"
    bad = UsageError(f"{option} {quoted(text)}: expected HOST:PORT with a port from 1 to 65535, "
                     f"alone or after an http or https scheme (e.g. {example})")
    if scheme not in ("http", "https") or not (path.isascii() and (slash + path).isprintable()) \
            or any(c in path for c in "?#% "):
        raise bad
    try:
        check_address(option, netloc, example)
    except UsageError:
        raise bad from None
    return f"{scheme}://{netloc}{slash}{path}".rstrip("/")


# --- numbers of steps and the numeric checks, as the CLI and the environment give them
# --------------

MAX_EVERY = 1_000_000  # --verify-every at most: one step in a million
MAX_ROLLBACK_STEPS = 64  # --rollback-steps at most (each is a copy of the state in memory)


def check_every(value: object, where: str = "--verify-every") -> int:
    """A valid K (a whole number from 1 to MAX_EVERY), or a UsageError naming the bad value and
    what to give."""
    bad = UsageError(f"{where} takes a whole number of steps from 1 to {MAX_EVERY} (e.g. 100), "
                     f"got {quoted(str(value))}")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise bad
    digits = value.strip() if isinstance(value, str) else ""
    if isinstance(value, str) and not (digits.isascii() and digits.isdigit() and len(digits) < 20):
        raise bad
    every = int(value)
    if not 1 <= every <= MAX_EVERY:
        raise UsageError(f"{where} must be from 1 to {MAX_EVERY} steps (1: every step; 100: one "
                         f"step in a hundred), got {every}")
    return every


_POLICIES = ("skip", "stop", "rollback")


def _policy(text: str) -> str:
    if text not in _POLICIES:
        raise ValueError(f"one of {', '.join(_POLICIES)}")
    return text


def _spike(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 1):
        raise ValueError("a number above 1")
    return value


def _whole(low: int, high: int) -> Callable[[str], int]:
    def read(text: str) -> int:
        whole = text.isascii() and text.lstrip("-").isdigit() and len(text) < 20
        if not whole or not low <= int(text) <= high:
            raise ValueError(f"a whole number from {low} to {high}")
        return int(text)
    return read


def _share(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError("a share above 0 and at most 1")
    return value


# NUMERICS_ENV's fields (``undying run --numerics ...``: field=value,...), and how each is read and
# bounded.
_NUMERICS_FIELDS: dict[str, Callable[[str], Any]] = {
    "on_persistent": _policy, "spike_factor": _spike, "window": _whole(1, 1_000_000),
    "warmup": _whole(1, 1_000_000), "rollback_steps": _whole(1, MAX_ROLLBACK_STEPS),
    "max_skips_in_a_row": _whole(1, 1_000_000), "max_skipped_share": _share}


def numerics_fields(raw: str, where: str = NUMERICS_ENV) -> dict[str, Any]:
    """The fields of ``Numerics`` that ``raw`` (``field=value,...``) sets, each read and bounded;
    else one line."""
    fields: dict[str, Any] = {}
    for item in raw.split(","):
        name, _, value = (part.strip() for part in item.partition("="))
        read = _NUMERICS_FIELDS.get(name)
        if read is None:
            raise UsageError(f"{where}={quoted(raw)}: {quoted(item.strip())} is not one of "
                             f"{', '.join(f + '=VALUE' for f in _NUMERICS_FIELDS)}; set it with "
                             "undying run --numerics POLICY [--spike-factor F] "
                             "[--rollback-steps N]")
        try:
            fields[name] = read(value)
        except ValueError as e:
            expected = str(e) if str(e).startswith(("one of", "a ")) else "a number"
            raise UsageError(f"{where}={quoted(raw)}: {name} must be {expected}, "
                             f"got {quoted(value)}") from None
    if fields.get("warmup", 20) > fields.get("window", 50):
        raise UsageError(f"{where}={quoted(raw)}: needs warmup <= window (defaults 20 and 50)")
    return fields


# --- the environment: every UNDYING_ variable a process of undying reads, and its reader
# ------------

def _choice(*words: str) -> Callable[[str], str]:
    def read(text: str) -> str:
        if text.lower() not in words:
            raise ValueError(f"one of {', '.join(words)}")
        return text.lower()
    return read


def _non_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError("a finite number >= 0")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError("a finite number > 0")
    return value


def _address(text: str) -> tuple[str, int]:
    try:
        return check_address("", text)
    except UsageError:
        raise ValueError("HOST:PORT") from None


def _host(text: str) -> str:
    if _HOST.fullmatch(text) is None:
        raise ValueError(f"a host name ({HOST_RULE})")
    return text


def _job_id(text: str) -> str:
    if not is_job_id(text):
        raise ValueError(f"a job id ({JOB_ID_RULE})")
    return text


def _any(text: str) -> str:
    return text


def _none(text: str) -> str:
    raise ValueError("it unset: only the verifier process that a rank starts has it")


def _timeout(text: str) -> float:
    value = float(text)
    if not 0 < value <= 24 * 3600:  # (nan fails this too)
        raise ValueError("a number of seconds above 0 and at most 86400")
    return value


@dataclass(frozen=True)
class EnvVar:
    """A variable undying reads: ``read`` takes its value (stripped) or raises ValueError or
    UsageError.

    ``how``: who sets it and how, for the error line (an option of ``undying
    run``, or "set by undying" for those the launcher gives its own processes).
    ``blank``: an empty value means "not set" to every process that reads it
    (else an empty value is read, and refused, as the processes refuse it).
    """

    name: str
    read: Callable[[str], Any]
    how: str
    blank: bool = True


_OWN = "set by undying for its own processes; unset it"
_BY_RUN = "set by undying run from its options"
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar(VERIFY_EVERY_ENV, lambda t: check_every(t, VERIFY_EVERY_ENV),
           "undying run --verify-every K"),
    EnvVar(NUMERICS_ENV, numerics_fields, "undying run --numerics POLICY"),
    EnvVar(VIRTUAL_RANKS_ENV, _whole(1, 1_000_000), "undying run --virtual-ranks V"),
    EnvVar(SEED_ENV, _whole(0, 2**63 - 1), "undying run --seed N"),
    EnvVar(WORKER_START_ENV, _choice("zygote", "spawn"), "zygote (the default) or spawn"),
    EnvVar(HOST_NAME_ENV, _host, "this node's host name as the job calls it"),
    EnvVar(REPLICATE_ENV, _choice("off", "ring"), "undying run --replicate off|ring"),
    EnvVar(REPLICATE_EVERY_ENV, _whole(1, 1_000_000), "undying run --replicate-every N"),
    # The timeouts a rank reads (undying.config.Timeouts' fields), set for every rank from undying
    # run's options.
    *(EnvVar(name, _timeout, _BY_RUN, blank=False) for name in TIMEOUT_ENVS.values()),
    EnvVar(SAVE_EVERY_ENV, _whole(0, 2**62), _BY_RUN, blank=False),
    EnvVar(SAVE_INTERVAL_ENV, _non_negative, _BY_RUN, blank=False),
    EnvVar(KEEP_ENV, _whole(1, 1_000_000), _BY_RUN, blank=False),
    EnvVar(TRACE_MAX_FILE_MB_ENV, _positive, _BY_RUN, blank=False),
    EnvVar(TRACE_MAX_DIR_MB_ENV, _positive, _BY_RUN, blank=False),
    EnvVar(REDIRECTS_ENV, _whole(0, 3), _BY_RUN),
    EnvVar(TEE_ENV, _whole(0, 3), _BY_RUN),
    EnvVar(GENERATION_ENV, _whole(0, 2**62), _OWN, blank=False),
    EnvVar(INCARNATION_ENV, _whole(0, 2**62), _OWN),
    EnvVar(AGENT_PID_ENV, _whole(1, 2**31), _OWN, blank=False),
    EnvVar(AGENT_ADDR_ENV, _address, _OWN, blank=False),
    EnvVar(CONTROL_ADDR_ENV, _address, _OWN, blank=False),
    EnvVar(STORE_ADDR_ENV, _address, _OWN),
    EnvVar(JOINING_ENV, _choice("0", "1"), _OWN),
    EnvVar(BACKEND_ENV, _choice("gloo", "nccl"), _OWN),
    EnvVar(VERBOSE_ENV, _choice("0", "1"), "undying -v run sets it to 1"),
    EnvVar(JOB_ID_ENV, _job_id, _OWN, blank=False),
    # (a process with it set serves as the job's verifier: never one a launcher starts)
    EnvVar(VERIFY_SERVE_DIR_ENV, _none, "set by undying for its verifier; unset it"),
    # Any text is a value: paths, names, switches read as "set or not".
    *(EnvVar(name, _any, "") for name in (
        CHECKPOINT_DIR_ENV, TRACE_DIR_ENV, LOG_DIR_ENV, CONSOLE_ENV, JOB_DIR_ENV,
        RESUME_FROM_ENV, RETURNED_FILE_ENV, NODE_NAME_ENV, RESUME_DIGEST_ENV,
        DEMO_QUIET_ENV, PROMETHEUS_DIR_ENV)),
)}
# (UNDYING_TOKEN and the keys derived from it are read, and refused when inherited, by
# undying.jobfiles.tokens.)


def env_value(name: str, env: Mapping[str, str] | None = None) -> Any:
    """``name``'s value in ``env`` (default: this process's) read by its reader; None when unset
    or blank.

    A value the reader refuses is one line naming the variable, the value, what it takes and who
    sets it.
    """
    given = (os.environ if env is None else env).get(name)
    raw = "" if given is None else given.strip()
    var = ENV_VARS.get(name)
    if var is None or given is None or (not raw and var.blank):
        return raw or None
    try:
        return var.read(raw)
    except UsageError:
        raise
    except (ValueError, OverflowError) as e:
        expected = str(e) if str(e).startswith(("one of", "a ", "HOST", "it unset")) else "a number"
        raise UsageError(f"environment variable {name}={quoted(raw)}: expected {expected} "
                         f"({var.how or 'any text'}); fix it or unset it") from None


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Read every ``UNDYING_`` variable set in ``env`` that undying reads: the first bad one is
    one line."""
    env = os.environ if env is None else env
    for name in sorted(env):
        if name in ENV_VARS:
            env_value(name, env)
