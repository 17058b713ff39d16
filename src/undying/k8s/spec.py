"""What `undying k8s` is asked for (``Spec``), the commands its pods run,
and what a cluster would refuse.

``Spec.check`` refuses, in one line each, what Kubernetes or ``undying run``
would refuse later in a pod: a job id that is no DNS label, a bad quantity or
name, ``--run-args`` that repeat a flag the manifests set or that ``undying run``'s
own parser refuses. ``manifests`` builds the objects from a checked spec.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import cast

from undying.errors import UsageError
from undying.k8s.grace import Grace

__all__ = ["Spec", "validate_job_id", "TRACE_MOUNT", "TRACE_SWITCH_FILE", "JOB_DIR", "CKPT_MOUNT",
           "KINDS", "MANAGER_RJOB", "WORKERS_RJOB", "MIN_KUBERNETES"]

# Where the pods mount what the commands name.
TRACE_MOUNT = "/etc/undying/trace"
TRACE_SWITCH_FILE = f"{TRACE_MOUNT}/switch.json"
JOB_DIR = "/job"
CKPT_MOUNT = "/ckpt"
# The oldest Kubernetes the manifests are for: backoffLimitPerIndex and podReplacementPolicy are
# on by default from 1.29 (tests/unit/test_k8s.py checks every manifest against the OpenAPI
# schemas of each version from this one to the newest that kubernetes-validate ships).
MIN_KUBERNETES = (1, 29)
# What `undying k8s --kind` writes: Kubernetes' own objects, or one JobSet (jobset.x-k8s.io).
KINDS = ("job", "jobset")
# The JobSet's replicated jobs. JobSet names their pods <J>-<replicated job>-<job index>-<pod
# index> (with a 5-character random suffix), and the pods' hostnames the same without it.
MANAGER_RJOB = "manager"
WORKERS_RJOB = "workers"
# The longest suffix added to the job id in an object name ("-manager", "-workers").
_SUFFIX = "-workers"
_MAX_JOB_ID = 63 - len(_SUFFIX)
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
# Flags of `undying run` that these manifests set themselves; --run-args may not repeat them.
_OWNED_RUN_FLAGS = {
    "--nnodes", "--node-rank", "--manager", "-n", "--nproc-per-node", "--job-id", "--job-dir",
    "--trace-switch-file", "--checkpoint-dir", "--grace-period", "--backend", "--trace",
    "--save-every", "--save-interval", "--keep", "--spares", "--max-restarts",
}


@dataclass
class Spec:
    """Everything `undying k8s` was asked for; ``check()`` refuses what a cluster would."""

    job_id: str
    nodes: int
    nproc_per_node: int
    image: str
    command: list[str]  # SCRIPT ARGS
    grace: Grace
    namespace: str = ""
    token_secret: str = ""  # an existing Secret (key "token"); empty: generate one
    token: str = ""  # the generated token; empty: generate at build time
    cpu: str = ""
    memory: str = ""
    gpus: int = 0
    shm_size: str = "1Gi"
    checkpoint_pvc: str = ""
    checkpoint_url: str = ""  # an fsspec URL instead of a volume
    job_pvc: str = ""  # the manager's job dir (its SQLite event log)
    manager_kind: str = "deployment"
    open_status: bool = False  # the manager serves read-only status without the token
    port: int = 29400
    manager_cpu: str = "500m"
    manager_memory: str = "1Gi"
    node_retries: int = 3
    image_pull_policy: str = ""
    backend: str = ""  # empty: nccl with GPUs, else gloo
    trace: str = "off"
    save_every: int = 0
    save_interval: float = 0.0
    keep: int = 3
    spares: int = 1
    max_restarts: int = 3
    run_args: list[str] = field(default_factory=list)
    # The fewest nodes the job may train on (--nnodes MIN:MAX on every agent); 0: exactly ``nodes``.
    min_nodes: int = 0
    kind: str = "job"  # one of KINDS
    jobset_restarts: int = 2  # the JobSet's failurePolicy.maxRestarts (--kind jobset only)

    # --- derived names ------------------------------------------------------

    @property
    def manager_name(self) -> str:
        return f"{self.job_id}-manager"

    @property
    def workers_name(self) -> str:
        return f"{self.job_id}-workers"

    @property
    def secret_name(self) -> str:
        return self.token_secret or f"{self.job_id}-token"

    @property
    def trace_configmap(self) -> str:
        return f"{self.job_id}-trace"

    @property
    def manager_host(self) -> str:
        """Where the agents find the manager: its Service, or (JobSet) its pod's hostname in the
        JobSet's headless Service, whose name is the job id."""
        if self.kind == "jobset":
            return f"{self.job_id}-{MANAGER_RJOB}-0-0.{self.job_id}"
        return self.manager_name

    @property
    def store_port(self) -> int:
        return self.port + 1

    @property
    def http_port(self) -> int:
        return self.port + 2

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint_url or f"{CKPT_MOUNT}/{self.job_id}"

    @property
    def effective_backend(self) -> str:
        return self.backend or ("nccl" if self.gpus > 0 else "gloo")

    def check(self) -> None:
        validate_job_id(self.job_id)
        if self.nodes < 1:
            raise UsageError(f"--nodes must be at least 1, got {self.nodes}")
        if not 0 <= self.min_nodes <= self.nodes:
            raise UsageError(f"--min-nodes must be between 1 and --nodes ({self.nodes}), "
                             f"got {self.min_nodes}")
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if not self.image or any(c.isspace() for c in self.image):
            raise UsageError(f"--image must be an image reference without spaces (e.g. "
                             f"registry.example.com/train:1.0), got {self.image!r}")
        if not self.command:
            raise UsageError("no training script: end the command with -- SCRIPT [ARGS], "
                             "e.g. -- train.py --lr 0.1")
        if self.namespace:
            _check_name("--namespace", self.namespace, label=True)
        for flag, name in (("--token-secret", self.token_secret),
                           ("--checkpoint-pvc", self.checkpoint_pvc),
                           ("--job-pvc", self.job_pvc)):
            if name:
                _check_name(flag, name, label=False)
        if self.checkpoint_pvc and self.checkpoint_url:
            raise UsageError("--checkpoint-pvc and --checkpoint-dir both say where checkpoints go: "
                             "pass one")
        for flag, q in (("--cpu", self.cpu), ("--memory", self.memory),
                        ("--shm-size", self.shm_size), ("--manager-cpu", self.manager_cpu),
                        ("--manager-memory", self.manager_memory)):
            if q and not _QUANTITY.fullmatch(q):
                raise UsageError(f"{flag}: {q!r} is not a Kubernetes quantity "
                                 "(e.g. 4, 500m, 16Gi, 1.5)")
        if self.gpus < 0:
            raise UsageError(f"--gpus must be 0 or more, got {self.gpus}")
        if self.effective_backend == "nccl" and self.gpus < self.nproc_per_node:
            raise UsageError(
                f"--backend nccl needs a GPU per rank: --gpus {self.gpus} for --nproc-per-node "
                f"{self.nproc_per_node}; raise --gpus or use --backend gloo")
        if not 1 <= self.port <= 65533:
            raise UsageError("--port must be 1..65533 (the store and HTTP API use the next two), "
                             f"got {self.port}")
        if self.node_retries < 0:
            raise UsageError(f"--node-retries must be 0 or more, got {self.node_retries}")
        if self.manager_kind not in ("deployment", "pod"):
            raise UsageError(f"--manager-kind must be deployment or pod, got {self.manager_kind!r}")
        self._check_kind()
        for arg in self.run_args:
            flag = arg.split("=", 1)[0]
            if _owned(flag):
                raise UsageError(f"--run-args: {flag} is set by undying k8s itself; "
                                 "use its own option (see undying k8s --help)")
        _check_run_argv(self.worker_argv(node_rank="0"))

    def _check_kind(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "jobset":
            return
        if self.manager_kind != "deployment":
            raise UsageError("--manager-kind is for --kind job; with --kind jobset the manager is "
                             "the JobSet's replicated job 'manager': drop --manager-kind")
        if self.jobset_restarts < 0:
            raise UsageError(f"--jobset-restarts must be 0 or more, got {self.jobset_restarts}")
        # JobSet's admission webhook refuses a set whose longest pod name (with its 5-character
        # random suffix) is no DNS-1035 label: <J>-workers-0-<last index>-xxxxx.
        longest = f"{self.job_id}-{WORKERS_RJOB}-0-{self.nodes - 1}-xxxxx"
        if len(longest) > 63:
            most = len(self.job_id) - (len(longest) - 63)
            raise UsageError(f"--job-id {self.job_id!r} is too long for --kind jobset with "
                             f"{self.nodes} nodes: its pods would be named {longest!r} "
                             f"({len(longest)} characters, at most 63); use at most {most} "
                             "characters")

    # --- commands -----------------------------------------------------------

    def manager_argv(self) -> list[str]:
        argv = ["undying", "manager", "--job-id", self.job_id, "--host", "0.0.0.0",
                "--port", str(self.port), "--http-port", str(self.http_port),
                "--job-dir", JOB_DIR]
        return argv + (["--open-status"] if self.open_status else [])

    def worker_argv(self, node_rank: str = "$(JOB_COMPLETION_INDEX)") -> list[str]:
        elastic = 0 < self.min_nodes < self.nodes
        nnodes = f"{self.min_nodes}:{self.nodes}" if elastic else str(self.nodes)
        argv = ["undying", "run", "--nnodes", nnodes, "--node-rank", node_rank,
                "--manager", f"{self.manager_host}:{self.port}", "-n", str(self.nproc_per_node),
                "--job-id", self.job_id, "--job-dir", JOB_DIR,
                "--trace-switch-file", TRACE_SWITCH_FILE,
                "--trace", self.trace, "--checkpoint-dir", self.checkpoint_dir,
                "--grace-period", f"{self.grace.gasp_s:g}", "--backend", self.effective_backend,
                "--keep", str(self.keep), "--spares", str(self.spares),
                "--max-restarts", str(self.max_restarts)]
        if self.save_every:
            argv += ["--save-every", str(self.save_every)]
        if self.save_interval:
            argv += ["--save-interval", f"{self.save_interval:g}"]
        argv += self.run_args
        if self.command[0].startswith("-"):
            argv.append("--")  # a script named like a flag
        return argv + self.command



def validate_job_id(job_id: str) -> None:
    """A job id names Kubernetes objects and DNS names: refuse, saying why, what a cluster would."""
    what = f"--job-id {job_id!r}"
    if not job_id:
        raise UsageError("--job-id is empty; give the job a name like my-job-1")
    if len(job_id) > _MAX_JOB_ID:
        raise UsageError(f"{what} is {len(job_id)} characters; at most {_MAX_JOB_ID}, so that "
                         f"'{job_id[:8]}...{_SUFFIX}' stays a 63-character DNS label")
    if job_id != job_id.lower() and _DNS_LABEL.fullmatch(job_id.lower()):
        raise UsageError(f"{what} has upper-case letters; Kubernetes names are lower case: "
                         f"{job_id.lower()!r}")
    bad = sorted({c for c in job_id
                  if not (c.islower() or c.isdigit() or c == "-") or not c.isascii()})
    if bad:
        raise UsageError(f"{what} contains {' '.join(repr(c) for c in bad)}; "
                         "use only lower-case letters, digits and '-' (a DNS-1123 label)")
    if not job_id[0].isalpha():
        raise UsageError(f"{what} must start with a letter: its Service '{job_id}-manager' "
                         "is a DNS-1035 label")
    if job_id.endswith("-"):
        raise UsageError(f"{what} must end with a letter or digit (a DNS-1123 label)")


def _check_name(flag: str, name: str, *, label: bool) -> None:
    pattern, kind, limit = ((_DNS_LABEL, "DNS-1123 label", 63) if label
                            else (_DNS_SUBDOMAIN, "DNS-1123 subdomain", 253))
    if len(name) > limit or not pattern.fullmatch(name):
        raise UsageError(f"{flag} {name!r} is not a valid Kubernetes name ({kind}: lower-case "
                         f"letters, digits and '-'{'' if label else ' or .'}, starting and ending "
                         f"with a letter or digit, at most {limit})")


def _owned(flag: str) -> bool:
    """Whether FLAG sets what the manifests set, abbreviations (which argparse accepts) included."""
    if flag.startswith("--"):
        return len(flag) > 2 and any(o.startswith(flag) for o in _OWNED_RUN_FLAGS
                                     if o.startswith("--"))
    return flag.startswith("-n")  # -n, -n4


class _Refuse(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _check_run_argv(argv: list[str]) -> None:
    """Parse the agents' command with `undying run`'s own parser: a bad --run-args fails here,
    not in the pod."""
    from undying.cli import run  # the real parser, so the two can never disagree

    parser = _Refuse(prog="undying", add_help=False)
    # The subparser is a _Refuse too (add_subparsers makes its parsers of the parent's class).
    subparsers = parser.add_subparsers(dest="command")
    run.add_parser(cast("argparse._SubParsersAction[argparse.ArgumentParser]", subparsers))
    try:
        parser.parse_args(argv[1:])
    except UsageError as e:
        raise UsageError(f"the agents' command would be refused by `undying run`: {e}; "
                         "check --run-args") from None
