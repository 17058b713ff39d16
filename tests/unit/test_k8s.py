"""`undying k8s`: the manifests are valid Kubernetes objects and mean what undying needs.

Validity: every document is read back from the YAML text (PyYAML) and checked
against the `kubernetes` Python client's OpenAPI models twice: deserialized
into the model (required fields, and on clients >= 37 the types), and walked
key by key against each model's ``attribute_map`` (the API's wire names), so a
typo, a snake_case name or a wrong type fails whatever the client's version.
Each document (and each Job template of a JobSet) also passes the strict OpenAPI schema of every
Kubernetes version the manifests claim (kubernetes-validate's); a JobSet's own fields are checked against
JobSet's v1alpha2 API reference, no schema of it being available offline.
Meaning: the agents' command is parsed by `undying run`'s real parser after
Kubernetes' own $(VAR) expansion, the Service's ports are the manager's flags,
the grace period comes from a real event log written by EventLog.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import posixpath
import re
import stat
from pathlib import Path
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client is in the [test] extra")
yaml = pytest.importorskip("yaml")

from kubernetes import client as k8s_client  # noqa: E402

from undying.cli import k8s as k8s_cli  # noqa: E402
from undying.cli import run as run_cli  # noqa: E402
from undying.errors import UsageError  # noqa: E402
from undying.jobfiles.events import EventLog  # noqa: E402
from undying.k8s import grace as grace_mod  # noqa: E402
from undying.k8s.manifests import PRESTOP_COMMAND, build  # noqa: E402
from undying.k8s.spec import Spec, validate_job_id  # noqa: E402
from undying.k8s.yamlout import dump_all  # noqa: E402

MODELS = {
    ("v1", "Secret"): "V1Secret",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Service"): "V1Service",
    ("v1", "Pod"): "V1Pod",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("batch/v1", "Job"): "V1Job",
}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


# --- checking against the API models -----------------------------------------------------------

def model_errors(value: Any, type_name: str, path: str = "") -> list[str]:
    """Every key the API would not know and every value of the wrong type, by path."""
    m = re.fullmatch(r"(?:List\[|list\[)(.*)\]", type_name)
    if m:
        if not isinstance(value, list):
            return [f"{path}: expected a list ({type_name}), got {value!r}"]
        return [e for i, v in enumerate(value) for e in model_errors(v, m.group(1), f"{path}[{i}]")]
    m = re.fullmatch(r"(?:Dict\[str, |dict\(str, )(.*)[\])]", type_name)
    if m:
        if not isinstance(value, dict):
            return [f"{path}: expected a map ({type_name}), got {value!r}"]
        return [e for k, v in value.items() for e in model_errors(v, m.group(1), f"{path}.{k}")]
    primitive = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    if type_name in primitive:
        ok = isinstance(value, primitive[type_name]) and (type_name == "bool" or not isinstance(value, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {type(value).__name__} {value!r}"]
    if type_name == "object":  # IntOrString and the like
        return [] if isinstance(value, str | int) and not isinstance(value, bool) else [f"{path}: {value!r}"]
    klass = getattr(k8s_client, type_name)
    if not isinstance(value, dict):
        return [f"{path}: expected a {type_name} object, got {value!r}"]
    by_wire_name = {wire: attr for attr, wire in klass.attribute_map.items()}
    errors = []
    for key, item in value.items():
        if key not in by_wire_name:
            errors.append(f"{path}.{key}: {type_name} has no field {key!r}")
        else:
            errors += model_errors(item, klass.openapi_types[by_wire_name[key]], f"{path}.{key}")
    return errors


def check_document(doc: dict[str, Any]) -> Any:
    """The document as a client model; fails on anything the API server would not take as that kind."""
    type_name = MODELS[(doc["apiVersion"], doc["kind"])]
    errors = model_errors(doc, type_name, doc["kind"])
    assert not errors, "\n".join(errors)
    # The client's own deserializer: required fields (and with pydantic models, types and extras).
    obj = k8s_client.ApiClient()._ApiClient__deserialize(doc, type_name)
    assert type(obj).__name__ == type_name
    return obj


def test_the_checker_rejects_what_the_api_would() -> None:
    """The checker is not vacuous: a typo, a snake_case name, a wrong type, a missing field all fail."""
    good = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"terminationGracePeriodSeconds": 5, "containers": [{"name": "c", "image": "i"}]}}
    check_document(good)
    typo = json.loads(json.dumps(good))
    typo["spec"]["terminationGracePeriodSecond"] = typo["spec"].pop("terminationGracePeriodSeconds")
    assert any("terminationGracePeriodSecond'" in e for e in model_errors(typo, "V1Pod", "Pod"))
    snake = json.loads(json.dumps(good))
    snake["spec"]["termination_grace_period_seconds"] = snake["spec"].pop("terminationGracePeriodSeconds")
    assert model_errors(snake, "V1Pod", "Pod")
    deep = json.loads(json.dumps(good))
    deep["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"cmd": ["x"]}}}
    assert any(".lifecycle.preStop.exec.cmd" in e for e in model_errors(deep, "V1Pod", "Pod"))
    wrong_type = json.loads(json.dumps(good))
    wrong_type["spec"]["terminationGracePeriodSeconds"] = "5"
    assert model_errors(wrong_type, "V1Pod", "Pod")
    missing = json.loads(json.dumps(good))
    del missing["spec"]["containers"][0]["name"]
    with pytest.raises((ValueError, TypeError)):  # pydantic's ValidationError is a ValueError
        check_document(missing)


# --- generating ------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="undying")
    k8s_cli.add_parser(p.add_subparsers(dest="command"))
    return p


def generate(*argv: str) -> tuple[list[dict[str, Any]], str, Spec]:
    """The documents as kubectl would read them (from the YAML text), the text, and the spec."""
    args = parser().parse_args(["k8s", *argv])
    spec = k8s_cli.spec_from_args(args)
    manifests = build(spec)
    text = dump_all([(m.obj, m.comments) for m in manifests], ["header"])
    docs = list(yaml.safe_load_all(text))
    assert docs == [m.obj for m in manifests], "the YAML text does not read back as the objects"
    return docs, text, spec


BASE = ("--job-id", "llama-7b", "--nodes", "4", "--nproc-per-node", "8", "--image", "registry.example.com/train:1.2")
OPTION_SETS = {
    "minimal": (*BASE, "--", "train.py"),
    "gpus-pvc-secret-pod": (*BASE, "--gpus", "8", "--cpu", "64", "--memory", "512Gi", "--checkpoint-pvc", "ckpt",
                            "--job-pvc", "llama-job", "--token-secret", "llama-token", "--manager-kind", "pod",
                            "--namespace", "training", "--grace-period", "42.5", "--save-every", "500",
                            "--trace", "comm", "--image-pull-policy", "Always", "--port", "31000", "--open-status",
                            "--run-args", "--heartbeat-timeout 60 --trace-dir /ckpt/traces", "--min-nodes", "2",
                            "--", "train.py", "--lr", "0.1", "--nodes", "on"),
    "one-node-url": ("--job-id", "a", "--nodes", "1", "-n", "1", "--image", "x", "--checkpoint-dir",
                     "s3://bucket/a", "--save-interval", "600", "train.py"),
}


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {d["kind"]: d for d in docs}
    assert len(out) == len(docs), "one object per kind"
    return out


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    return doc["metadata"]["labels"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]["labels"]


def manager_doc(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] in ("Deployment", "Pod")]
    return doc


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's command ($$ escapes; unknown names stay)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def container_env(container: dict[str, Any], annotations: dict[str, str], secrets: dict[str, str]) -> dict[str, str]:
    """The env the kubelet would give the container, resolving the downward API and Secrets."""
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", var["valueFrom"]["fieldRef"]["fieldPath"])
            assert m, var
            env[var["name"]] = annotations[m.group(1)]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[f"{ref['name']}/{ref['key']}"]
    return env


def parse_run(argv: list[str]) -> argparse.Namespace:
    assert argv[:2] == ["undying", "run"]
    p = argparse.ArgumentParser(prog="undying")
    run_cli.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(argv[1:])


@pytest.mark.parametrize("name", OPTION_SETS)
def test_every_document_is_a_valid_kubernetes_object(name: str) -> None:
    docs, _, spec = generate(*OPTION_SETS[name])
    for doc in docs:
        check_document(doc)
        meta = doc["metadata"]
        assert _DNS_LABEL.fullmatch(meta["name"]) and len(meta["name"]) <= 63, meta["name"]
        assert meta.get("namespace", "") == spec.namespace
        for key, value in meta["labels"].items():
            assert len(value) <= 63 and _LABEL_VALUE.fullmatch(value), (key, value)
        assert meta["labels"]["app.kubernetes.io/name"] == "undying"
        assert meta["labels"]["undying/job"] == spec.job_id
        if doc["kind"] == "Service":
            assert _DNS_1035.fullmatch(meta["name"]), "a Service name must start with a letter"
        if doc["kind"] in ("Deployment", "Job", "Pod"):
            ps = pod_spec(doc)
            names = [v["name"] for v in ps["volumes"]]
            assert len(names) == len(set(names))
            for c in ps["containers"]:
                assert {m["name"] for m in c["volumeMounts"]} <= set(names), "a mount without its volume"
                for p in c.get("ports", []):
                    assert len(p["name"]) <= 15 and _DNS_LABEL.fullmatch(p["name"])
    kinds = [d["kind"] for d in docs]
    expected = ["ConfigMap", "Service", "Pod" if spec.manager_kind == "pod" else "Deployment", "Job"]
    assert kinds == (expected if spec.token_secret else ["Secret", *expected])


@pytest.mark.parametrize("name", OPTION_SETS)
def test_the_workers_are_an_indexed_job_of_one_agent_per_node(name: str) -> None:
    docs, _, spec = generate(*OPTION_SETS[name])
    job = by_kind(docs)["Job"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == spec.nodes
    ps = pod_spec(job)
    # podFailurePolicy and backoffLimitPerIndex are refused by the API server with any other policy,
    # and with podFailurePolicy the replacement policy must be Failed.
    assert ps["restartPolicy"] == "Never"
    assert job["spec"]["podReplacementPolicy"] == "Failed"
    assert job["spec"]["backoffLimitPerIndex"] == spec.node_retries
    [agent] = ps["containers"]
    actions: dict[Any, str] = {}
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == agent["name"]
            assert rule["onExitCodes"]["operator"] == "In" and 0 not in rule["onExitCodes"]["values"]
            actions.update(dict.fromkeys(rule["onExitCodes"]["values"], rule["action"]))
        else:
            actions.update({c["type"]: rule["action"] for c in rule["onPodConditions"]})
    # Refused by the manager: a new pod would be too. Preempted with a checkpoint, or evicted: a new
    # pod resumes, uncounted. 1 (the job failed, or the manager was unreachable too long) and 143
    # (SIGTERM'd by hand) count against the per-index retries.
    assert actions == {2: "FailJob", 75: "Ignore", "DisruptionTarget": "Ignore"}
    assert agent["lifecycle"]["preStop"]["exec"]["command"] == PRESTOP_COMMAND
    assert PRESTOP_COMMAND[:2] == ["sh", "-c"] and PRESTOP_COMMAND[2].startswith("kill -TERM 1;")
    assert "while kill -0 1" in PRESTOP_COMMAND[2], "the hook must wait while the agent's dying gasp runs"
    secrets = {f"{spec.secret_name}/token": "tok"}
    for index in range(spec.nodes):
        annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
        env = container_env(agent, annotations, secrets)
        argv = [expand(a, env) for a in agent["command"]]
        args = parse_run(argv)
        assert args.node_rank == index
        assert args.nnodes == (spec.min_nodes or spec.nodes, spec.nodes)  # MIN:MAX when elastic
        assert args.nproc_per_node == spec.nproc_per_node
        assert args.job_id == spec.job_id
        assert args.manager == f"{spec.job_id}-manager:{spec.port}"
        assert args.grace_period == spec.grace.gasp_s
        assert args.checkpoint_dir == spec.checkpoint_dir
        assert [args.script, *args.script_args] == spec.command
        assert env["UNDYING_TOKEN"] == "tok"


def test_script_arguments_reach_the_script_untouched() -> None:
    docs, _, spec = generate(*OPTION_SETS["gpus-pvc-secret-pod"])
    agent = pod_spec(by_kind(docs)["Job"])["containers"][0]
    env = container_env(agent, {"batch.kubernetes.io/job-completion-index": "3"}, {f"{spec.secret_name}/token": "t"})
    args = parse_run([expand(a, env) for a in agent["command"]])
    assert args.script == "train.py" and args.script_args == ["--lr", "0.1", "--nodes", "on"]
    assert args.heartbeat_timeout == 60 and args.trace_dir == "/ckpt/traces"  # --run-args passed through
    assert args.save_every == 500 and args.trace == "comm"
    limits = agent["resources"]["limits"]
    assert limits == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"}
    assert agent["resources"]["requests"] == {"cpu": "64", "memory": "512Gi"}
    assert args.backend == "nccl", "GPUs: NCCL by default"


def test_the_trace_switch_is_a_directory_mount_at_the_watched_path() -> None:
    for name, argv in OPTION_SETS.items():
        docs, _, spec = generate(*argv)
        kinds = by_kind(docs)
        cm = kinds["ConfigMap"]
        ps = pod_spec(kinds["Job"])
        [agent] = ps["containers"]
        switch_file = flag(agent["command"], "--trace-switch-file")
        [volume] = [v for v in ps["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
        [mount] = [m for m in agent["volumeMounts"] if m["name"] == volume["name"]]
        assert "subPath" not in mount, "a subPath mount never sees a kubectl edit"
        assert mount["mountPath"] == posixpath.dirname(switch_file)
        assert list(cm["data"]) == [posixpath.basename(switch_file)]
        switch = json.loads(cm["data"][posixpath.basename(switch_file)])
        want = {"off": ("off", "off"), "on": ("on", "off"), "comm": ("on", "on")}[spec.trace]
        assert (switch["step"], switch["comm"]) == want, name
        assert flag(agent["command"], "--trace") == spec.trace


def test_switch_file_content_is_read_by_the_agents_parser(tmp_path: Path) -> None:
    from undying.trace.switch import read_switch_file

    docs, _, _ = generate(*OPTION_SETS["gpus-pvc-secret-pod"])
    cm = by_kind(docs)["ConfigMap"]
    (tmp_path / "switch.json").write_text(cm["data"]["switch.json"])
    sw = read_switch_file(tmp_path / "switch.json")
    assert sw.step and sw.comm


@pytest.mark.parametrize("name", OPTION_SETS)
def test_the_token_secret_is_referenced_by_manager_and_workers(name: str) -> None:
    docs, _, spec = generate(*OPTION_SETS[name])
    kinds = by_kind(docs)
    if spec.token_secret:
        assert "Secret" not in kinds
        secret_name = spec.token_secret
    else:
        secret = kinds["Secret"]
        secret_name = secret["metadata"]["name"]
        assert len(secret["stringData"]["token"]) >= 32
    for doc in (manager_doc(docs), kinds["Job"]):
        [c] = pod_spec(doc)["containers"]
        [var] = [v for v in c["env"] if v["name"] == "UNDYING_TOKEN"]
        assert var["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": "token"}


def test_the_manager_writes_no_prometheus_target_file_in_its_pod() -> None:
    docs, _, _ = generate(*OPTION_SETS["minimal"])
    [c] = pod_spec(manager_doc(docs))["containers"]
    assert {"name": "UNDYING_PROMETHEUS_DIR", "value": "off"} in c["env"]  # (its Service is the target)


def test_each_generation_makes_a_new_token() -> None:
    a, _, _ = generate(*OPTION_SETS["minimal"])
    b, _, _ = generate(*OPTION_SETS["minimal"])
    assert by_kind(a)["Secret"]["stringData"]["token"] != by_kind(b)["Secret"]["stringData"]["token"]


@pytest.mark.parametrize("name", OPTION_SETS)
def test_the_service_exposes_the_ports_the_manager_listens_on(name: str) -> None:
    docs, _, spec = generate(*OPTION_SETS[name])
    kinds = by_kind(docs)
    mgr = manager_doc(docs)
    [c] = pod_spec(mgr)["containers"]
    argv = c["command"]
    assert argv[:2] == ["undying", "manager"]
    assert flag(argv, "--host") == "0.0.0.0", "localhost is the manager's default; a pod must listen on all"
    assert flag(argv, "--job-id") == spec.job_id
    port, http = int(flag(argv, "--port")), int(flag(argv, "--http-port"))
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert container_ports == {"agent": port, "store": port + 1, "http": http}
    svc = kinds["Service"]
    for p in svc["spec"]["ports"]:
        assert container_ports[p["targetPort"]] == p["port"], p
    assert {p["port"] for p in svc["spec"]["ports"]} == {port, port + 1, http}
    assert svc["spec"]["selector"].items() <= pod_labels(mgr).items()
    if mgr["kind"] == "Deployment":
        assert mgr["spec"]["replicas"] == 1 and mgr["spec"]["strategy"]["type"] == "Recreate"
        assert mgr["spec"]["selector"]["matchLabels"].items() <= pod_labels(mgr).items()
    # The agents point at the Service's agent port, by the Service's name.
    agent = pod_spec(kinds["Job"])["containers"][0]
    host, _, agent_port = flag(agent["command"], "--manager").partition(":")
    assert host == svc["metadata"]["name"] and int(agent_port) == port
    assert c["readinessProbe"]["tcpSocket"]["port"] in container_ports
    assert "livenessProbe" not in c, "a liveness kill is a SIGTERM, which would preempt the job"


def test_manager_command_parses_with_undying_manager() -> None:
    manager_cli = pytest.importorskip("undying.cli.manager", reason="`undying manager` has not landed yet")
    docs, _, spec = generate(*OPTION_SETS["gpus-pvc-secret-pod"])
    [c] = pod_spec(manager_doc(docs))["containers"]
    p = argparse.ArgumentParser(prog="undying")
    manager_cli.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(c["command"][1:])
    assert (args.port, args.http_port, args.host, args.job_id, args.job_dir, args.open_status) == (
        spec.port, spec.port + 2, "0.0.0.0", spec.job_id, "/job", True)
    [c] = pod_spec(manager_doc(generate(*OPTION_SETS["minimal"])[0]))["containers"]
    assert p.parse_args(c["command"][1:]).open_status is False


def test_checkpoints_on_a_pvc_or_an_empty_dir_with_a_warning() -> None:
    docs, text, spec = generate(*OPTION_SETS["gpus-pvc-secret-pod"])
    kinds = by_kind(docs)
    for doc in (kinds["Job"], kinds["Pod"]):
        ps = pod_spec(doc)
        [ckpt] = [v for v in ps["volumes"] if v["name"] == "ckpt"]
        assert ckpt == {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}}
        [mount] = [m for m in ps["containers"][0]["volumeMounts"] if m["name"] == "ckpt"]
        assert mount["mountPath"] == "/ckpt"
    assert flag(pod_spec(kinds["Job"])["containers"][0]["command"], "--checkpoint-dir") == f"/ckpt/{spec.job_id}"
    assert [v for v in pod_spec(kinds["Pod"])["volumes"] if v["name"] == "job"][0]["persistentVolumeClaim"] == {
        "claimName": "llama-job"}
    assert "WARNING" not in text

    docs, text, spec = generate(*OPTION_SETS["minimal"])
    ps = pod_spec(by_kind(docs)["Job"])
    assert [v for v in ps["volumes"] if v["name"] == "ckpt"] == [{"name": "ckpt", "emptyDir": {}}]
    assert "WARNING: checkpoints (/ckpt) are in an emptyDir" in text
    assert "WARNING: the job dir (/job, the SQLite event log) is an emptyDir" in text

    docs, text, spec = generate(*OPTION_SETS["one-node-url"])
    ps = pod_spec(by_kind(docs)["Job"])
    assert not [v for v in ps["volumes"] if v["name"] == "ckpt"]
    assert flag(ps["containers"][0]["command"], "--checkpoint-dir") == "s3://bucket/a"


# --- the grace period ------------------------------------------------------------------------

def write_log(job_dir: Path, *, preempted_s: float | None = None) -> None:
    """A real event log as the manager writes it: two saves, one failed save, commits of 2 ranks."""
    job_dir.mkdir(parents=True, exist_ok=True)
    log = EventLog(job_dir / "events.db")
    log.set_job("job_id", "llama-7b")
    log.event("checkpoint_saved", rank=0, step=10, kind="periodic", path="/c/10", blocking_s=0.2, write_s=4.0,
              bytes=400_000_000)  # 100 MB/s
    log.event("checkpoint_saved", rank=0, step=20, kind="periodic", path="/c/20", blocking_s=0.2, write_s=8.0,
              bytes=400_000_000)  # 50 MB/s: the slowest, the one that counts
    log.event("checkpoint_failed", rank=0, step=30, kind="periodic", error="disk full")
    log.set_job("last_checkpoint", {"step": 20, "kind": "periodic", "path": "/c/20", "blocking_s": 0.2,
                                    "write_s": 8.0, "bytes": 400_000_000, "t": 0.0})
    t0 = 1_000_000.0
    for rank in (0, 1):
        t = t0
        for step in range(1, 31):
            # Steps of 0.5 s, one of 2.0 s (the slowest recent step), and a 100 s gap before step 20
            # that is a recovery, not a step: step 20 is committed twice (re-run), only consecutive
            # commits count.
            t += 2.0 if step == 15 else 0.5
            log.step(rank, step, 1, t, {"loss": 1.0})
        log.step(rank, 20, 2, t + 100.0, {"loss": 1.0})
        log.step(rank, 21, 2, t + 100.5, {"loss": 1.0})
    if preempted_s is not None:
        log.set_job("preemption", {"reason": "SIGTERM", "grace_period_s": 21.0, "sigterm_to_exit_s": preempted_s,
                                   "checkpoint_step": 30, "dying_gasp_write_s": 7.5})
    log.close()


def test_grace_period_from_a_real_event_log(tmp_path: Path) -> None:
    write_log(tmp_path / "job")
    g = grace_mod.from_job_dir(tmp_path / "job")
    # 400 MB at 50 MB/s = 8 s, x2 = 16 s, plus 2 steps of 2.0 s.
    assert g.measured and g.gasp_s == pytest.approx(20.0)
    assert g.kubernetes_s == math.ceil(20.0 * 1.5 + 10) == 40
    docs, text, spec = generate(*BASE, "--from-job-dir", str(tmp_path / "job"), "--", "train.py")
    kinds = by_kind(docs)
    for doc in (kinds["Job"], kinds["Deployment"]):
        assert pod_spec(doc)["terminationGracePeriodSeconds"] == 40
    agent = pod_spec(kinds["Job"])["containers"][0]
    assert float(flag(agent["command"], "--grace-period")) == 20.0
    assert "measured in" in text and "NOT MEASURED" not in text
    assert "400000000 bytes at 50.0 MB/s" in text


def test_a_measured_dying_gasp_raises_the_budget(tmp_path: Path) -> None:
    write_log(tmp_path / "job", preempted_s=31.0)
    g = grace_mod.from_job_dir(tmp_path / "job")
    assert g.gasp_s == pytest.approx(62.0) and g.kubernetes_s == 103
    assert "took 31.000 s from SIGTERM to exit" in g.basis


def test_grace_period_flag_default_and_bad_job_dirs(tmp_path: Path) -> None:
    docs, text, _ = generate(*BASE, "--grace-period", "42.5", "--", "train.py")
    assert pod_spec(by_kind(docs)["Job"])["terminationGracePeriodSeconds"] == math.ceil(42.5 * 1.5 + 10) == 74
    docs, text, _ = generate(*OPTION_SETS["minimal"])
    assert pod_spec(by_kind(docs)["Job"])["terminationGracePeriodSeconds"] == 100
    assert "NOT MEASURED: a default of 60 s" in text
    with pytest.raises(UsageError, match="no such folder"):
        generate(*BASE, "--from-job-dir", str(tmp_path / "nope"), "--", "train.py")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="not an undying event log"):
        generate(*BASE, "--from-job-dir", str(tmp_path / "empty"), "--", "train.py")
    (tmp_path / "fresh").mkdir()
    EventLog(tmp_path / "fresh" / "events.db").close()  # a job that never wrote a checkpoint
    with pytest.raises(UsageError, match="no checkpoint write and no dying gasp"):
        generate(*BASE, "--from-job-dir", str(tmp_path / "fresh"), "--", "train.py")
    with pytest.raises(UsageError, match="grace-period"):
        generate(*BASE, "--grace-period", "-3", "--", "train.py")
    with pytest.raises(SystemExit):  # argparse: the two are exclusive
        parser().parse_args(["k8s", *BASE, "--grace-period", "3", "--from-job-dir", "x", "t.py"])


# --- input validation ------------------------------------------------------------------------

@pytest.mark.parametrize(("job_id", "message"), [
    ("", "empty"),
    ("My-Job", "upper-case letters; Kubernetes names are lower case: 'my-job'"),
    ("my_job", "contains '_'"),
    ("my.job", "contains '.'"),
    ("job-é", "contains 'é'"),
    ("1job", "must start with a letter"),
    ("job-", "must end with a letter or digit"),
    ("j" * 56, "56 characters; at most 55"),
])
def test_bad_job_ids_are_refused_with_the_reason(job_id: str, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        validate_job_id(job_id)


def test_good_job_ids_pass() -> None:
    for job_id in ("a", "llama-7b", "job-20261123-101010-abc123", "j" * 55):
        validate_job_id(job_id)


@pytest.mark.parametrize(("argv", "message"), [
    (("--nodes", "0"), "--nodes must be at least 1"),
    (("--nproc-per-node", "0"), "--nproc-per-node must be at least 1"),
    (("--min-nodes", "5"), "--min-nodes must be between 1 and --nodes (4), got 5"),
    (("--image", "a b"), "--image must be an image reference"),
    (("--memory", "lots"), "'lots' is not a Kubernetes quantity"),
    (("--gpus", "2"), "needs a GPU per rank: --gpus 2 for --nproc-per-node 8"),
    (("--namespace", "Prod"), "--namespace 'Prod' is not a valid Kubernetes name"),
    (("--checkpoint-pvc", "my_pvc"), "--checkpoint-pvc 'my_pvc' is not a valid Kubernetes name"),
    (("--port", "65535"), "--port must be 1..65533"),
    (("--run-args", "--nnodes 3"), "--run-args: --nnodes is set by undying k8s itself"),
    (("--run-args", "--save-ev 3"), "--run-args: --save-ev is set by undying k8s itself"),
    (("--run-args", "--no-such-flag 1"), "would be refused by `undying run`: unrecognized arguments: --no-such-flag"),
    (("--run-args", "--heartbeat-timeout 'x"), "No closing quotation"),
])
def test_bad_options_are_refused_by_name(argv: tuple[str, ...], message: str) -> None:
    base = dict(zip(BASE[::2], BASE[1::2], strict=True))
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    flat = [x for kv in base.items() for x in kv]
    with pytest.raises(UsageError, match=re.escape(message)):
        generate(*flat, "--", "train.py")


def test_no_script_is_refused() -> None:
    with pytest.raises(UsageError, match="no training script"):
        generate(*BASE)
    with pytest.raises(UsageError, match="no training script"):
        generate(*BASE, "--")


# --- the command -----------------------------------------------------------------------------

def test_out_dir_writes_one_file_per_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "manifests"
    args = parser().parse_args(["k8s", *BASE, "--out", str(out), "--", "train.py"])
    assert args.func(args) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["00-secret.yaml", "01-trace-configmap.yaml", "02-manager-service.yaml", "03-manager.yaml",
                     "04-workers.yaml"]
    assert stat.S_IMODE(os.stat(out / "00-secret.yaml").st_mode) == 0o600
    for name in files:
        [doc] = list(yaml.safe_load_all((out / name).read_text()))
        check_document(doc)
    assert capsys.readouterr().out == "", "--out writes nothing to stdout"
    # Again with an existing Secret: the generated one is removed, so `kubectl apply -f DIR` cannot apply it.
    args = parser().parse_args(["k8s", *BASE, "--out", str(out), "--token-secret", "mine", "--", "train.py"])
    assert args.func(args) == 0
    assert not (out / "00-secret.yaml").exists()
    assert "removed" in capsys.readouterr().err


def test_stdout_is_one_multi_document_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["k8s", *BASE, "--", "train.py", "--epochs", "3"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    docs = list(yaml.safe_load_all(captured.out))
    assert [d["kind"] for d in docs] == ["Secret", "ConfigMap", "Service", "Deployment", "Job"]
    for doc in docs:
        check_document(doc)
    assert "NOT MEASURED" in captured.err and "emptyDir" in captured.err


def test_help_explains_the_grace_period(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["k8s", "--help"])
    text = capsys.readouterr().out
    assert "terminationGracePeriodSeconds = ceil(G x 1.5 + 10)" in text
    assert "--from-job-dir" in text and "--grace-period" in text


# --- every manifest against the OpenAPI schemas of each Kubernetes version it claims -----------
#
# kubernetes-validate ships the JSON schemas that Kubernetes' own OpenAPI documents give, one set per
# minor version ("strict": no field the API does not define). The manifests claim Kubernetes
# MIN_KUBERNETES (1.29) or newer, so each is checked against every version from 1.29 to the newest
# that the installed package ships. What a schema cannot tell: whether a field's feature gate is on
# (1.28's schema already has backoffLimitPerIndex and podReplacementPolicy, alpha and off there), and
# what only the API server's validation refuses (names, cross-field rules). A JobSet has no schema
# offline: its Job templates are checked here as Jobs, its own fields below against JobSet's reference.

def _schema_versions() -> list[str]:
    """The claimed versions the installed kubernetes-validate has schemas for, oldest first."""
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        return []
    from importlib.resources import files

    from undying.k8s.spec import MIN_KUBERNETES

    root = files("kubernetes_validate") / "kubernetes-json-schema"
    found = {tuple(int(x) for x in m.group(1, 2))
             for d in root.iterdir() if (m := re.fullmatch(r"v(\d+)\.(\d+)\.0-local-strict", d.name))}
    return [f"{a}.{b}" for a, b in sorted(found) if (a, b) >= MIN_KUBERNETES]


SCHEMA_VERSIONS = _schema_versions()
_validators: dict[tuple[str, str], Any] = {}


def schema_errors(doc: dict[str, Any], version: str) -> list[str]:
    """Every way DOC breaks Kubernetes VERSION's strict OpenAPI schema for its kind, by path."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the [test] extra")
    from importlib.resources import files

    import jsonschema
    from referencing import Registry, Resource

    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])  # apps/v1 -> apps-v1
    key = (version, f"{doc['kind'].lower()}-{group}")
    if key not in _validators:
        folder = files(kv.__name__) / "kubernetes-json-schema" / f"v{version}.0-local-strict"
        schema = json.loads((folder / f"{key[1]}.json").read_text())
        if (version, "") not in _validators:  # the definitions, ~1 MB, read once per version
            _validators[version, ""] = Resource.from_contents(
                json.loads((folder / "_definitions.json").read_text()))
        registry = Resource.from_contents(schema) @ (_validators[version, ""] @ Registry())
        _validators[key] = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{doc['kind']}.{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in _validators[key].iter_errors(doc)]


def as_jobs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """DOC, or for a JobSet the Jobs its controller makes of its templates (<J>-<name>-0)."""
    if doc["kind"] != "JobSet":
        return [doc]
    return [{"apiVersion": "batch/v1", "kind": "Job",
             "metadata": {"name": f"{doc['metadata']['name']}-{r['name']}-0", **r["template"]["metadata"]},
             "spec": r["template"]["spec"]} for r in doc["spec"]["replicatedJobs"]]


def test_the_claimed_versions_have_schemas() -> None:
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the [test] extra")
    assert SCHEMA_VERSIONS[:1] == ["1.29"], "no schema of the oldest claimed version: nothing is checked"
    assert len(SCHEMA_VERSIONS) >= 9, SCHEMA_VERSIONS  # 1.29 .. 1.37 at least (the [test] extra asks for >= 1.37)


def test_the_schema_check_rejects_what_the_api_would() -> None:
    """Not vacuous: a typo, a wrong type, a missing required field, a bad enum fail in every version."""
    docs, _, _ = generate(*OPTION_SETS["minimal"])
    job = by_kind(docs)["Job"]
    for version in (SCHEMA_VERSIONS[0], SCHEMA_VERSIONS[-1]) if SCHEMA_VERSIONS else ():
        assert schema_errors(job, version) == []
        typo = json.loads(json.dumps(job))
        typo["spec"]["podReplacementPolicys"] = typo["spec"].pop("podReplacementPolicy")
        assert any("podReplacementPolicys" in e for e in schema_errors(typo, version))
        wrong = json.loads(json.dumps(job))
        wrong["spec"]["backoffLimitPerIndex"] = "3"
        assert any("spec.backoffLimitPerIndex" in e for e in schema_errors(wrong, version))
        missing = json.loads(json.dumps(job))
        del missing["spec"]["template"]["spec"]["containers"][0]["name"]
        assert any("'name' is a required property" in e for e in schema_errors(missing, version))
        deep = json.loads(json.dumps(job))
        deep["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["cmd"] = ["x"]
        assert any("preStop.exec" in e for e in schema_errors(deep, version))


@pytest.mark.parametrize("version", SCHEMA_VERSIONS or [pytest.param("none", marks=pytest.mark.skip(
    reason="kubernetes-validate is not installed (the [test] extra)"))])
def test_every_manifest_passes_the_schema_of_each_claimed_version(version: str) -> None:
    checked = set()
    for argv in [*OPTION_SETS.values(), *JOBSET_SETS.values()]:
        docs, _, _ = generate(*argv)
        for doc in docs:
            for obj in as_jobs(doc):
                assert schema_errors(obj, version) == [], f"Kubernetes {version}"
                checked.add(obj["metadata"]["name"])
    assert {"llama-7b-workers", "llama-7b-manager", "llama-7b-manager-0", "llama-7b-workers-0"} <= checked


# --- --kind jobset ---------------------------------------------------------------------------------

JOBSET_SETS = {
    "jobset": (*BASE, "--kind", "jobset", "--", "train.py"),
    "jobset-all": (*BASE, "--kind", "jobset", "--jobset-restarts", "5", "--gpus", "8", "--checkpoint-pvc", "ckpt",
                   "--job-pvc", "llama-job", "--token-secret", "llama-token", "--namespace", "training",
                   "--min-nodes", "2", "--grace-period", "30", "--", "train.py", "--lr", "0.1"),
}
# JobSet's v1alpha2 API reference (jobset.x-k8s.io): the fields of each type and their types, the
# required ones and the enumerations, as far as these manifests use them. No schema of it exists offline
# (the CRD ships with the controller), so this is the check; other types go to the kubernetes client's models.
JOBSET_TYPES: dict[str, dict[str, str]] = {
    "JobSet": {"apiVersion": "str", "kind": "str", "metadata": "V1ObjectMeta", "spec": "JobSetSpec"},
    "JobSetSpec": {"replicatedJobs": "list[ReplicatedJob]", "network": "Network", "successPolicy": "SuccessPolicy",
                   "failurePolicy": "FailurePolicy", "startupPolicy": "StartupPolicy", "suspend": "bool",
                   "coordinator": "Coordinator", "managedBy": "str", "ttlSecondsAfterFinished": "int"},
    "ReplicatedJob": {"name": "str", "groupName": "str", "template": "V1JobTemplateSpec", "replicas": "int",
                      "dependsOn": "list[DependsOn]"},
    "Network": {"enableDNSHostnames": "bool", "subdomain": "str", "publishNotReadyAddresses": "bool"},
    "FailurePolicy": {"maxRestarts": "int", "restartStrategy": "str", "rules": "list[FailurePolicyRule]"},
    "FailurePolicyRule": {"name": "str", "action": "str", "onJobFailureReasons": "list[str]",
                          "onJobFailureMessagePatterns": "list[str]", "targetReplicatedJobs": "list[str]"},
    "SuccessPolicy": {"operator": "str", "targetReplicatedJobs": "list[str]"},
}
JOBSET_REQUIRED = {"ReplicatedJob": {"name", "template"}, "FailurePolicyRule": {"name", "action"},
                   "SuccessPolicy": {"operator"}}
JOBSET_ENUMS = {
    ("FailurePolicyRule", "action"): {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts",
                                      "RestartJob", "RestartJobAndIgnoreMaxRestarts"},
    ("FailurePolicy", "restartStrategy"): {"Recreate", "BlockingRecreate", "InPlaceRestart"},
    ("SuccessPolicy", "operator"): {"All", "Any"},
}
# The reasons Kubernetes gives a failed Job (its Failed condition), which onJobFailureReasons match.
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}
_RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")


def jobset_errors(value: Any, type_name: str = "JobSet", path: str = "JobSet") -> list[str]:
    """Every field of VALUE that JobSet's reference does not define or types otherwise, by path."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        return [e for i, v in enumerate(value) for e in jobset_errors(v, type_name[5:-1], f"{path}[{i}]")]
    if type_name not in JOBSET_TYPES:  # a Kubernetes type, or a primitive
        return model_errors(value, type_name, path)
    if not isinstance(value, dict):
        return [f"{path}: expected a {type_name}, got {value!r}"]
    fields = JOBSET_TYPES[type_name]
    errors = [f"{path}: {type_name} needs {sorted(JOBSET_REQUIRED.get(type_name, set()) - set(value))}"
              ] if JOBSET_REQUIRED.get(type_name, set()) - set(value) else []
    for key, item in value.items():
        if key not in fields:
            errors.append(f"{path}.{key}: {type_name} has no field {key!r}")
            continue
        errors += jobset_errors(item, fields[key], f"{path}.{key}")
        allowed = JOBSET_ENUMS.get((type_name, key))
        if allowed and item not in allowed:
            errors.append(f"{path}.{key}: {item!r} is none of {sorted(allowed)}")
    return errors


def jobset_webhook_errors(js: dict[str, Any]) -> list[str]:
    """What JobSet's admission webhook refuses that the field types do not say."""
    spec, name = js["spec"], js["metadata"]["name"]
    rjobs = [r["name"] for r in spec["replicatedJobs"]]
    errors = []
    subdomain = spec.get("network", {}).get("subdomain", name)
    if not (_DNS_1035.fullmatch(subdomain) and len(subdomain) <= 63):
        errors.append(f"network.subdomain {subdomain!r} is no DNS-1035 label")
    for r in spec["replicatedJobs"]:
        job_spec = r["template"]["spec"]
        last_job = f"{name}-{r['name']}-{r['replicas'] - 1}"
        last_pod = f"{last_job}-{job_spec['completions'] - 1}-abcde"  # + the pod's 5-character suffix
        for generated in (last_job, last_pod):
            if not (_DNS_1035.fullmatch(generated) and len(generated) <= 63):
                errors.append(f"generated name {generated!r} is no DNS-1035 label of at most 63")
    for target in spec.get("successPolicy", {}).get("targetReplicatedJobs", []):
        if target not in rjobs:
            errors.append(f"successPolicy names {target!r}, no replicated job")
    rules = spec.get("failurePolicy", {}).get("rules", [])
    if len({r["name"] for r in rules}) != len(rules):
        errors.append("failurePolicy rule names repeat")
    for rule in rules:
        if not _RULE_NAME.fullmatch(rule["name"]):
            errors.append(f"failurePolicy rule name {rule['name']!r}")
        errors += [f"rule {rule['name']}: no Job fails for {reason!r}"
                   for reason in rule.get("onJobFailureReasons", []) if reason not in JOB_FAILURE_REASONS]
        errors += [f"rule {rule['name']}: {t!r} is no replicated job"
                   for t in rule.get("targetReplicatedJobs", []) if t not in rjobs]
    return errors


def test_the_jobset_checker_rejects_what_the_reference_would() -> None:
    docs, _, _ = generate(*JOBSET_SETS["jobset"])
    js = by_kind(docs)["JobSet"]
    assert jobset_errors(js) == [] and jobset_webhook_errors(js) == []
    bad = json.loads(json.dumps(js))
    bad["spec"]["failurePolicy"]["maxRestart"] = 3  # a typo
    bad["spec"]["failurePolicy"]["rules"][0]["action"] = "FailJobset"  # no such action
    bad["spec"]["network"]["enableDNSHostnames"] = "true"  # a string for a bool
    bad["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    del bad["spec"]["successPolicy"]["operator"]
    errors = "\n".join(jobset_errors(bad))
    for part in ("failurePolicy.maxRestart:", "'FailJobset' is none of", "enableDNSHostnames: expected bool",
                 "template.spec.template.spec.restartPolicyy", "SuccessPolicy needs ['operator']"):
        assert part in errors, (part, errors)
    hook = json.loads(json.dumps(js))
    hook["metadata"]["name"] = "x" * 50
    hook["spec"]["failurePolicy"]["rules"][0]["name"] = "agent-refused"
    hook["spec"]["failurePolicy"]["rules"][0]["onJobFailureReasons"] = ["ExitCode2"]
    hook["spec"]["successPolicy"]["targetReplicatedJobs"] = ["worker"]
    assert len(jobset_webhook_errors(hook)) == 5, jobset_webhook_errors(hook)  # 2 names, the rule's name and reason, the target


@pytest.mark.parametrize("name", JOBSET_SETS)
def test_the_jobset_follows_its_reference_and_its_jobs_are_valid(name: str) -> None:
    docs, _, spec = generate(*JOBSET_SETS[name])
    assert [d["kind"] for d in docs] == ([] if spec.token_secret else ["Secret"]) + ["ConfigMap", "JobSet"]
    js = by_kind(docs)["JobSet"]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert js["metadata"]["name"] == spec.job_id and js["metadata"].get("namespace", "") == spec.namespace
    assert jobset_errors(js) == []
    assert jobset_webhook_errors(js) == []
    for job in as_jobs(js):
        check_document(job)  # the kubernetes client's models, as for --kind job
        assert job["spec"]["completionMode"] == "Indexed", "JobSet names pods by their completion index"
    for doc in docs[:-1]:
        check_document(doc)


@pytest.mark.parametrize("name", JOBSET_SETS)
def test_the_jobset_failure_policy_restarts_and_the_agents_find_the_manager(name: str) -> None:
    docs, _, spec = generate(*JOBSET_SETS[name])
    js = by_kind(docs)["JobSet"]["spec"]
    manager, workers = (r["template"] for r in js["replicatedJobs"])
    assert [(r["name"], r["replicas"]) for r in js["replicatedJobs"]] == [("manager", 1), ("workers", 1)]
    # The headless Service: every pod is <J>-<replicated job>-<job index>-<pod index>.<subdomain>.
    assert js["network"] == {"enableDNSHostnames": True, "subdomain": spec.job_id, "publishNotReadyAddresses": True}
    manager_pod = f"{spec.job_id}-manager-0-0.{js['network']['subdomain']}"
    [container] = manager["spec"]["template"]["spec"]["containers"]
    assert {"name": "agent", "containerPort": spec.port} in container["ports"]
    assert manager["spec"]["completions"] == manager["spec"]["parallelism"] == 1
    assert manager["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert manager["spec"]["backoffLimit"] == spec.node_retries
    [agent] = workers["spec"]["template"]["spec"]["containers"]
    for index in range(spec.nodes):
        env = container_env(agent, {"batch.kubernetes.io/job-completion-index": str(index)},
                            {f"{spec.secret_name}/token": "tok"})
        args = parse_run([expand(a, env) for a in agent["command"]])
        assert args.manager == f"{manager_pod}:{spec.port}" and args.node_rank == index
    # The workers are --kind job's workers, but for the manager's address.
    argv = list(JOBSET_SETS[name])
    del argv[argv.index("--kind"):argv.index("--kind") + 2]
    if "--jobset-restarts" in argv:
        del argv[argv.index("--jobset-restarts"):argv.index("--jobset-restarts") + 2]
    plain = by_kind(generate(*argv)[0])["Job"]["spec"]
    text = json.dumps(workers["spec"]).replace(manager_pod, f"{spec.job_id}-manager")
    assert json.loads(text) == plain
    # Restarts: an agent the manager refused (exit 2, the workers' podFailurePolicy's only FailJob, so
    # the only way to the reason PodFailurePolicy) fails the set; any other failed Job restarts it
    # whole, at most --jobset-restarts times, old pods gone first; done when the workers are.
    exits = {v for r in workers["spec"]["podFailurePolicy"]["rules"] if r["action"] == "FailJob"
             for v in r["onExitCodes"]["values"]}
    assert exits == {2}
    policy = js["failurePolicy"]
    assert policy["maxRestarts"] == (5 if name == "jobset-all" else 2)
    assert policy["restartStrategy"] == "BlockingRecreate"
    first, last = policy["rules"]
    assert (first["action"], first["onJobFailureReasons"], first["targetReplicatedJobs"]) == (
        "FailJobSet", ["PodFailurePolicy"], ["workers"])
    assert last["action"] == "RestartJobSet" and set(last) == {"name", "action"}, "the rest: any reason, any job"
    assert js["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["workers"]}


@pytest.mark.parametrize(("argv", "message"), [
    (("--jobset-restarts", "3"), "--jobset-restarts is for --kind jobset"),
    (("--kind", "jobset", "--manager-kind", "pod"), "--manager-kind is for --kind job"),
    (("--kind", "jobset", "--jobset-restarts", "-1"), "--jobset-restarts must be 0 or more, got -1"),
    (("--kind", "jobset", "--job-id", "a" * 46), "is too long for --kind jobset with 4 nodes"),
    (("--kind", "jobset", "--job-id", "a" * 45, "--nodes", "11"), "use at most 44 characters"),
])
def test_bad_jobset_options_are_refused_by_name(argv: tuple[str, ...], message: str) -> None:
    test_bad_options_are_refused_by_name(argv, message)


def test_the_longest_jobset_job_id_is_taken() -> None:
    docs, _, _ = generate(*BASE[2:], "--job-id", "a" * 45, "--kind", "jobset", "--", "train.py")
    assert jobset_webhook_errors(by_kind(docs)["JobSet"]) == []


def test_out_dir_switches_between_kinds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "manifests"
    for kind, files in (("job", ["00-secret.yaml", "01-trace-configmap.yaml", "02-manager-service.yaml",
                                 "03-manager.yaml", "04-workers.yaml"]),
                        ("jobset", ["00-secret.yaml", "01-trace-configmap.yaml", "02-jobset.yaml"])):
        args = parser().parse_args(["k8s", *BASE, "--kind", kind, "--out", str(out), "--", "train.py"])
        assert args.func(args) == 0
        assert sorted(p.name for p in out.iterdir()) == files, "the other kind's files are removed"
    header = (out / "02-jobset.yaml").read_text().splitlines()[0]
    assert "for Kubernetes 1.29 or newer" in header
    assert "removed" in capsys.readouterr().err
