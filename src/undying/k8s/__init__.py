"""Kubernetes manifests for an undying job (`undying k8s`); see docs/kubernetes.md."""

from undying.k8s.grace import Grace, kubernetes_grace_s
from undying.k8s.manifests import Manifest, build
from undying.k8s.spec import Spec, validate_job_id

__all__ = ["Grace", "Manifest", "Spec", "build", "kubernetes_grace_s", "validate_job_id"]
