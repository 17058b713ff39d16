"""The single-node soak's driver: the job across its launches, the scenarios in turn (see bench/soak.py).

The rank faults of issue #14 are armed through the job's API here; the faults
of undying's own processes are bench/soak_own.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recovery import Workload, bench_env, launch, stop, undying_worker_pids, wait_for
from soak_own import SCENARIOS as OWN_SCENARIOS
from soak_own import job_processes
from soak_plan import LEAVE_ENV, PACE_ENV, SOAK_SCRIPT, faults_of, kind

from undying.cli.client import api_get, api_post
from undying.config import EXIT_PREEMPTED
from undying.errors import JobNotRunningError, UsageError
from undying.jobfiles.jobdir import JobDir

__all__ = ["run_faulty", "run_baseline", "SingleJob", "LIMIT_S", "TOLD", "epochs_for"]

RANKS = 4
LIMIT_S = 2.0
STOP_GRACE_S = 3.0
VERIFY_EVERY = 32
STEP_S = 0.1  # the pace while faults come (bench/soak_train.py): the job's length is in steps, the faults' in seconds
SCENARIO_STEPS = 50  # steps a scenario spends at that pace (sizes the job: steps_for)
STEP_PHASES = ("step", "forward", "backward", "optimizer")
# Incidents that are told, not recovered: a failed save leaves the job training, the incident stays as a record.
TOLD = ("checkpoint_failed",)
SAVE_EVERY = 64
ENDED = ("succeeded", "failed", "stopped", "stopping")
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
        if b"--spare" in cmd.split(b"\0") or forked:
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


def epochs_for(scenarios: int) -> int:
    """The job's epochs (128 steps each) for a deck: ``SCENARIO_STEPS`` a scenario, a third more, and 200 steps."""
    return -(-int(scenarios * SCENARIO_STEPS * 4 / 3 + 200) // 128)


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
    pace = run_dir / "pace"
    pace.write_text(str(STEP_S))
    job = SingleJob(argv, bench_env(**{LEAVE_ENV: str(run_dir / "leave"), PACE_ENV: str(pace)}), run_dir, log,
                    filler)
    injected: list[dict[str, Any]] = []
    try:
        job.start()
        injected = drive(job, deck, args, workload.total_steps, log, filler)
        pace.write_text("0")  # the faults are in: the job runs out at full speed
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


