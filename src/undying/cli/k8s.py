"""``undying k8s``: write the Kubernetes manifests of a multi-node job."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import sys
from pathlib import Path

from undying import __version__
from undying.config import TRACE_INITIAL
from undying.errors import UsageError
from undying.inputs import finite_arg, job_id_arg
from undying.k8s import grace as grace_mod
from undying.k8s.manifests import Manifest, build
from undying.k8s.spec import KINDS, MIN_KUBERNETES, TRACE_SWITCH_FILE, Spec
from undying.k8s.yamlout import dump, dump_all
from undying.user_files import open_user_file

__all__ = ["add_parser", "run", "spec_from_args"]

# Files a previous `undying k8s --out DIR` may have left; removed when not written again.
_KNOWN_FILES = ("00-secret.yaml", "01-trace-configmap.yaml", "02-manager-service.yaml",
                "03-manager.yaml", "04-workers.yaml", "02-jobset.yaml")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    factor, extra = f"{grace_mod.K8S_FACTOR:g}", f"{grace_mod.K8S_EXTRA_S:g}"
    p = sub.add_parser(
        "k8s",
        help="write the Kubernetes manifests of a multi-node job",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="undying k8s --job-id J --nodes N --nproc-per-node P --image IMAGE\n"
        "                   [options] -- SCRIPT [ARGS]",
        description=f"""\
Write what a cluster needs to run SCRIPT on N nodes x P ranks, as one
multi-document YAML on stdout (`| kubectl apply -f -`) or as files in --out
DIR:

  Secret <J>-token      the job's token (UNDYING_TOKEN in every pod)
  ConfigMap <J>-trace   the trace switch, mounted at
                        {TRACE_SWITCH_FILE}
  Service, Deployment <J>-manager
                        `undying manager` on ports P, P+1 (c10d store),
                        P+2 (HTTP)
  Job <J>-workers       an indexed Job: N pods, one `undying run` agent each,
                        --node-rank = the pod's completion index
With --kind jobset the last three are one JobSet <J> (the JobSet controller
must be installed): replicated jobs 'manager' and 'workers', its headless
Service <J>, a failure policy that restarts the whole set from the newest
checkpoint at most --jobset-restarts times.

Grace period. Kubernetes sends SIGTERM, then SIGKILL
terminationGracePeriodSeconds later; between the two the agent must finish its
step and write the dying-gasp checkpoint. undying k8s sizes a dying-gasp
budget G, passes it to the agents (`undying run --grace-period G`, undying's
own deadline) and sets terminationGracePeriodSeconds = ceil(G x {factor} + {extra}):
x{factor} for a slower disk or a busier node than was measured, +{extra} s for the
agent to stop its workers. G is:
  --from-job-dir DIR   measured by a previous run of the job (DIR/events.db):
                       the checkpoint's size over the slowest write speed
                       seen, x2, at least 5 s, plus two of the slowest recent
                       steps (the manager's own rule), or twice a measured
                       SIGTERM-to-exit time if larger;
  --grace-period S     S seconds;
  neither              {grace_mod.DEFAULT_GASP_S:g} s, and the manifests say it was not measured.

Write them once and keep them: each run generates a new token (or pass
--token-secret NAME). Workflow: docs/kubernetes.md.""",
    )
    req = p.add_argument_group("the job (required)")
    req.add_argument("--job-id", type=job_id_arg, required=True, metavar="J",
                     help="the job's name; it names every object, so a DNS label: lower-case "
                     "letters, digits, '-', starting with a letter, at most 55 characters")
    req.add_argument("--nodes", type=int, required=True, metavar="N",
                     help="worker pods (nodes), one agent each")
    p.add_argument("--min-nodes", type=int, default=0, metavar="MIN",
                   help="make the job elastic: it starts with MIN pods once --node-wait passed "
                   "without the rest, goes on with as few as MIN when a pod is lost and none "
                   "replaces it, and grows back as pods come (every agent gets --nnodes MIN:N; "
                   "default: exactly --nodes)")
    req.add_argument("-n", "--nproc-per-node", type=int, required=True, metavar="P",
                     help="ranks per node")
    req.add_argument("--image", required=True,
                     help="the container image: your script, its dependencies, undying (on PATH) "
                     "and sh")
    p.add_argument("--namespace", default="",
                   help="put every object in this namespace (default: kubectl's)")
    p.add_argument("--out", default="", metavar="DIR",
                   help="write one file per object into DIR (created if missing) instead of "
                   "stdout")
    p.add_argument("--kind", choices=KINDS, default="job",
                   help="job (default): a Service and a Deployment (or Pod) for the manager and an "
                   "indexed Job for the workers, Kubernetes' own kinds; jobset: one JobSet "
                   "(jobset.x-k8s.io/v1alpha2) of both, with its headless Service and failure "
                   "policy")
    p.add_argument("--jobset-restarts", type=int, default=None, metavar="N",
                   help="--kind jobset: whole-set restarts (every pod recreated, the job resumed "
                   "from its newest checkpoint) before the JobSet fails; its "
                   "failurePolicy.maxRestarts (default 2)")
    p.add_argument("--token-secret", default="", metavar="NAME",
                   help="use this existing Secret's key 'token' instead of generating one")
    g = p.add_argument_group("grace period (see above)").add_mutually_exclusive_group()
    g.add_argument("--from-job-dir", default="", metavar="DIR",
                   help="size the grace period from a previous run's measurements "
                   "(DIR/events.db)")
    g.add_argument("--grace-period", type=finite_arg("--grace-period"), default=0.0,
                   metavar="SECONDS", help="the dying-gasp budget G in seconds")
    r = p.add_argument_group("resources and storage")
    r.add_argument("--cpu", default="",
                   help="CPU per worker pod, request = limit (e.g. 8, 7500m)")
    r.add_argument("--memory", default="",
                   help="memory per worker pod, request = limit (e.g. 32Gi)")
    r.add_argument("--gpus", type=int, default=0,
                   help="nvidia.com/gpu per worker pod (default 0)")
    r.add_argument("--shm-size", default="1Gi",
                   help="/dev/shm size per worker pod, memory-backed (data loaders, NCCL; default "
                   "1Gi)")
    ck = r.add_mutually_exclusive_group()
    ck.add_argument("--checkpoint-pvc", default="", metavar="NAME",
                    help="a PersistentVolumeClaim (ReadWriteMany: every node reads it to resume) "
                    "mounted at /ckpt in every pod; checkpoints go to /ckpt/<job id>. Without it "
                    "(or --checkpoint-dir) /ckpt is an emptyDir and a dying-gasp checkpoint dies "
                    "with its pod")
    ck.add_argument("--checkpoint-dir", default="", metavar="URL",
                    help="an fsspec URL for checkpoints instead of a volume (e.g. "
                    "s3://bucket/<job id>)")
    r.add_argument("--job-pvc", default="", metavar="NAME",
                   help="a PersistentVolumeClaim for the manager's job dir (its SQLite event "
                   "log), so a rescheduled manager keeps the job's history (default: an "
                   "emptyDir)")
    m = p.add_argument_group("manager")
    m.add_argument("--manager-kind", choices=("deployment", "pod"), default="deployment",
                   help="deployment (default): rescheduled if its node is lost; pod: restarted in "
                   "place on failure, left Completed when the job ends")
    m.add_argument("--port", type=int, default=29400,
                   help="the manager's agent port; the c10d store is on port+1, the HTTP API on "
                   "port+2 (default 29400)")
    m.add_argument("--open-status", action="store_true",
                   help="`undying manager --open-status`: GET /, /api/status and /metrics "
                   "without the token (e.g. for a Prometheus scrape inside the cluster); changes "
                   "still need it")
    m.add_argument("--manager-cpu", default="500m",
                   help="the manager's CPU request (default 500m)")
    m.add_argument("--manager-memory", default="1Gi",
                   help="the manager's memory request (default 1Gi)")
    w = p.add_argument_group("workers (`undying run` flags passed to every agent)")
    w.add_argument("--node-retries", type=int, default=3,
                   help="replacement pods per node index before the Job fails "
                   "(backoffLimitPerIndex; preemptions and evictions do not count; default 3)")
    w.add_argument("--image-pull-policy", choices=("Always", "IfNotPresent", "Never"),
                   default="",
                   help="the containers' imagePullPolicy (default: Kubernetes' own)")
    w.add_argument("--backend", choices=("gloo", "nccl"), default="",
                   help="torch.distributed backend (default nccl with --gpus, else gloo)")
    w.add_argument("--trace", choices=TRACE_INITIAL, default="off",
                   help="the trace switch at start (the ConfigMap's content): off (default), on, "
                   "comm")
    w.add_argument("--save-every", type=int, default=0, metavar="STEPS",
                   help="undying run --save-every")
    w.add_argument("--save-interval", type=finite_arg("--save-interval"), default=0.0,
                   metavar="SECONDS", help="undying run --save-interval")
    w.add_argument("--keep", type=int, default=3, help="undying run --keep (default 3)")
    w.add_argument("--spares", type=int, default=1,
                   help="undying run --spares, per node (default 1)")
    w.add_argument("--max-restarts", type=int, default=3,
                   help="undying run --max-restarts (default 3)")
    w.add_argument("--run-args", default="", metavar="STRING",
                   help="more `undying run` flags for every agent, as one shell-quoted string, "
                   "e.g. --run-args='--heartbeat-timeout 60 --trace-dir /ckpt/traces'; checked "
                   "against `undying run`'s parser")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS]",
                   help="the training script and its arguments")
    p.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> Spec:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.from_job_dir:
        grace = grace_mod.from_job_dir(args.from_job_dir)
    elif args.grace_period:
        grace = grace_mod.from_seconds(args.grace_period)
    else:
        grace = grace_mod.default()
    if args.jobset_restarts is not None and args.kind != "jobset":
        raise UsageError("--jobset-restarts is for --kind jobset; add --kind jobset or drop it")
    restarts = 2 if args.jobset_restarts is None else args.jobset_restarts
    try:
        run_args = shlex.split(args.run_args)
    except ValueError as e:
        raise UsageError(f"--run-args {args.run_args!r}: {e}") from None
    return Spec(
        job_id=args.job_id, nodes=args.nodes, min_nodes=args.min_nodes,
        nproc_per_node=args.nproc_per_node, image=args.image,
        command=command, grace=grace, namespace=args.namespace, token_secret=args.token_secret,
        cpu=args.cpu, memory=args.memory, gpus=args.gpus, shm_size=args.shm_size,
        checkpoint_pvc=args.checkpoint_pvc, checkpoint_url=args.checkpoint_dir,
        job_pvc=args.job_pvc, manager_kind=args.manager_kind, open_status=args.open_status,
        port=args.port, manager_cpu=args.manager_cpu,
        manager_memory=args.manager_memory, node_retries=args.node_retries,
        image_pull_policy=args.image_pull_policy, backend=args.backend, trace=args.trace,
        save_every=args.save_every, save_interval=args.save_interval, keep=args.keep,
        spares=args.spares, max_restarts=args.max_restarts, run_args=run_args,
        kind=args.kind, jobset_restarts=restarts,
    )


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    manifests = build(spec)
    header = [f"Written by undying {__version__} (undying k8s) for job {spec.job_id}: "
              f"{spec.nodes} node(s) x {spec.nproc_per_node} rank(s), for Kubernetes "
              f"{'.'.join(map(str, MIN_KUBERNETES))} or newer. Apply with kubectl apply -f; "
              "see docs/kubernetes.md."]
    if args.out:  # refused before a word of the rest: one line
        _check_out(Path(args.out), [m.filename for m in manifests])
    if not spec.grace.measured:
        sys.stderr.write(f"undying k8s: {spec.grace.explain()}\n")
    for m in manifests:
        for line in m.comments:
            if line.startswith("WARNING"):
                sys.stderr.write(f"undying k8s: {m.obj['kind']} {m.obj['metadata']['name']}: "
                                 f"{line}\n")
    if not args.out:
        sys.stdout.write(dump_all([(m.obj, m.comments) for m in manifests], header))
        return 0
    _write_dir(Path(args.out), manifests, header)
    return 0


def _ours(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link) that `undying k8s` wrote: its first line
    is our header."""
    try:
        fd = open_user_file(path, "manifest", "", follow=False)
    except UsageError:
        return False
    with os.fdopen(fd, "rb") as f:
        first = f.readline(400)
    return first.startswith(b"# Written by undying ") and b"(undying k8s)" in first


def _check_out(out: Path, names: list[str]) -> None:
    """Refuse, before anything is written, an --out that is not a folder of ours to write: one
    line each."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        what = "a symbolic link" if out.is_symlink() else "not a folder"
        raise UsageError(f"--out {out} is {what}; pass a folder (created if missing) for the "
                         "manifests")
    for name in names:
        path = out / name
        if (path.exists() or path.is_symlink()) and not _ours(path):
            raise UsageError(f"--out {out}: {name} is there and was not written by undying k8s; "
                             "move it aside or pass another --out (nothing was written)")


def _write_atomically(path: Path, text: str, mode: int) -> None:
    """``text`` in ``path`` whole or not at all: written aside (a new file, never a link), then
    renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # (replaces a link of that name, never writes through it)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _write_dir(out: Path, manifests: list[Manifest], header: list[str]) -> None:
    _check_out(out, [m.filename for m in manifests])
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot create the folder: {e.strerror or e}") from None
    written = set()
    for m in manifests:
        path = out / m.filename
        text = "".join(f"# {h}\n" for h in header) + dump(m.obj, m.comments)
        # The Secret holds the token: readable by its owner only, like the job dir's token file.
        mode = 0o600 if m.obj["kind"] == "Secret" else 0o644
        try:
            _write_atomically(path, text, mode)
        except OSError as e:
            raise UsageError(f"--out {out}: cannot write {m.filename}: {e.strerror or e}") from None
        written.add(m.filename)
        sys.stderr.write(f"wrote {path}\n")
    for stale in sorted(set(_KNOWN_FILES) - written):
        # E.g. a generated Secret, now that --token-secret names one; never a user's file.
        if _ours(out / stale):
            (out / stale).unlink()
            sys.stderr.write(f"removed {out / stale} (not part of this job's manifests any more)\n")
