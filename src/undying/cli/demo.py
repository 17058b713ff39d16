"""``undying demo``: the same seeded job twice, without and with a fault, compared.

The front door of the project. With ``--json`` it prints exactly one JSON
object on stdout (logs go to stderr):

    {"fault", "identical", "steps", "lost_steps", "incidents": [{"kind", "rank",
     "action", "mttr_s", "phases": {...}}], ...}

and exits 0 only when every per-step loss is identical and nothing was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from undying.cli.client import api_get, api_post
from undying.config import EXIT_PREEMPTED
from undying.demo import TRAIN_SCRIPT, node_loss, shrink
from undying.demo.oracle import RunRecord, compare_runs, load_run, merge_runs
from undying.errors import UsageError
from undying.jobfiles.events import LogReader
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.tokens import find_token
from undying.protocol.env import DEMO_QUIET_ENV

__all__ = ["add_parser", "FAULTS", "run_job", "run_preempted", "load_preempted"]

RANKS = 4


@dataclass(frozen=True)
class FaultPlan:
    """How the demo injects one kind of fault into the seeded job."""

    kind: str
    rank: int
    at_step: int
    phase: str
    description: str = ""
    run_args: tuple[str, ...] = ()  # what `undying run` needs for this fault
    how: str | None = None  # for hang: stop, spin or block
    factor: float | None = None  # for slow: how much longer the rank's steps take
    expect: str = ""  # the incident kind the fault must produce (default: its own kind)
    script_args: tuple[str, ...] = ()  # what the demo script needs for this fault, in both runs

    @property
    def incident_kind(self) -> str:
        return self.expect or self.kind


# at_step counts from the step the job is at once it runs with a warm spare.
FAULTS: dict[str, FaultPlan] = {
    "crash": FaultPlan("crash", rank=2, at_step=10, phase="backward",
                       description="SIGKILL of rank 2 during a step's gradient all-reduce"),
    "comm-error": FaultPlan("comm-error", rank=1, at_step=10, phase="backward",
                            description="rank 1's connections broken during a step's gradient "
                            "all-reduce"),
    "hang": FaultPlan("hang", rank=3, at_step=10, phase="forward",
                      description="SIGSTOP of rank 3 in a step's forward pass (heartbeat timeout "
                      "3 s)",
                      run_args=("--heartbeat-timeout", "3")),
    "slow": FaultPlan("slow", rank=2, at_step=10, phase="compute", factor=1.5, expect="slow_rank",
                      description="rank 2's compute 1.5x slower from step 10, tracing on (found "
                      "as a slow rank; the job trains on)", run_args=("--trace", "on")),
    "nan": FaultPlan("nan", rank=1, at_step=10, phase="backward", how="once", expect="numeric",
                     description="a NaN in rank 1's gradient before the all-reduce, once (numeric "
                     "checks on: the step is replayed in place)",
                     script_args=("--numerics", "skip")),
    "bitflip": FaultPlan("bitflip", rank=3, at_step=10, phase="backward", how="grad",
                         expect="numeric",
                         description="one exponent bit of rank 3's gradient flipped before the "
                         "all-reduce, once (numeric checks on: the step is replayed in place)",
                         script_args=("--numerics", "skip")),
    "migrate": FaultPlan("migrate", rank=1, at_step=5, phase="step", expect="migration",
                         description="`undying migrate --rank 1` while training: rank 1 leaves at "
                         "a step boundary for a warm spare, which takes the state from a peer (a "
                         "planned move)",
                         run_args=("--spares", "1")),
    "preempt": FaultPlan("preempt", rank=-1, at_step=10, phase="step",
                         description="SIGTERM to the launcher mid-run (a preemption): dying gasp, "
                         "exit, the same command again resumes"),
    "node-loss": FaultPlan("node-loss", rank=node_loss.LOST_RANKS[0],
                           at_step=node_loss.LOSE_AT_STEP, phase="step",
                           description=f"{node_loss.NNODES} nodes x {node_loss.NPROC_PER_NODE} "
                           f"ranks on network-namespace hosts; node {node_loss.LOST_NODE}'s host "
                           "lost mid-run (every process on it SIGKILLed), a new host joins in its "
                           "place"),
    "shrink": FaultPlan("node-loss", rank=2, at_step=shrink.LOSE_AT_STEP, phase="step",
                        description="invariant mode (--virtual-ranks 4), 2 nodes x 2 ranks on "
                        "network-namespace hosts; node 1's host lost, the job shrinks to 2 ranks, "
                        "then a new host joins and it grows back to 4"),
}

# The seeded job: 4 ranks, 128 steps an epoch.
JOB_ARGS = ["--samples", "8192"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run a seeded 4-rank job without and with a fault and compare",
        description="Run a small seeded 4-rank CPU job twice, without and with a fault, and print "
        "the incidents, the recovery-time breakdown and whether every per-step loss is "
        "identical. Exit 0 only when identical and no step was lost.",
    )
    p.add_argument("--fault", default="crash",
                   help=f"the fault to inject: {', '.join(FAULTS)} (default crash)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--epochs", type=int, default=3,
                   help="epochs of the seeded job (128 steps each; default 3)")
    p.add_argument("--keep", action="store_true",
                   help="keep the two job dirs (their paths are printed)")
    p.set_defaults(func=run)


def _run_argv(job_dir: Path, ranks: int, extra_run_args: list[str] | None, script: Path,
              script_args: list[str], verbose: bool = False) -> list[str]:
    return [
        sys.executable, "-m", "undying", *(["-v"] if verbose else []), "run", "-n", str(ranks),
        "--port", "0",
        "--job-dir", str(job_dir), "--job-id", job_dir.name, "--stop-grace", "3",
        *(extra_run_args or []), str(script), *script_args,
    ]


def run_preempted(job_dir: Path, script_args: list[str], *, at_step: int, ranks: int = RANKS,
                  timeout_s: float = 120.0, extra_run_args: list[str] | None = None,
                  script: Path = TRAIN_SCRIPT) -> tuple[int, float]:
    """Run ``undying run`` and send its launcher SIGTERM once the job reached ``at_step``.

    Returns the launcher's exit code and when SIGTERM was sent (unix time).
    """
    argv = _run_argv(job_dir, ranks, extra_run_args, script, script_args)
    deadline = time.monotonic() + timeout_s
    with open(job_dir.parent / f"{job_dir.name}.preempted.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the job ended ({process.returncode}) before it reached "
                                       f"step {at_step}")
                info = JobDir(job_dir).read_manager()
                if info is not None:
                    try:
                        status = api_get(info["url"], "/api/status",
                                         token=find_token(job_dir, None))
                        if status["step"] >= at_step:
                            break
                    except Exception:  # the API is starting or stopping
                        pass
                time.sleep(0.02)
            sigterm_t = time.time()
            os.kill(process.pid, signal.SIGTERM)
            return process.wait(timeout=max(1.0, deadline - time.monotonic())), sigterm_t
        except BaseException:
            process.kill()
            process.wait()
            raise


def load_preempted(job_dir: Path, sigterm_t: float) -> tuple[RunRecord, dict[str, Any]]:
    """The two launches of a preempted-then-resumed job as one record, and the preempt incident.

    The incident's ``mttr_s`` runs from SIGTERM to the first step completed by
    every rank in the resumed launch; its phases add the relaunch and the restore.
    """
    older = sorted(job_dir.glob("events.*.db"), key=lambda p: p.stat().st_mtime)
    if not older:
        raise RuntimeError(f"{job_dir} holds one launch only: the job was not relaunched")
    first, second = load_run(older[-1]), load_run(job_dir / "events.db")
    merged = merge_runs(first, second)
    preempts = [i for i in first.incidents if i["kind"] == "preempt"]
    incident: dict[str, Any] = dict(preempts[-1]) if preempts else {
        "kind": "preempt", "rank": -1, "step": 0, "action": "dump", "status": "failed",
        "phases": {}, "detail": {}, "mttr_s": None, "fault_t": sigterm_t,
    }
    with LogReader(job_dir / "events.db") as reader:
        started = reader.job().get("started_at")
        restored = max((e.t for e in reader.events("state_restored")), default=None)
        resumed = next(iter(reader.events("resumed")), None)
        firsts = reader.first_commit_times()
    phases = {k: v for k, v in incident["phases"].items()}
    if started is not None:
        phases["relaunched"] = round(float(started) - sigterm_t, 4)
    if restored is not None:
        phases["state_restored"] = round(restored - sigterm_t, 4)
    resumed_ok = resumed is not None and len(firsts) == len(second.digests or firsts)
    if firsts:
        phases["first_step_done"] = round(max(firsts.values()) - sigterm_t, 4)
    incident["phases"] = phases
    incident["mttr_s"] = phases.get("first_step_done")
    recovered = resumed_ok and incident["status"] == "dumped"
    incident["status"] = "recovered" if recovered else incident["status"]
    incident["detail"] = {**incident.get("detail", {}),
                          "resumed_from": resumed.data if resumed is not None else None}
    return merged, incident


def run_job(job_dir: Path, script_args: list[str], *, ranks: int = RANKS,
            fault: FaultPlan | None = None, faults: Sequence[FaultPlan] = (),
            timeout_s: float = 120.0, extra_run_args: list[str] | None = None,
            log_file: Path | None = None,
            script: Path = TRAIN_SCRIPT, when_warm: bool = False, verbose: bool = False) -> int:
    """Run ``undying run`` on the demo script to its end; arm the faults once the manager is up.

    With ``when_warm`` the faults wait until the job runs with a warm spare, and
    their ``at_step`` counts from the step the job is at then; with ``verbose``, ``undying -v
    run``.
    """
    planned = [*([fault] if fault is not None else []), *faults]
    argv = _run_argv(job_dir, ranks, extra_run_args, script, script_args, verbose)
    log_path = log_file or job_dir.parent / f"{job_dir.name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            if planned:
                _inject_when_up(JobDir(job_dir), process, planned,
                                deadline=time.monotonic() + timeout_s, when_warm=when_warm)
            return process.wait(timeout=timeout_s)
        except BaseException:
            process.kill()
            process.wait()
            raise


def _inject_when_up(job_dir: JobDir, process: subprocess.Popen[bytes], faults: list[FaultPlan],
                    deadline: float, when_warm: bool) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the job exited ({process.returncode}) before the fault could be "
                               "injected")
        info = job_dir.read_manager()
        if info is not None:
            offset = 0
            if when_warm:
                status = api_get(info["url"], "/api/status",
                                 token=find_token(job_dir.path, None))
                if status["state"] != "running" or status["spares_ready"] < 1:
                    time.sleep(0.05)
                    continue
                offset = status["step"]
            token = find_token(job_dir.path, None)
            for fault in faults:
                # A planned move, once the job measured its steps: manager.placement.migration.
                if fault.kind == "migrate":
                    until = fault.at_step + offset
                    while api_get(info["url"], "/api/status", token=token)["step"] < until:
                        time.sleep(0.02)
                    api_post(info["url"], "/api/migrate", {"rank": fault.rank}, token=token)
                    continue
                body = {"kind": fault.kind, "rank": fault.rank, "at_step": fault.at_step + offset,
                        "phase": fault.phase, "how": fault.how, "factor": fault.factor}
                api_post(info["url"], "/api/inject", body, token=token)
            return
        time.sleep(0.05)
    raise RuntimeError("the job's manager did not come up in time")


def run(args: argparse.Namespace) -> int:
    if args.fault not in FAULTS:
        raise UsageError(f"unknown fault {args.fault!r}; choose one of {', '.join(FAULTS)}")
    if args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    fault = FAULTS[args.fault]
    if fault.kind == "node-loss" and (why := node_loss.unavailable_reason()) is not None:
        refuse = shrink.refuse if args.fault == "shrink" else node_loss.refuse
        return refuse(why, as_json=args.json)
    console = Console(stderr=True)
    root = Path(tempfile.mkdtemp(prefix="undying-demo-"))
    script_args = [*JOB_ARGS, "--epochs", str(args.epochs), *fault.script_args]
    base_args, base_run_args = script_args, None
    if fault.kind == "node-loss":  # a smaller job with slower steps: time to lose a host mid-run
        script_args = node_loss.script_args(args.epochs)
        base_args = node_loss.baseline_args(args.epochs)
        base_run_args = list(node_loss.BASELINE_RUN_ARGS)
    base_script = TRAIN_SCRIPT
    if args.fault == "shrink":  # the invariant job, its fault-free run on 4 ranks of one host
        script_args = shrink.script_args(args.epochs)
        base_args, base_script = shrink.baseline_args(args.epochs), shrink.INVARIANT_SCRIPT
        base_run_args = [*node_loss.BASELINE_RUN_ARGS, *shrink.VIRTUAL_RUN_ARGS]
    started = time.monotonic()
    try:
        console.print(f"[bold]undying demo[/bold]: seeded {RANKS}-rank CPU job, fault: "
                      f"{fault.description}")
        console.print("  run 1/2: without the fault ...")
        rc_base = run_job(root / "fault-free", base_args, extra_run_args=base_run_args,
                          script=base_script)
        console.print(f"  run 2/2: with the fault ({fault.kind}) ...")
        baseline = load_run(root / "fault-free" / "events.db")
        exit_codes = {"fault_free": rc_base}
        fault_reasons: list[str] = []
        if fault.kind == "preempt":
            rc_term, sigterm_t = run_preempted(root / "with-fault", script_args,
                                               at_step=fault.at_step)
            console.print(f"    SIGTERM at step >= {fault.at_step}: the launcher exited {rc_term}; "
                          "running the same command again ...")
            rc_fault = run_job(root / "with-fault", script_args)
            faulty, preempt_incident = load_preempted(root / "with-fault", sigterm_t)
            kept = [i for i in faulty.incidents if i["kind"] != "preempt"]
            faulty_incidents = [*kept, preempt_incident]
            exit_codes["preempted"] = rc_term
            rc_ok = rc_term == EXIT_PREEMPTED
        elif args.fault == "shrink":
            shrunk = shrink.run_with_shrink(root, script_args, console)
            rc_fault, faulty = shrunk.returncode, shrunk.record  # type: ignore[assignment]
            faulty_incidents = faulty.incidents
            fault_reasons = [*shrunk.reasons, *shrink.check_incidents(faulty_incidents)]
            rc_ok = True
        elif fault.kind == "node-loss":
            lost = node_loss.run_with_node_loss(root, script_args, console)
            # rc_fault None: the job never ended (lost.reasons says why); exit_codes shows it as
            # null
            rc_fault, faulty = lost.returncode, lost.record  # type: ignore[assignment]
            faulty_incidents = faulty.incidents
            fault_reasons = [*lost.reasons, *node_loss.check_incidents(faulty_incidents)]
            rc_ok = True
        else:
            rc_fault = run_job(root / "with-fault", script_args, fault=fault, when_warm=True,
                               extra_run_args=list(fault.run_args))
            faulty = load_run(root / "with-fault" / "events.db")
            faulty_incidents = faulty.incidents
            rc_ok = True
        exit_codes["with_fault"] = rc_fault
        comparison = compare_runs(baseline, faulty)
        incidents = [_incident_view(i) for i in faulty_incidents]
        reasons = [*comparison.reasons, *fault_reasons]
        if not rc_ok:
            reasons.append(f"the preempted launcher exited {exit_codes['preempted']}, "
                           f"not {EXIT_PREEMPTED}")
        # A found fault (slow) must name the rank it was put in; a recovered one is checked by the
        # oracle.
        named = fault.rank if fault.expect else None
        if not any(i["kind"] == fault.incident_kind and named in (None, i["rank"])
                   for i in incidents):
            who = f" naming rank {named}" if named is not None else ""
            reasons.append(f"no {fault.incident_kind} incident{who} was recorded: the fault was "
                           "not found")
        ok = not reasons and rc_base == 0 and rc_fault == 0 and rc_ok
        result: dict[str, Any] = {
            "fault": args.fault,
            "identical": comparison.identical,
            "steps": comparison.steps,
            "lost_steps": comparison.lost_steps,
            "incidents": incidents,
            "ranks": RANKS,
            "final_state_identical": comparison.digests_equal,
            "exit_codes": exit_codes,
            "wall_s": round(time.monotonic() - started, 2),
            "ok": ok,
            "reasons": reasons,
        }
        if args.keep:
            result["job_dirs"] = {"fault_free": str(root / "fault-free"),
                                  "with_fault": str(root / "with-fault")}
        if args.json:
            sys.stdout.write(json.dumps(result) + "\n")
        else:
            _render(result, Console())
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _incident_view(incident: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": incident["kind"],
        "rank": incident["rank"],
        "step": incident["step"],
        "action": incident["action"],
        "status": incident["status"],
        "mttr_s": incident["mttr_s"],
        "phases": incident["phases"],
        "replacement": incident.get("detail", {}).get("replacement"),
    }


def _render(result: dict[str, Any], console: Console) -> None:
    names = ["detected", "decided", "replacement_ready", "group_rebuilt", "state_restored",
             "first_step_done"]
    if any(i["kind"] == "preempt" for i in result["incidents"]):
        names = ["detected", "decided", "checkpoint_written", "exited", "relaunched",
                 "state_restored", "first_step_done"]
    # The table holds what fits 80 columns; each incident's timeline is a line of its own under it.
    table = Table("kind", "rank", "step", "action", "status", "mttr s", title="incidents")
    timelines: list[Text] = []
    for n, i in enumerate(result["incidents"], 1):
        phases = i["phases"]
        table.add_row(
            f"{n} {i['kind']}", str(i["rank"]), str(i["step"]), str(i["action"]),
            str(i["status"]), "-" if i["mttr_s"] is None else f"{i['mttr_s']:.3f}",
        )
        shown = ", ".join(f"{p} {phases[p]:.3f}" for p in names if p in phases)
        timelines.append(Text(f"  {n}: timeline in seconds since the fault: {shown or '-'}"))
    console.print(table)
    for line in timelines:
        console.print(line)
    verdict = "[green]identical[/green]" if result["identical"] else "[red]DIFFERENT[/red]"
    console.print(
        f"per-step losses over {result['steps']} steps: {verdict}; final state identical: "
        f"{result['final_state_identical']}; steps lost: {result['lost_steps']}; demo took "
        f"{result['wall_s']}s"
    )
    for reason in result["reasons"]:
        console.print(f"  [red]- {reason}[/red]")
    if "job_dirs" in result:
        console.print(f"job dirs: {result['job_dirs']}")
    if os.environ.get(DEMO_QUIET_ENV) is None:
        ending = "[bold green]OK[/bold green]" if result["ok"] else "[bold red]FAILED[/bold red]"
        console.print(ending)
