"""The Kubernetes objects one undying job needs, as plain dicts.

One job is: a Secret with the job's token; a ConfigMap with the trace switch;
the manager (a Deployment of one, or a bare Pod) and a Service in front of its
three ports; the workers, an indexed Job with one agent per pod, the pod's
completion index being the agent's ``--node-rank``.

Choices that matter (docs/kubernetes.md says more):

- Workers use ``restartPolicy: Never``: a failed agent is replaced by a new
  pod with the same index, a fresh agent that joins the manager as the
  node's replacement, which is what the manager expects after a node loss.
  Never is also what ``podFailurePolicy`` and ``backoffLimitPerIndex`` need.
- ``podReplacementPolicy: Failed``: the replacement pod starts only once the
  old one is gone, so a node rank never has two agents (one still in its
  dying gasp).
- ``podFailurePolicy``: an agent's exit 2 (the manager refused it: another
  job's token, flags unlike the job's, a bad flag) fails the whole Job at
  once, because a new pod would be refused the same way; 75 (the job was
  preempted and wrote its checkpoint: a new pod resumes it) and a disruption
  (eviction, drain, preemption by the scheduler) do not count against the
  retries. Exit 1 counts and is retried: an agent exits 1 when its job
  failed, but also when the manager stayed unreachable past the rendezvous
  timeout, which a new pod may get past.
- The agent is PID 1 (``command`` overrides the image's entrypoint), so the
  preStop hook's ``kill -TERM 1`` reaches it and its wait ends when it exits.
- The trace switch is a directory mount, never ``subPath``: the kubelet
  updates a ConfigMap's directory mount after ``kubectl edit``, never a
  subPath one.
- The manager's Deployment uses the Recreate strategy: two managers on one
  job (and one event log) must never run at once.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, cast

from undying.errors import UsageError
from undying.k8s.grace import Grace
from undying.protocol.env import TOKEN_ENV

__all__ = [
    "Spec",
    "Manifest",
    "build",
    "validate_job_id",
    "AGENT_CONTAINER",
    "MANAGER_CONTAINER",
    "TRACE_MOUNT",
    "TRACE_SWITCH_FILE",
    "PRESTOP_COMMAND",
    "EXIT_USAGE",
    "EXIT_PREEMPTED",
]

AGENT_CONTAINER = "agent"
MANAGER_CONTAINER = "manager"
TRACE_MOUNT = "/etc/undying/trace"
TRACE_SWITCH_FILE = f"{TRACE_MOUNT}/switch.json"
JOB_DIR = "/job"
CKPT_MOUNT = "/ckpt"
TOKEN_KEY = "token"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# SIGTERM to the agent starts its dying gasp; the hook then waits while it runs, so the
# kubelet holds the pod until the agent exits (or terminationGracePeriodSeconds passes).
PRESTOP_COMMAND = ["sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 0.5; done"]
# undying run's exit codes (README "Commands"; an agent of a multi-node job exits 2 when refused).
EXIT_USAGE = 2
EXIT_PREEMPTED = 75
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
            raise UsageError(f"--min-nodes must be between 1 and --nodes ({self.nodes}), got {self.min_nodes}")
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if not self.image or any(c.isspace() for c in self.image):
            raise UsageError(f"--image must be an image reference without spaces (e.g. "
                             f"registry.example.com/train:1.0), got {self.image!r}")
        if not self.command:
            raise UsageError("no training script: end the command with -- SCRIPT [ARGS], e.g. -- train.py --lr 0.1")
        if self.namespace:
            _check_name("--namespace", self.namespace, label=True)
        for flag, name in (("--token-secret", self.token_secret), ("--checkpoint-pvc", self.checkpoint_pvc),
                           ("--job-pvc", self.job_pvc)):
            if name:
                _check_name(flag, name, label=False)
        if self.checkpoint_pvc and self.checkpoint_url:
            raise UsageError("--checkpoint-pvc and --checkpoint-dir both say where checkpoints go: pass one")
        for flag, q in (("--cpu", self.cpu), ("--memory", self.memory), ("--shm-size", self.shm_size),
                        ("--manager-cpu", self.manager_cpu), ("--manager-memory", self.manager_memory)):
            if q and not _QUANTITY.fullmatch(q):
                raise UsageError(f"{flag}: {q!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi, 1.5)")
        if self.gpus < 0:
            raise UsageError(f"--gpus must be 0 or more, got {self.gpus}")
        if self.effective_backend == "nccl" and self.gpus < self.nproc_per_node:
            raise UsageError(
                f"--backend nccl needs a GPU per rank: --gpus {self.gpus} for --nproc-per-node "
                f"{self.nproc_per_node}; raise --gpus or use --backend gloo")
        if not 1 <= self.port <= 65533:
            raise UsageError(f"--port must be 1..65533 (the store and HTTP API use the next two), got {self.port}")
        if self.node_retries < 0:
            raise UsageError(f"--node-retries must be 0 or more, got {self.node_retries}")
        if self.manager_kind not in ("deployment", "pod"):
            raise UsageError(f"--manager-kind must be deployment or pod, got {self.manager_kind!r}")
        for arg in self.run_args:
            flag = arg.split("=", 1)[0]
            if _owned(flag):
                raise UsageError(f"--run-args: {flag} is set by undying k8s itself; use its own option "
                                 "(see undying k8s --help)")
        _check_run_argv(self.worker_argv(node_rank="0"))

    # --- commands -----------------------------------------------------------

    def manager_argv(self) -> list[str]:
        argv = ["undying", "manager", "--job-id", self.job_id, "--host", "0.0.0.0", "--port", str(self.port),
                "--http-port", str(self.http_port), "--job-dir", JOB_DIR]
        return argv + (["--open-status"] if self.open_status else [])

    def worker_argv(self, node_rank: str = "$(JOB_COMPLETION_INDEX)") -> list[str]:
        nnodes = f"{self.min_nodes}:{self.nodes}" if 0 < self.min_nodes < self.nodes else str(self.nodes)
        argv = ["undying", "run", "--nnodes", nnodes, "--node-rank", node_rank,
                "--manager", f"{self.manager_name}:{self.port}", "-n", str(self.nproc_per_node),
                "--job-id", self.job_id, "--job-dir", JOB_DIR, "--trace-switch-file", TRACE_SWITCH_FILE,
                "--trace", self.trace, "--checkpoint-dir", self.checkpoint_dir,
                "--grace-period", f"{self.grace.gasp_s:g}", "--backend", self.effective_backend,
                "--keep", str(self.keep), "--spares", str(self.spares), "--max-restarts", str(self.max_restarts)]
        if self.save_every:
            argv += ["--save-every", str(self.save_every)]
        if self.save_interval:
            argv += ["--save-interval", f"{self.save_interval:g}"]
        argv += self.run_args
        if self.command[0].startswith("-"):
            argv.append("--")  # a script named like a flag
        return argv + self.command


@dataclass(frozen=True)
class Manifest:
    """One object: the file it goes to with --out, its comments, and the object."""

    filename: str
    comments: tuple[str, ...]
    obj: dict[str, Any]


def validate_job_id(job_id: str) -> None:
    """A job id names Kubernetes objects and DNS names: refuse, saying why, what a cluster would."""
    what = f"--job-id {job_id!r}"
    if not job_id:
        raise UsageError("--job-id is empty; give the job a name like my-job-1")
    if len(job_id) > _MAX_JOB_ID:
        raise UsageError(f"{what} is {len(job_id)} characters; at most {_MAX_JOB_ID}, so that "
                         f"'{job_id[:8]}...{_SUFFIX}' stays a 63-character DNS label")
    if job_id != job_id.lower() and _DNS_LABEL.fullmatch(job_id.lower()):
        raise UsageError(f"{what} has upper-case letters; Kubernetes names are lower case: {job_id.lower()!r}")
    bad = sorted({c for c in job_id if not (c.islower() or c.isdigit() or c == "-") or not c.isascii()})
    if bad:
        raise UsageError(f"{what} contains {' '.join(repr(c) for c in bad)}; use only lower-case letters, "
                         "digits and '-' (a DNS-1123 label)")
    if not job_id[0].isalpha():
        raise UsageError(f"{what} must start with a letter: its Service '{job_id}-manager' is a DNS-1035 label")
    if job_id.endswith("-"):
        raise UsageError(f"{what} must end with a letter or digit (a DNS-1123 label)")


def _check_name(flag: str, name: str, *, label: bool) -> None:
    pattern, kind, limit = (_DNS_LABEL, "DNS-1123 label", 63) if label else (_DNS_SUBDOMAIN, "DNS-1123 subdomain", 253)
    if len(name) > limit or not pattern.fullmatch(name):
        raise UsageError(f"{flag} {name!r} is not a valid Kubernetes name ({kind}: lower-case letters, digits "
                         f"and '-'{'' if label else ' or .'}, starting and ending with a letter or digit, at most {limit})")


def _owned(flag: str) -> bool:
    """Whether FLAG sets what the manifests set, abbreviations (which argparse accepts) included."""
    if flag.startswith("--"):
        return len(flag) > 2 and any(o.startswith(flag) for o in _OWNED_RUN_FLAGS if o.startswith("--"))
    return flag.startswith("-n")  # -n, -n4


class _Refuse(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _check_run_argv(argv: list[str]) -> None:
    """Parse the agents' command with `undying run`'s own parser: a bad --run-args fails here, not in the pod."""
    from undying.cli import run  # the real parser, so the two can never disagree

    parser = _Refuse(prog="undying", add_help=False)
    # The subparser is a _Refuse too (add_subparsers makes its parsers of the parent's class).
    run.add_parser(cast("argparse._SubParsersAction[argparse.ArgumentParser]", parser.add_subparsers(dest="command")))
    try:
        parser.parse_args(argv[1:])
    except UsageError as e:
        raise UsageError(f"the agents' command would be refused by `undying run`: {e}; check --run-args") from None


# --- the objects ----------------------------------------------------------------------------------

def _labels(spec: Spec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "undying", "app.kubernetes.io/component": component,
            "undying/job": spec.job_id}


def _meta(spec: Spec, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    meta["labels"] = _labels(spec, component)
    return meta


def _token_env(spec: Spec) -> dict[str, Any]:
    return {"name": TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": spec.secret_name, "key": TOKEN_KEY}}}


def _image(spec: Spec) -> dict[str, Any]:
    out: dict[str, Any] = {"image": spec.image}
    if spec.image_pull_policy:
        out["imagePullPolicy"] = spec.image_pull_policy
    return out


def _checkpoint_volume(spec: Spec) -> dict[str, Any]:
    if spec.checkpoint_pvc:
        return {"name": "ckpt", "persistentVolumeClaim": {"claimName": spec.checkpoint_pvc}}
    return {"name": "ckpt", "emptyDir": {}}


def secret(spec: Spec) -> Manifest:
    token = spec.token or secrets.token_urlsafe(32)
    obj = {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(spec, spec.secret_name, "token"),
           "type": "Opaque", "stringData": {TOKEN_KEY: token}}
    return Manifest("00-secret.yaml", (
        "The job's token: the manager's API refuses requests without it; agents present it.",
        "Generated now. Apply it once: regenerating makes a new token that the running manager does not know.",
    ), obj)


def trace_configmap(spec: Spec) -> Manifest:
    step = "on" if spec.trace in ("on", "comm") else "off"
    comm = "on" if spec.trace == "comm" else "off"
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, spec.trace_configmap, "trace"),
           "data": {posixpath.basename(TRACE_SWITCH_FILE): f'{{"step": "{step}", "comm": "{comm}"}}'}}
    return Manifest("01-trace-configmap.yaml", (
        f"The trace switch, mounted in every worker at {TRACE_MOUNT}/ (a directory mount: no subPath,",
        f"which the kubelet never updates). `kubectl edit configmap {spec.trace_configmap}` reaches the",
        "agents within the kubelet's sync period (about a minute).",
    ), obj)


def manager_service(spec: Spec) -> Manifest:
    obj = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, spec.manager_name, "manager"),
           "spec": {"selector": _labels(spec, "manager"), "ports": [
               {"name": "agent", "port": spec.port, "targetPort": "agent"},
               {"name": "store", "port": spec.store_port, "targetPort": "store"},
               {"name": "http", "port": spec.http_port, "targetPort": "http"},
           ]}}
    return Manifest("02-manager-service.yaml", (
        f"The manager's ports: agents join at {spec.port}, workers rendezvous through the c10d store at "
        f"{spec.store_port},",
        f"the HTTP API and status page at {spec.http_port} (kubectl port-forward svc/{spec.manager_name} "
        f"{spec.http_port}).",
    ), obj)


def _manager_pod_spec(spec: Spec) -> dict[str, Any]:
    mounts = [{"name": "job", "mountPath": JOB_DIR}]
    volumes: list[dict[str, Any]] = [
        {"name": "job", "persistentVolumeClaim": {"claimName": spec.job_pvc}} if spec.job_pvc
        else {"name": "job", "emptyDir": {}}]
    if spec.checkpoint_pvc:  # the manager looks for the latest valid checkpoint itself
        mounts.append({"name": "ckpt", "mountPath": CKPT_MOUNT})
        volumes.append(_checkpoint_volume(spec))
    resources = {"requests": {k: v for k, v in (("cpu", spec.manager_cpu), ("memory", spec.manager_memory)) if v}}
    container = {
        "name": MANAGER_CONTAINER, **_image(spec), "command": spec.manager_argv(),
        "env": [_token_env(spec), {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": "agent", "containerPort": spec.port},
                  {"name": "store", "containerPort": spec.store_port},
                  {"name": "http", "containerPort": spec.http_port}],
        # Ready once agents can connect. No liveness probe: a kill would be a SIGTERM, which preempts the job.
        "readinessProbe": {"tcpSocket": {"port": "agent"}, "periodSeconds": 5},
        "volumeMounts": mounts,
    }
    if resources["requests"]:
        container["resources"] = resources
    return {"terminationGracePeriodSeconds": spec.grace.kubernetes_s, "automountServiceAccountToken": False,
            "containers": [container], "volumes": volumes}


def manager(spec: Spec) -> Manifest:
    pod_spec = _manager_pod_spec(spec)
    comments = [
        "The manager: SIGTERM to it (deleting or draining it) preempts the whole job: every rank",
        "finishes its step and a dying-gasp checkpoint is written, so its grace period is the workers'.",
        spec.grace.explain(),
    ]
    if not spec.job_pvc:
        comments.append("WARNING: the job dir (/job, the SQLite event log) is an emptyDir: a manager pod that "
                        "is replaced starts a new log; pass --job-pvc NAME to keep it.")
    if spec.manager_kind == "pod":
        pod_spec = {"restartPolicy": "OnFailure", **pod_spec}
        obj = {"apiVersion": "v1", "kind": "Pod", "metadata": _meta(spec, spec.manager_name, "manager"),
               "spec": pod_spec}
        comments.append("A bare Pod: restarted in place on failure, stays Completed when the job ends, "
                        "but is not rescheduled if its node is lost.")
    else:
        labels = _labels(spec, "manager")
        obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, spec.manager_name, "manager"),
               "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                        "selector": {"matchLabels": labels},
                        "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}
        comments.append("A Deployment of one, Recreate: rescheduled when its node is lost, and never two at once.")
    return Manifest("03-manager.yaml", tuple(comments), obj)


def workers(spec: Spec) -> Manifest:
    mounts = [{"name": "trace-switch", "mountPath": TRACE_MOUNT, "readOnly": True},
              {"name": "job", "mountPath": JOB_DIR},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "trace-switch", "configMap": {"name": spec.trace_configmap}},
        {"name": "job", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", **({"sizeLimit": spec.shm_size} if spec.shm_size else {})}},
    ]
    if not spec.checkpoint_url:
        mounts.append({"name": "ckpt", "mountPath": CKPT_MOUNT})
        volumes.append(_checkpoint_volume(spec))
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    for key, value in (("cpu", spec.cpu), ("memory", spec.memory)):
        if value:  # requests = limits: the Guaranteed class, the last to be evicted under pressure
            limits[key] = requests[key] = value
    if spec.gpus:
        limits["nvidia.com/gpu"] = str(spec.gpus)
    container: dict[str, Any] = {
        "name": AGENT_CONTAINER, **_image(spec), "command": spec.worker_argv(),
        "env": [
            # The Job controller sets this too on Kubernetes >= 1.22; declared here so that
            # $(JOB_COMPLETION_INDEX) in the command expands on every version with indexed Jobs.
            {"name": "JOB_COMPLETION_INDEX",
             "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
            _token_env(spec),
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "lifecycle": {"preStop": {"exec": {"command": list(PRESTOP_COMMAND)}}},
        "volumeMounts": mounts,
    }
    if limits:
        container["resources"] = {"limits": limits, **({"requests": requests} if requests else {})}
    pod_spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": spec.grace.kubernetes_s,
                "automountServiceAccountToken": False, "containers": [container], "volumes": volumes}
    exit_rule = {"containerName": AGENT_CONTAINER, "operator": "In"}
    obj = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(spec, spec.workers_name, "worker"),
        "spec": {
            "completionMode": "Indexed", "completions": spec.nodes, "parallelism": spec.nodes,
            "backoffLimitPerIndex": spec.node_retries, "maxFailedIndexes": 0,
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {**exit_rule, "values": [EXIT_USAGE]}},
                {"action": "Ignore", "onExitCodes": {**exit_rule, "values": [EXIT_PREEMPTED]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {"metadata": {"labels": _labels(spec, "worker")}, "spec": pod_spec},
        },
    }
    comments = [
        f"The workers: {spec.nodes} pods, one agent each, node rank = the pod's completion index.",
        "restartPolicy Never: a failed agent's pod is replaced by a new one with the same index, which joins",
        f"as that node's replacement (at most {spec.node_retries} times per index, then the Job fails).",
        "podFailurePolicy: exit 2 (the manager refused the agent: token, flags) fails the Job at once;",
        "exit 75 (preempted, checkpoint written) and evictions/drains are retried without counting.",
        "preStop: SIGTERM to the agent (PID 1) starts its dying gasp; the hook waits until it exits.",
        spec.grace.explain(),
    ]
    if spec.checkpoint_url:
        comments.append(f"Checkpoints go to {spec.checkpoint_url} (fsspec); credentials are the image's "
                        "or the cluster's business.")
    elif not spec.checkpoint_pvc:
        comments.append(f"WARNING: checkpoints ({CKPT_MOUNT}) are in an emptyDir: a preemption's dying-gasp "
                        "checkpoint dies with its pod; pass --checkpoint-pvc NAME (ReadWriteMany).")
    return Manifest("04-workers.yaml", tuple(comments), obj)


def build(spec: Spec) -> list[Manifest]:
    """Every object of the job, in the order to apply them (as `kubectl apply -f DIR` sorts the files)."""
    spec.check()
    out = [] if spec.token_secret else [secret(spec)]
    return out + [trace_configmap(spec), manager_service(spec), manager(spec), workers(spec)]
