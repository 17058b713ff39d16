"""The JobSet of one undying job (`undying k8s --kind jobset`).

A JobSet (``jobset.x-k8s.io/v1alpha2``, the Kubernetes SIG's controller for
groups of Jobs; installed in the cluster separately) holds two replicated jobs:

- ``manager``: an indexed Job of one pod, restarted in place on failure
  (``restartPolicy: OnFailure``, like ``--manager-kind pod``);
- ``workers``: the same indexed Job as ``--kind job`` writes (one agent per
  pod, the completion index its node rank, the same ``podFailurePolicy``).

What the JobSet adds:

- The network: a headless Service named after the job, through which every
  pod has the DNS name ``<pod hostname>.<J>``; the agents find the manager at
  ``<J>-manager-0-0.<J>`` (``Spec.manager_host``), and the name stays when the
  manager's pod is replaced. Addresses are published before the pods are
  ready, so agents that start first resolve the manager and retry until it
  listens.
- The failure policy, over whole Jobs (a pod's failure stays the Job's
  business, as in ``--kind job``): a workers Job failed by its
  ``podFailurePolicy`` (an agent the manager refused, exit 2) fails the set at
  once, since a restart would be refused the same way; any other failed Job
  (an index out of retries, a manager out of restarts) restarts the whole set,
  at most ``--jobset-restarts`` times, every old pod gone before a new one
  starts (``BlockingRecreate``: never two managers, never two agents of one
  node rank). A restarted set resumes from the job's newest checkpoint.
- The success policy: the set has succeeded when the workers' Job has.

No schema of the JobSet API can be had offline (the CRD ships with the
controller): its fields follow the published v1alpha2 API reference, and
tests/unit/test_k8s.py checks them against what that reference lists.
"""

from __future__ import annotations

from typing import Any

from undying.k8s.spec import MANAGER_RJOB, WORKERS_RJOB, Spec

__all__ = ["API_VERSION", "jobset", "REFUSED_RULE", "RESTART_RULE"]

API_VERSION = "jobset.x-k8s.io/v1alpha2"
# Failure policy rule names: JobSet wants ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$
REFUSED_RULE = "AgentRefused"
RESTART_RULE = "RestartFromCheckpoint"
# The reason Kubernetes gives a Job that its podFailurePolicy failed (a FailJob rule).
_POD_FAILURE_POLICY = "PodFailurePolicy"


def jobset(spec: Spec, metadata: dict[str, Any], manager_job: dict[str, Any],
           workers_job: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The JobSet object around the two Job templates (``{"metadata", "spec"}`` each), and the
    comments that say why it is built so."""
    obj = {
        "apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata,
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": spec.job_id,
                        "publishNotReadyAddresses": True},
            "failurePolicy": {
                "maxRestarts": spec.jobset_restarts,
                "restartStrategy": "BlockingRecreate",
                "rules": [
                    {"name": REFUSED_RULE, "action": "FailJobSet",
                     "onJobFailureReasons": [_POD_FAILURE_POLICY],
                     "targetReplicatedJobs": [WORKERS_RJOB]},
                    {"name": RESTART_RULE, "action": "RestartJobSet"},
                ]},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [WORKERS_RJOB]},
            "replicatedJobs": [
                {"name": MANAGER_RJOB, "replicas": 1, "template": manager_job},
                {"name": WORKERS_RJOB, "replicas": 1, "template": workers_job},
            ],
        },
    }
    comments = [
        f"The JobSet {spec.job_id} (needs the JobSet controller, API {API_VERSION}): the manager "
        "and the workers as its two",
        f"replicated jobs. Its headless Service {spec.job_id} names every pod; the agents find "
        f"the manager at {spec.manager_host}:{spec.port}.",
        "failurePolicy: the workers' Job failed by its podFailurePolicy (exit 2, an agent the "
        "manager refused) fails the set;",
        f"any other failed Job restarts the whole set (at most {spec.jobset_restarts} times, "
        "BlockingRecreate: old pods gone first),",
        "which resumes from the newest checkpoint. successPolicy: done when the workers' Job is.",
        f"The manager: one pod, restarted in place on failure (at most {spec.node_retries} "
        "times); SIGTERM to it preempts the job.",
    ]
    if not spec.job_pvc:
        comments.append("WARNING: the job dir (/job, the SQLite event log) is an emptyDir: a "
                        "restarted set or a replaced manager pod starts a new log; pass "
                        "--job-pvc NAME to keep it.")
    return obj, comments
