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

With ``--kind jobset`` the manager and the workers are instead the two
replicated jobs of one JobSet (``jobset``), which adds the headless Service the
agents find the manager through and a failure policy over both.

What the user asked for, and its checks, is ``spec`` (``Spec``).
"""

from __future__ import annotations

import posixpath
import secrets
from dataclasses import dataclass
from typing import Any

from undying.k8s import jobset as jobset_mod
from undying.k8s.spec import CKPT_MOUNT, JOB_DIR, TRACE_MOUNT, TRACE_SWITCH_FILE, Spec
from undying.protocol.env import PROMETHEUS_DIR_ENV, TOKEN_ENV

__all__ = [
    "Manifest",
    "build",
    "AGENT_CONTAINER",
    "MANAGER_CONTAINER",
    "PRESTOP_COMMAND",
    "EXIT_USAGE",
    "EXIT_PREEMPTED",
]

AGENT_CONTAINER = "agent"
MANAGER_CONTAINER = "manager"
TOKEN_KEY = "token"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# SIGTERM to the agent starts its dying gasp; the hook then waits while it runs, so the
# kubelet holds the pod until the agent exits (or terminationGracePeriodSeconds passes).
PRESTOP_COMMAND = ["sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 0.5; done"]
# undying run's exit codes (README "Commands"; an agent of a multi-node job exits 2 when refused).
EXIT_USAGE = 2
EXIT_PREEMPTED = 75


@dataclass(frozen=True)
class Manifest:
    """One object: the file it goes to with --out, its comments, and the object."""

    filename: str
    comments: tuple[str, ...]
    obj: dict[str, Any]



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
        "Generated now. Apply it once: regenerating makes a new token that the running manager "
        "does not know.",
    ), obj)


def trace_configmap(spec: Spec) -> Manifest:
    step = "on" if spec.trace in ("on", "comm") else "off"
    comm = "on" if spec.trace == "comm" else "off"
    switch = f'{{"step": "{step}", "comm": "{comm}"}}'
    obj = {"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": _meta(spec, spec.trace_configmap, "trace"),
           "data": {posixpath.basename(TRACE_SWITCH_FILE): switch}}
    return Manifest("01-trace-configmap.yaml", (
        f"The trace switch, mounted in every worker at {TRACE_MOUNT}/ "
        "(a directory mount: no subPath,",
        "which the kubelet never updates). "
        f"`kubectl edit configmap {spec.trace_configmap}` reaches the",
        "agents within the kubelet's sync period (about a minute).",
    ), obj)


def manager_service(spec: Spec) -> Manifest:
    obj = {"apiVersion": "v1", "kind": "Service",
           "metadata": _meta(spec, spec.manager_name, "manager"),
           "spec": {"selector": _labels(spec, "manager"), "ports": [
               {"name": "agent", "port": spec.port, "targetPort": "agent"},
               {"name": "store", "port": spec.store_port, "targetPort": "store"},
               {"name": "http", "port": spec.http_port, "targetPort": "http"},
           ]}}
    return Manifest("02-manager-service.yaml", (
        f"The manager's ports: agents join at {spec.port}, workers rendezvous through the c10d "
        f"store at {spec.store_port},",
        f"the HTTP API and status page at {spec.http_port} "
        f"(kubectl port-forward svc/{spec.manager_name} {spec.http_port}).",
    ), obj)


def _manager_pod_spec(spec: Spec) -> dict[str, Any]:
    mounts = [{"name": "job", "mountPath": JOB_DIR}]
    volumes: list[dict[str, Any]] = [
        {"name": "job", "persistentVolumeClaim": {"claimName": spec.job_pvc}} if spec.job_pvc
        else {"name": "job", "emptyDir": {}}]
    if spec.checkpoint_pvc:  # the manager looks for the latest valid checkpoint itself
        mounts.append({"name": "ckpt", "mountPath": CKPT_MOUNT})
        volumes.append(_checkpoint_volume(spec))
    asked = (("cpu", spec.manager_cpu), ("memory", spec.manager_memory))
    resources = {"requests": {k: v for k, v in asked if v}}
    container = {
        "name": MANAGER_CONTAINER, **_image(spec), "command": spec.manager_argv(),
        # (Prometheus finds the manager through its Service, never a target file in the pod)
        "env": [_token_env(spec), {"name": "PYTHONUNBUFFERED", "value": "1"},
                {"name": PROMETHEUS_DIR_ENV, "value": "off"}],
        "ports": [{"name": "agent", "containerPort": spec.port},
                  {"name": "store", "containerPort": spec.store_port},
                  {"name": "http", "containerPort": spec.http_port}],
        # Ready once agents can connect. No liveness probe: a kill would be a SIGTERM, which
        # preempts the job.
        "readinessProbe": {"tcpSocket": {"port": "agent"}, "periodSeconds": 5},
        "volumeMounts": mounts,
    }
    if resources["requests"]:
        container["resources"] = resources
    return {"terminationGracePeriodSeconds": spec.grace.kubernetes_s,
            "automountServiceAccountToken": False,
            "containers": [container], "volumes": volumes}


def manager(spec: Spec) -> Manifest:
    pod_spec = _manager_pod_spec(spec)
    comments = [
        "The manager: SIGTERM to it (deleting or draining it) preempts the whole job: every rank",
        "finishes its step and a dying-gasp checkpoint is written, so its grace period is "
        "the workers'.",
        spec.grace.explain(),
    ]
    if not spec.job_pvc:
        comments.append("WARNING: the job dir (/job, the SQLite event log) is an emptyDir: "
                        "a manager pod that is replaced starts a new log; pass --job-pvc NAME "
                        "to keep it.")
    if spec.manager_kind == "pod":
        pod_spec = {"restartPolicy": "OnFailure", **pod_spec}
        obj = {"apiVersion": "v1", "kind": "Pod",
               "metadata": _meta(spec, spec.manager_name, "manager"), "spec": pod_spec}
        comments.append("A bare Pod: restarted in place on failure, stays Completed when the job "
                        "ends, but is not rescheduled if its node is lost.")
    else:
        labels = _labels(spec, "manager")
        obj = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": _meta(spec, spec.manager_name, "manager"),
               "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                        "selector": {"matchLabels": labels},
                        "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}
        comments.append("A Deployment of one, Recreate: rescheduled when its node is lost, "
                        "and never two at once.")
    return Manifest("03-manager.yaml", tuple(comments), obj)


def _workers_job_spec(spec: Spec) -> dict[str, Any]:
    """The workers' Job spec: the same in a Job of its own and in the JobSet's 'workers'."""
    mounts = [{"name": "trace-switch", "mountPath": TRACE_MOUNT, "readOnly": True},
              {"name": "job", "mountPath": JOB_DIR},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "trace-switch", "configMap": {"name": spec.trace_configmap}},
        {"name": "job", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory",
                                      **({"sizeLimit": spec.shm_size} if spec.shm_size else {})}},
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
             "valueFrom": {"fieldRef": {
                 "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
            _token_env(spec),
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "lifecycle": {"preStop": {"exec": {"command": list(PRESTOP_COMMAND)}}},
        "volumeMounts": mounts,
    }
    if limits:
        container["resources"] = {"limits": limits, **({"requests": requests} if requests else {})}
    pod_spec = {"restartPolicy": "Never",
                "terminationGracePeriodSeconds": spec.grace.kubernetes_s,
                "automountServiceAccountToken": False, "containers": [container],
                "volumes": volumes}
    exit_rule = {"containerName": AGENT_CONTAINER, "operator": "In"}
    return {
        "completionMode": "Indexed", "completions": spec.nodes, "parallelism": spec.nodes,
        "backoffLimitPerIndex": spec.node_retries, "maxFailedIndexes": 0,
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {**exit_rule, "values": [EXIT_USAGE]}},
            {"action": "Ignore", "onExitCodes": {**exit_rule, "values": [EXIT_PREEMPTED]}},
            {"action": "Ignore",
             "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": {"metadata": {"labels": _labels(spec, "worker")}, "spec": pod_spec},
    }


def _workers_comments(spec: Spec) -> list[str]:
    comments = [
        f"The workers: {spec.nodes} pods, one agent each, node rank = the pod's completion index.",
        "restartPolicy Never: a failed agent's pod is replaced by a new one with the same index, "
        "which joins",
        f"as that node's replacement (at most {spec.node_retries} times per index, "
        "then the Job fails).",
        "podFailurePolicy: exit 2 (the manager refused the agent: token, flags) fails the Job "
        "at once;",
        "exit 75 (preempted, checkpoint written) and evictions/drains are retried without "
        "counting.",
        "preStop: SIGTERM to the agent (PID 1) starts its dying gasp; the hook waits until it "
        "exits.",
        spec.grace.explain(),
    ]
    if spec.checkpoint_url:
        comments.append(f"Checkpoints go to {spec.checkpoint_url} (fsspec); credentials are the "
                        "image's or the cluster's business.")
    elif not spec.checkpoint_pvc:
        comments.append(f"WARNING: checkpoints ({CKPT_MOUNT}) are in an emptyDir: a preemption's "
                        "dying-gasp checkpoint dies with its pod; pass --checkpoint-pvc NAME "
                        "(ReadWriteMany).")
    return comments


def workers(spec: Spec) -> Manifest:
    obj = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": _meta(spec, spec.workers_name, "worker"), "spec": _workers_job_spec(spec)}
    return Manifest("04-workers.yaml", tuple(_workers_comments(spec)), obj)


def jobset(spec: Spec) -> Manifest:
    """The manager and the workers as one JobSet (``--kind jobset``)."""
    manager_job = {
        "metadata": {"labels": _labels(spec, "manager")},
        "spec": {"completionMode": "Indexed", "completions": 1, "parallelism": 1,
                 "backoffLimit": spec.node_retries,
                 "template": {"metadata": {"labels": _labels(spec, "manager")},
                              "spec": {"restartPolicy": "OnFailure",
                                       **_manager_pod_spec(spec)}}}}
    workers_job = {"metadata": {"labels": _labels(spec, "worker")},
                   "spec": _workers_job_spec(spec)}
    obj, comments = jobset_mod.jobset(spec, _meta(spec, spec.job_id, "jobset"), manager_job,
                                      workers_job)
    return Manifest("02-jobset.yaml", tuple(comments + _workers_comments(spec)), obj)


def build(spec: Spec) -> list[Manifest]:
    """Every object of the job, in the order to apply them
    (as `kubectl apply -f DIR` sorts the files)."""
    spec.check()
    out = [] if spec.token_secret else [secret(spec)]
    if spec.kind == "jobset":
        return out + [trace_configmap(spec), jobset(spec)]
    return out + [trace_configmap(spec), manager_service(spec), manager(spec), workers(spec)]
