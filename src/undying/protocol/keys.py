"""The job's secrets in process environments: what a child may inherit, and what a launcher must
not.

One secret, the token, and keys derived from it (``HMAC-SHA256(token, label)``):

- ``UNDYING_CHECKPOINT_KEY`` signs and checks checkpoint manifests
  (``undying.checkpoint.mac``);
- ``UNDYING_STORE_KEY`` proves the job to its stores (``store_wire``);
- the API proof key proves a manager to the CLI (``api_proof``); it never
  leaves the manager and the commands.

An agent hands its workers, spares and zygote the first two and nothing else:
never ``UNDYING_TOKEN`` (a rank's environment is readable by every process of
the job's user, and by core dumps and crash reporters), and never a derived
key it inherited itself (a stale one from the user's shell would sign the
run's checkpoints under a key the next launch does not know).

A launcher (``undying run``, ``undying manager``) derives its keys from the
token only. A derived key in its own environment was left there by hand or
by an earlier job (``export`` of a worker's environment, a copied job
script): it is refused in one line. A launcher started by a rank of a job
(a job that launches jobs) is told from the user's shell by the agent that
started it: ``UNDYING_AGENT_PID`` names a live ancestor of the process; its
inherited keys are then the outer job's, and are dropped rather than refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from undying.protocol.env import AGENT_PID_ENV, CHECKPOINT_KEY_ENV, STORE_KEY_ENV, TOKEN_ENV

__all__ = ["DERIVED_KEY_ENVS", "child_environment", "inherited_key_problem", "started_by_an_agent"]

DERIVED_KEY_ENVS = (CHECKPOINT_KEY_ENV, STORE_KEY_ENV)
_SECRETS = (TOKEN_ENV, *DERIVED_KEY_ENVS)
_MAX_DEPTH = 64


def child_environment(inherited: Mapping[str, str], keys: Mapping[str, str]) -> dict[str, str]:
    """``inherited`` without the token or any derived key, then the derived ``keys`` this agent
    hands on.

    ``keys`` may hold only derived keys (``DERIVED_KEY_ENVS``): the token is
    never handed to a child, whoever asks.
    """
    wrong = sorted(set(keys) - set(DERIVED_KEY_ENVS))
    if wrong:
        raise ValueError(f"only derived keys go to a worker's environment, not {', '.join(wrong)}")
    env = {k: v for k, v in inherited.items() if k not in _SECRETS}
    env.update(keys)
    return env


def _parent(pid: int) -> int:
    """The parent of ``pid`` as /proc says (0 when it cannot be read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last
    # ")".
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0


def started_by_an_agent(environ: Mapping[str, str], pid: int | None = None) -> bool:
    """Whether the agent named in ``environ`` is a live ancestor of ``pid`` (default: this process).

    A copied environment names some agent too, but never one of this
    process's ancestors: the keys it carries did not come from an agent of
    ours.
    """
    raw = environ.get(AGENT_PID_ENV, "")
    if not raw.isdigit() or int(raw) <= 1:
        return False
    agent = int(raw)
    current = os.getpid() if pid is None else pid
    for _ in range(_MAX_DEPTH):
        current = _parent(current)
        if current <= 1:
            return False
        if current == agent:
            return True
    return False


def inherited_key_problem(environ: Mapping[str, str], pid: int | None = None) -> str | None:
    """Why a launcher may not start with ``environ``, in one line; None when it may.

    Derived keys in a launcher's environment that no agent of an enclosing
    job put there are stale (a shell that exported a worker's environment, a
    job script copied from a rank): they would sign this run's checkpoints or
    reach its stores with a key its token does not give.
    """
    found = [name for name in DERIVED_KEY_ENVS if environ.get(name)]
    if not found or started_by_an_agent(environ, pid):
        return None
    names = " and ".join(found)
    return (f"env {names} {'is' if len(found) == 1 else 'are'} set in this shell, but undying "
            f"derives its keys from the job's token (--token-file, {TOKEN_ENV} or "
            f"<job dir>/token) and hands them to its workers itself; a key set by hand or left "
            f"by an earlier job would sign this run's checkpoints under a key the next launch "
            f"does not know: run `unset {' '.join(found)}` and launch again")
