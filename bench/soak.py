"""Soak: long seeded jobs under a stream of random real faults, then the oracle.

Two soaks: the single-node one (below) and the multi-node one (bench/soak_multi.py:
2 nodes x 2 ranks on network-namespace hosts). Each fault kind is named in
bench/soak_plan.py; ``--kinds`` limits a run to some of them (only the soaks
that run one of them start).

Method
------
The demo job (4 ranks, gloo on CPU) runs under ``undying run`` with one warm
spare, short detection limits (``--heartbeat-timeout`` and ``--step-timeout``,
2 s each) and ``--max-restarts`` 3. A driver injects faults through the job's
HTTP API, one scenario at a time: it arms the scenario a few steps ahead of
the job, waits until every incident it caused is recovered (or failed), and
goes on until ``--faults`` faults were injected. The scenarios, drawn with a
seeded RNG:

* crash: SIGKILL of a rank, at the start of a step, in forward, in backward's
  gradient all-reduce or in the optimizer step;
* hang (stop): SIGSTOP of a rank (missing heartbeats);
* hang (spin) / hang (block): the rank's training thread loops or blocks
  forever in forward or backward while the process lives and beats (missing
  progress: the step timeout);
* comm-error: the rank breaks its process group's connections (retry in place);
* overlap (two at once): two ranks crash at the same step;
* overlap (during recovery): a rank crashes, and another hangs (SIGSTOP) as it
  starts recovering from it;
* overlap (replacement dies): a rank crashes, and its replacement crashes once
  it has joined;
* spare (stopped): the warm spare is SIGSTOPped, then a rank crashes: the agent
  must give up on the spare within its take timeout and recover through a cold
  start, never waiting out the init timeout;
* spare (killed): the warm spare is SIGKILLed: the agent must start a new one
  (the scenario waits until a spare with another PID is ready).

And the faults of undying's own processes (issue #25; bench/soak_own.py), each
given 30 s:

* zygote-kill: SIGKILL of the agent's zygote (the fork server). Recovered: no
  incident, every rank the same process, a new zygote, the job 3 steps on.
* zygote-stop: SIGSTOP of the zygote, then a rank crashes. Recovered: exactly
  that crash, seen within 1 s (the incident's ``detected`` phase) and recovered
  while the zygote stays stopped; then SIGCONT.
* launcher-hup: SIGHUP to the launcher's process group (a closed terminal, a
  dropped ssh session). A planned end: exit 75 after a dying gasp, and the
  driver relaunches the same command at once (as a scheduler requeues it);
  passed when the relaunch resumed at the newest step every rank committed
  (nothing re-run).
* verifier-kill: SIGKILL of the ``--verify-every`` verifier (the job then runs
  with ``--verify-every 32``). Recovered: a new verifier, no incident.
* rank-leave: a rank exits 0 while the others go on, ``sys.exit(0)`` inside a
  step or its loop returning (bench/soak_train.py, the demo job with a switch
  for it). Recovered: a ``left-early`` incident, recovered as a crash is.

A job that ends otherwise (failed, or exit 0 before its last step) is
relaunched too, at most ``--relaunches`` times, so the other kinds still run;
the scenario before it is counted failed. The oracle merges every launch's log.

The faulted job also saves a checkpoint every ``SAVE_EVERY`` steps into a
folder on a small tmpfs (root only; ``--fill-mb 0`` or not root: a plain folder).
A third of the way through the faults the driver fills that tmpfs to the last
byte and frees it again at two thirds: the saves in between must fail as
``checkpoint_failed`` incidents while training goes on, and the saves after it
must succeed again.

Then the same job runs fault-free and the two are compared step by step
(``undying.demo.oracle``): every per-step loss identical, no step completed twice,
the final states equal. Reported: faults injected and recovered, per incident
kind the median and p95 recovery time (fault to the first step every rank
completed after the recovery), and the scenarios that ended otherwise.

Run it from the repository root::

    python bench/soak.py                  # both soaks, 200 + 100 faults, text report
    python bench/soak.py --faults 20 --json
    python bench/soak.py --kinds zygote-kill --faults 3

Every scenario's outcome (recovered, planned-end, failed, with why) is in the
report per kind. It asserts nothing; it reports, and exits 1 when the soak did
not hold. Every process started is stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery import (  # noqa: E402  (bench/ is a folder of scripts)
    Workload,
    bench_env,
    interrupt,
    launch,
    stop,
    undying_worker_pids,
    wait_for,
)
from soak_own import SCENARIOS as OWN_SCENARIOS  # noqa: E402
from soak_own import job_processes, verifier_pids  # noqa: E402
from soak_plan import LEAVE_ENV, MULTI, SINGLE, SOAK_SCRIPT, faults_of, kind, schedule, soaks_of  # noqa: E402
from soak_report import holds, outcomes_by_kind, render_outcomes  # noqa: E402

from undying.cli.client import api_get, api_post  # noqa: E402
from undying.config import EXIT_PREEMPTED  # noqa: E402
from undying.demo.oracle import RunRecord, compare_runs, load_run, merge_runs  # noqa: E402
from undying.errors import JobNotRunningError, UsageError  # noqa: E402
from undying.manager.jobdir import JobDir  # noqa: E402

RANKS = 4
LIMIT_S = 2.0
STOP_GRACE_S = 3.0
VERIFY_EVERY = 32
STEP_PHASES = ("step", "forward", "backward", "optimizer")
# Incidents that are told, not recovered: a failed save leaves the job training, the incident stays as a record.
TOLD = ("checkpoint_failed",)
SAVE_EVERY = 64
ENDED = ("succeeded", "failed", "stopped", "stopping")
DEFAULT_FAULTS = {"single": 200, "multi": 100}
STALL_S = 90.0  # a launch that makes no step this long is stuck: stopped, and the soak did not hold


@dataclass(frozen=True)
class Injection:
    kind: str
    rank: int
    phase: str
    how: str | None = None
    offset: int = 0  # steps after the scenario's base step ("rejoin" and "recovery" use 1)


def plan(scenario: str, rng: random.Random) -> list[Injection]:
    a, b = rng.sample(range(RANKS), 2)
    if scenario == "crash":
        return [Injection("crash", a, rng.choice(STEP_PHASES))]
    if scenario.startswith("hang-"):
        how = scenario.removeprefix("hang-")
        phase = "step" if how == "stop" else rng.choice(("forward", "backward"))
        return [Injection("hang", a, phase, how=how)]
    if scenario == "comm-error":
        return [Injection("comm-error", a, rng.choice(("forward", "backward")))]
    if scenario == "overlap-two-at-once":
        return [Injection("crash", a, "backward"), Injection("crash", b, "backward")]
    if scenario == "overlap-during-recovery":
        return [Injection("crash", a, "backward"), Injection("hang", b, "recovery", how="stop", offset=-10**6)]
    if scenario == "overlap-replacement-dies":
        return [Injection("crash", a, "forward"), Injection("crash", a, "rejoin", offset=-10**6)]
    if scenario == "spare-stop":  # the spare is stopped by the driver first; then a crash needs a replacement
        return [Injection("crash", a, "forward")]
    if scenario == "spare-kill":
        return []
    raise ValueError(scenario)


def spare_pids(job_dir: Path, rank_pids: set[int]) -> list[int]:
    """The job's warm spares: processes of the job (their environment names its folder) that hold no rank.

    A spare started fresh runs ``undying.worker.boot --spare``; one forked by the
    agent's zygote shows the zygote's command line, so it is told by its parent.
    A spare that took a rank keeps its command line, hence the rank PIDs left out.
    """
    found = []
    for pid, (cmd, _) in job_processes(job_dir).items():
        if pid in rank_pids:
            continue
        try:
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            forked = b"undying.worker.zygote" in Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if b"--spare" in cmd.split(b"\0") or (forked and b"undying.worker.zygote" not in cmd):
            found.append(pid)
    return found


class SingleJob:
    """The faulted single-node job across its launches: the same command, relaunched after each end."""

    def __init__(self, argv: list[str], env: dict[str, str], run_dir: Path, log: Any,
                 filler: FillingFolder | None = None) -> None:
        self.argv, self.env, self.run_dir, self.log, self.filler = argv, env, run_dir, log, filler
        self.job_dir = run_dir / "job"
        self.leave_dir = run_dir / "leave"
        self.stop_grace = STOP_GRACE_S
        self.url = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.launches: list[dict[str, Any]] = []  # each: its exit code and why it was relaunched

    def start(self) -> None:
        n = len(self.launches) + 1
        self.process = launch(self.argv, self.env, self.run_dir / ("launcher.log" if n == 1 else f"launcher-{n}.log"))
        self.launches.append({"launch": n, "rc": None})
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and self.process.poll() is None:
            info = JobDir(self.job_dir).read_manager()
            if info is not None and int(info.get("pid", 0)) == self.process.pid:
                with contextlib.suppress(JobNotRunningError, UsageError):
                    if api_get(info["url"], "/api/status")["spares_ready"] >= 1:
                        self.url = info["url"]
                        return
            time.sleep(0.1)
        raise RuntimeError(f"launch {n} did not come up with a warm spare; see {self.run_dir}")

    def status(self) -> dict[str, Any]:
        return dict(api_get(self.url, "/api/status"))

    def hangup(self) -> tuple[int, float]:
        assert self.process is not None
        started = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGHUP)
        rc = wait_for(self.process, time.monotonic() + self.stop_grace + 60)
        self.launches[-1]["rc"] = rc
        return rc, time.monotonic() - started

    def relaunch(self, why: str) -> bool:
        """The same command again (the end of the last launch is recorded); False if it did not come up."""
        self.end()
        self.launches[-1]["why_relaunched"] = why
        print(f"soak: relaunch after {why}", file=self.log, flush=True)
        filled = self.filler if self.filler is not None and self.filler.filled else None
        if filled is not None:  # a launch refuses a full checkpoint folder (exit 2): the fill is for a running job
            filled.free()
        try:
            self.start()
        except RuntimeError as e:
            print(f"soak: {e}", file=self.log, flush=True)
            return False
        finally:
            if filled is not None:
                filled.fill()
        return True

    def end(self) -> None:
        """Stop what is left of the current launch (nothing, after a planned end)."""
        if self.process is None:
            return
        left = stop(self.process, lambda: undying_worker_pids(self.job_dir / "events.db"), str(SOAK_SCRIPT))
        if self.launches[-1]["rc"] is None:
            self.launches[-1]["rc"] = self.process.returncode
        if left:
            self.launches[-1]["workers_left"] = left

    def wait(self, timeout: float, stall_s: float = STALL_S) -> int:
        """The launch's exit code; 124 when it ran past ``timeout`` or went ``stall_s`` without a step (then it is
        stopped: a stuck job is a failed soak, not an hour's wait)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = self.process.wait(timeout=1.0)
                self.launches[-1]["rc"] = rc
                return rc
            with contextlib.suppress(JobNotRunningError, UsageError, OSError):
                step = int(self.status()["step"])
                if step != last:
                    last, since = step, time.monotonic()
            if time.monotonic() - since > stall_s:
                print(f"soak: no step for {stall_s:.0f} s (at step {last}): the job is stuck; stopped", file=self.log,
                      flush=True)
                break
        self.end()
        self.launches[-1].update(rc=124, stuck_at=last)
        return 124


def _ready_spare(job: SingleJob, deadline: float, not_pid: int = -1) -> int | None:
    """A warm spare's PID once one is ready (other than ``not_pid``), or None by ``deadline``."""
    while time.monotonic() < deadline:
        with contextlib.suppress(JobNotRunningError, UsageError):
            status = job.status()
            if status["spares_ready"] >= 1:
                ranks = {int(r["pid"]) for r in status["ranks"] if r.get("pid")}
                pids = [p for p in spare_pids(job.job_dir, ranks) if p != not_pid]
                if pids:
                    return pids[0]
        time.sleep(0.1)
    return None


class FillingFolder:
    """A checkpoint folder on a tmpfs of its own that the driver can fill to the last byte and free again."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True)
        self._ballast = path / "ballast"
        self.filled = False

    def fill(self) -> None:
        self.filled = True
        # Unbuffered, and the suppression outside the open: ENOSPC, from a write or the close, ends it.
        for chunk in (1 << 20, 4096):  # megabytes, then the last partial megabyte
            with contextlib.suppress(OSError), open(self._ballast, "ab", buffering=0) as f:
                while True:
                    f.write(b"\0" * chunk)

    def free(self) -> None:
        self.filled = False
        self._ballast.unlink(missing_ok=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


def _running(job: SingleJob, args: argparse.Namespace, log: Any) -> dict[str, Any] | None:
    """The job's status once it runs with no open incident; after an unplanned end, a relaunch (bounded).

    None when the job ended for good, or is stuck (not running with every incident closed for ``STALL_S``:
    then it is stopped)."""
    deadline = time.monotonic() + STALL_S
    while time.monotonic() < deadline:
        try:
            status = job.status()
        except (JobNotRunningError, UsageError):
            status = None
        if status is None or status["state"] in ENDED:
            assert job.process is not None
            rc = job.wait(STOP_GRACE_S + 30)
            unplanned = sum(1 for launch_ in job.launches if launch_["rc"] not in (EXIT_PREEMPTED, None))
            if rc == 0:  # the job's end (a success before its last step is the oracle's to find)
                return None
            print(f"soak: the job ended ({status['state'] if status else 'gone'}, exit {rc})", file=log, flush=True)
            if unplanned > args.relaunches or not job.relaunch(f"an unplanned end (exit {rc})"):
                return None
            continue
        if status["state"] == "running" and not any(i["status"] == "open" and i["kind"] not in TOLD
                                                   for i in status["incidents"]):
            return status
        time.sleep(0.1)
    print(f"soak: the job did not run again with every incident closed within {STALL_S:.0f} s: stuck; stopped",
          file=log, flush=True)
    job.end()
    job.launches[-1].update(rc=124, stuck=True)
    return None


def drive(job: SingleJob, deck: list[str], args: argparse.Namespace, total_steps: int, log: Any,
          filler: FillingFolder | None) -> list[dict[str, Any]]:
    """Run the scenarios of ``deck`` in turn; returns what was injected and how each ended."""
    rng = random.Random(args.seed)
    injected: list[dict[str, Any]] = []
    count, faults = 0, faults_of(deck)
    for scenario in deck:
        launches = len(job.launches)
        status = _running(job, args, log)
        if injected and len(job.launches) > launches and injected[-1].get("outcome") != "failed":
            injected[-1].update(outcome="failed", why=f"{injected[-1].get('why', '')}; then the job ended")
        if status is None:
            print(f"soak: the job ended after {count} faults", file=log, flush=True)
            break
        if filler is not None and count >= faults // 3 and not any(s.get("disk") == "filled" for s in injected):
            filler.fill()
            injected.append({"scenario": "disk", "disk": "filled", "t": time.time(), "step": status["step"],
                             "faults": 0})
            print(f"soak: checkpoint folder filled at step {status['step']}", file=log, flush=True)
        if filler is not None and count >= 2 * faults // 3 and not any(s.get("disk") == "freed" for s in injected):
            filler.free()
            injected.append({"scenario": "disk", "disk": "freed", "t": time.time(), "step": status["step"],
                             "faults": 0})
            print(f"soak: checkpoint folder freed at step {status['step']}", file=log, flush=True)
        base = status["step"] + 3
        if base > total_steps - 10:
            print(f"soak: the job is near its end (step {status['step']}); {count} faults", file=log)
            break
        t = time.time()
        record: dict[str, Any] = {"scenario": scenario, "t": t, "base_step": base, "faults": kind(scenario).faults}
        if scenario in OWN_SCENARIOS:
            record.update(OWN_SCENARIOS[scenario](job, rng, base))
        else:
            record.update(_rank_scenario(job, scenario, rng, base, log))
        record["s"] = round(time.time() - t, 2)
        if record.get("outcome") == "skipped":
            print(f"soak: {scenario} skipped: {record.get('why')}", file=log, flush=True)
            continue
        count += record["faults"]
        injected.append(record)
        print(f"soak: [{count}/{faults}] {scenario} at step {base}: {record['outcome']} ({record.get('why', '')})",
              file=log, flush=True)
    return injected


def _rank_scenario(job: SingleJob, scenario: str, rng: random.Random, base: int, log: Any) -> dict[str, Any]:
    """Issue #14's scenarios: armed through the API, recovered when every incident they caused is closed."""
    before = len(job.status()["incidents"])
    faults = plan(scenario, rng)
    extra: dict[str, Any] = {}
    if scenario.startswith("spare-"):
        spare = _ready_spare(job, time.monotonic() + 60)
        if spare is None:
            return {"outcome": "skipped", "why": "no warm spare within 60 s"}
        os.kill(spare, signal.SIGSTOP if scenario == "spare-stop" else signal.SIGKILL)
        extra["spare_pid"] = spare
        if scenario == "spare-kill":
            extra["spare_replaced"] = _ready_spare(job, time.monotonic() + 60, not_pid=spare) is not None
            return {**extra, "outcome": "recovered" if extra["spare_replaced"] else "failed",
                    "why": "a new spare warm" if extra["spare_replaced"] else "no new spare within 60 s"}
    for injection in faults:
        api_post(job.url, "/api/inject", {"kind": injection.kind, "rank": injection.rank,
                                          "at_step": max(1, base + injection.offset), "phase": injection.phase,
                                          "how": injection.how})
    _wait_recovered(job, before, deadline=time.monotonic() + 90)
    with contextlib.suppress(JobNotRunningError, UsageError):
        incidents = [i for i in job.status()["incidents"][before:] if i["kind"] not in TOLD]
        bad = [f"{i['kind']}:{i['status']}" for i in incidents if i["status"] != "recovered"]
        return {**extra, "outcome": "failed" if bad or not incidents else "recovered",
                "why": f"{len(incidents)} incidents" + (f", not recovered: {bad}" if bad else "")}
    return {**extra, "outcome": "failed", "why": "the job ended"}


def _wait_recovered(job: SingleJob, before: int, deadline: float) -> None:
    """Until the scenario's incidents exist and none is open (or the job ended)."""
    while time.monotonic() < deadline:
        try:
            status = job.status()
        except (JobNotRunningError, UsageError):
            return
        incidents = [i for i in status["incidents"][before:] if i["kind"] not in TOLD]
        if status["state"] in ENDED:
            return
        if incidents and all(i["status"] != "open" for i in incidents) and status["state"] == "running":
            time.sleep(0.3)  # a second fault of the scenario may still be on its way
            status = job.status()
            if all(i["status"] != "open" for i in status["incidents"][before:] if i["kind"] not in TOLD) \
                    and status["state"] == "running":
                return
        time.sleep(0.1)


def soak_argv(run_dir: Path, script_args: list[str], spares: int, verify: bool) -> list[str]:
    return [sys.executable, "-m", "undying", "run", "-n", str(RANKS), "--port", "0",
            "--job-dir", str(run_dir / "job"), "--job-id", run_dir.name, "--spares", str(spares),
            "--heartbeat-timeout", str(LIMIT_S), "--step-timeout", str(LIMIT_S),
            "--checkpoint-dir", str(run_dir / "checkpoints"), "--save-every", str(SAVE_EVERY),
            "--max-restarts", "3", "--stop-grace", str(STOP_GRACE_S),
            *(["--verify-every", str(VERIFY_EVERY)] if verify else []), str(SOAK_SCRIPT), *script_args]


def run_faulty(workload: Workload, run_dir: Path, deck: list[str], args: argparse.Namespace,
               log: Any) -> tuple[int, list[dict[str, Any]], SingleJob]:
    run_dir.mkdir(parents=True, exist_ok=True)
    filler = FillingFolder(run_dir / "checkpoints", args.fill_mb) if args.fill_mb else None
    argv = soak_argv(run_dir, workload.script_args(), 1, "verifier-kill" in deck)
    job = SingleJob(argv, bench_env(**{LEAVE_ENV: str(run_dir / "leave")}), run_dir, log, filler)
    injected: list[dict[str, Any]] = []
    try:
        job.start()
        injected = drive(job, deck, args, workload.total_steps, log, filler)
        rc = job.launches[-1]["rc"]  # set when the driver saw the job end (or stopped it stuck: 124)
        rc = job.wait(args.timeout) if rc is None else rc
        while rc not in (0, 124) and len(job.launches) <= args.relaunches and job.relaunch(f"exit {rc}"):
            rc = job.wait(args.timeout)  # an end after the last scenario: relaunched as a scheduler would
        return rc, injected, job
    finally:
        job.end()
        for pid in spare_pids(job.job_dir, set()):  # a stopped spare the agent did not reap is ours to end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if filler is not None:
            filler.close()


def run_baseline(script_args: list[str], run_dir: Path, args: argparse.Namespace, verify: bool) -> int:
    """The same job without a fault (and unpaced: the losses do not depend on it), to its end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    process = launch(soak_argv(run_dir, script_args, 0, verify), bench_env(), run_dir / "launcher.log")
    try:
        return wait_for(process, time.monotonic() + args.timeout)
    finally:
        stop(process, lambda: undying_worker_pids(run_dir / "job" / "events.db"), str(SOAK_SCRIPT))


def load_launches(job_dir: Path) -> RunRecord:
    """Every launch of the job as one record (the older logs were archived as events.<time>.db at each start)."""
    older = sorted(job_dir.glob("events.*.db"), key=lambda p: p.stat().st_mtime)
    record = load_run(job_dir / "events.db")
    if older:
        merged = load_run(older[0])
        for path in [*older[1:], job_dir / "events.db"]:
            merged = merge_runs(merged, load_run(path))
        record = merged
    return record


def leaked_processes(job_dir: Path) -> list[int]:
    """Processes still alive that belong to the job (workers, spares and the zygote carry its dir in their
    environment, a verifier its folder in the job dir)."""
    return sorted({*job_processes(job_dir), *verifier_pids(job_dir)})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(faulty_dir: Path, baseline_dir: Path, injected: list[dict[str, Any]],
              returncode: int) -> dict[str, Any]:
    faulty = load_launches(faulty_dir / "job")
    baseline = load_run(baseline_dir / "job" / "events.db")
    comparison = compare_runs(baseline, faulty)
    by_kind: dict[str, list[float]] = defaultdict(list)
    statuses = Counter(i["status"] for i in faulty.incidents)
    actions = Counter(f"{i['kind']}:{i['action']}" for i in faulty.incidents)
    for incident in faulty.incidents:
        if incident["status"] == "recovered" and incident.get("mttr_s") is not None:
            replacement = incident.get("detail", {}).get("replacement")
            how = {"warm spare": " (warm spare)", "new process": " (new process)"}.get(replacement, "")
            by_kind[incident["kind"] + how].append(incident["mttr_s"])
    rounds = Counter(i.get("recovery") for i in faulty.incidents if i["kind"] not in TOLD)
    overlapped = sum(1 for n in rounds.values() if n > 1)
    return {
        "scenarios": sum(1 for s in injected if s["scenario"] != "disk"),
        "scenario_counts": dict(Counter(s["scenario"] for s in injected)),
        "outcomes": outcomes_by_kind(injected),
        "incidents": len(faulty.incidents),
        "incident_status": dict(statuses),
        "incident_actions": dict(actions),
        "recovery_rounds_with_several_incidents": overlapped,
        "recovery_s_by_kind": {
            kind: {"n": len(v), "median": round(statistics.median(v), 3), "p95": round(percentile(v, 0.95), 3),
                   "max": round(max(v), 3)}
            for kind, v in sorted(by_kind.items())
        },
        "checkpoint_failed": sum(1 for i in faulty.incidents if i["kind"] == "checkpoint_failed"),
        "spares_killed_and_replaced": sum(1 for s in injected if s.get("spare_replaced")),
        "spares_killed": sum(1 for s in injected if s["scenario"] == "spare-kill"),
        "disk": [{k: s[k] for k in ("disk", "step")} for s in injected if s["scenario"] == "disk"],
        "job_state": faulty.state,
        "returncode": returncode,
        "identical": comparison.identical,
        "steps": comparison.steps,
        "lost_steps": comparison.lost_steps,
        "reasons": comparison.reasons,
    }


def render(result: dict[str, Any], out: Any) -> None:
    print(f"soak: {result['faults_injected']} faults in {result['scenarios']} scenarios "
          f"({result['scenario_counts']})", file=out)
    print(f"  incidents: {result['incidents']} {result['incident_status']}; actions {result['incident_actions']}; "
          f"recovery rounds that handled several: {result['recovery_rounds_with_several_incidents']}", file=out)
    print(f"  spares killed {result['spares_killed']}, a new one ready after "
          f"{result['spares_killed_and_replaced']}; checkpoint folder {result['disk']}: "
          f"{result['checkpoint_failed']} checkpoint_failed incidents", file=out)
    for kind_, s in result["recovery_s_by_kind"].items():
        print(f"  {kind_:<26} n={s['n']:<3} median {s['median']:.2f} s  p95 {s['p95']:.2f} s  max {s['max']:.2f} s",
              file=out)
    print(f"  job {result['job_state']} (exit {result['returncode']}); {result['steps']} steps; losses identical: "
          f"{result['identical']}; lost steps: {result['lost_steps']}; wall {result['wall_s']:.0f} s "
          f"(fault-free {result['baseline_wall_s']:.0f} s)", file=out)
    print(f"  launches: {result['launches']}", file=out)
    print(f"  processes left behind: {len(result['leaked_processes'])} {result['leaked_processes'] or ''}", file=out)
    render_outcomes(result["outcomes"], out)
    for reason in result["reasons"]:
        print(f"  ! {reason}", file=out)


def soak_single(deck: list[str], args: argparse.Namespace, root: Path, out: Any) -> dict[str, Any]:
    workload = Workload(epochs=args.epochs, samples=8192, features=32, hidden=64, layers=2, batch_size=16)
    verify = "verifier-kill" in deck
    started = time.monotonic()
    rc, injected, job = run_faulty(workload, root / "faulty", deck, args, out)
    wall = time.monotonic() - started
    started = time.monotonic()
    baseline_rc = run_baseline(workload.script_args(), root / "baseline", args, verify)
    baseline_wall = time.monotonic() - started
    result = summarize(root / "faulty", root / "baseline", injected, rc)
    result["leaked_processes"] = leaked_processes(root / "faulty" / "job") + leaked_processes(root / "baseline" / "job")
    result.update({
        "date": time.strftime("%Y-%m-%d"),
        "faults_injected": sum(s["faults"] for s in injected),
        "seed": args.seed, "workload": vars(workload), "total_steps": workload.total_steps,
        "wall_s": round(wall, 1), "baseline_wall_s": round(baseline_wall, 1), "baseline_returncode": baseline_rc,
        "limits_s": {"heartbeat": LIMIT_S, "step": LIMIT_S}, "runs": str(root), "launches": job.launches,
        "scenario_log": injected,
    })
    result["holds"] = holds(result, planned_exits=(EXIT_PREEMPTED,))
    render(result, out)
    return result


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, interrupt)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=None,
                   help=f"faults to inject per soak (an overlap counts its faults; default {DEFAULT_FAULTS})")
    p.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all): "
                   f"single-node {', '.join(SINGLE)}; multi-node {', '.join(MULTI)}")
    p.add_argument("--at-least", type=int, default=20,
                   help="scenarios of each of undying's own kinds, as far as --faults allows")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    p.add_argument("--epochs", type=int, default=120, help="epochs of the single-node job (128 steps each)")
    p.add_argument("--multi-steps", type=int, default=0,
                   help="steps of the multi-node job (0: sized from --faults, see bench/soak_multi.py)")
    p.add_argument("--relaunches", type=int, default=3, help="relaunches after unplanned ends of the job")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    p.add_argument("--keep", default=None, help="keep the runs' folders here")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout; the report on stderr")
    p.add_argument("--fill-mb", type=int, default=16 if os.geteuid() == 0 else 0,
                   help="size of the tmpfs the faulted job checkpoints to, filled and freed during the run "
                        "(root only; 0: a plain folder that never fills)")
    args = p.parse_args(argv)
    names = [k for k in args.kinds.split(",") if k] or [*SINGLE, *MULTI]
    try:
        soaks = soaks_of(names)
    except ValueError as e:
        p.error(f"--kinds: {e}")
    out = sys.stderr if args.json else sys.stdout
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="undying-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for soak in soaks:
        kinds = [n for n in names if kind(n).soak == soak]
        faults = args.faults or DEFAULT_FAULTS[soak]
        deck = schedule(kinds, faults, args.at_least, random.Random(f"{args.seed}:{soak}"))
        print(f"soak ({soak}): {faults_of(deck)} faults in {len(deck)} scenarios, {dict(Counter(deck))}", file=out,
              flush=True)
        if soak == "single":
            results[soak] = soak_single(deck, args, root / "single", out)
        else:
            from soak_multi import soak_multi

            results[soak] = soak_multi(deck, args, root / "multi", out,
                                       lambda script_args, run_dir: run_baseline(script_args, run_dir, args, False))
    held = all(r.get("holds", False) for r in results.values())
    verdicts = ", ".join(f"{name}: {'held' if r.get('holds') else 'did not hold'}" for name, r in results.items())
    print(f"soak: {'held' if held else 'did NOT hold'} ({verdicts})", file=out)
    if args.json:
        sys.stdout.write(json.dumps({**results, "held": held}) + "\n")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
