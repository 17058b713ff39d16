"""The single-node soak's faults of undying's own processes: the zygote, the launcher, the verifier, a rank's exit 0.

Each scenario injects its fault into the running job (``SingleJob``, bench/soak.py)
and returns its record: ``outcome`` is ``recovered`` (what the kind expects
happened, within its deadline), ``planned-end`` (the launcher exited with the
documented code and the relaunch resumed where it stopped) or ``failed``,
and ``why`` says what was seen. What each kind expects is in bench/soak.py's
docstring and docs/benchmarks.md. Processes are found in /proc: every process
of the job carries ``UNDYING_JOB_DIR`` in its environment; the zygote runs
``undying.worker.zygote``, the verifier has ``UNDYING_VERIFY_SERVE_DIR``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from soak_plan import HOWS, order_name, until

from undying.cli.client import api_post
from undying.config import EXIT_PREEMPTED
from undying.errors import JobNotRunningError, UsageError
from undying.protocol.env import VERIFY_SERVE_DIR_ENV

TOLD = ("checkpoint_failed",)  # told, not recovered: a failed save leaves the job training
DEADLINE_S = 30.0  # what each kind is given to recover
SEEN_EXIT_S = 1.0  # a rank's exit is seen by its agent within a second, whatever the zygote does (issue #25)
SETTLE_S = 1.0  # after a scenario looks done: a late effect (a rank dying after the zygote) still shows


class Job(Protocol):
    """What a scenario needs of the running single-node job (bench/soak.py's SingleJob)."""

    job_dir: Path
    leave_dir: Path
    url: str
    stop_grace: float
    launches: list[dict[str, Any]]  # one per launch, the newest last (what each scenario notes of it)

    def status(self) -> dict[str, Any]: ...

    def hangup(self) -> tuple[int, float]: ...  # SIGHUP to the launcher's group: (its exit code, seconds)

    def relaunch(self, why: str) -> bool: ...


# --- the job's processes, from /proc ------------------------------------------------


def _processes(wanted: Callable[[list[bytes]], bool]) -> dict[int, tuple[bytes, list[bytes]]]:
    """PID -> (command line, environment) of every live, non-zombie process whose environment is ``wanted``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if not wanted(environ):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(entry.name)] = ((entry / "cmdline").read_bytes(), environ)
        except (OSError, IndexError):
            continue
    return found


def job_processes(job_dir: Path) -> dict[int, tuple[bytes, list[bytes]]]:
    """The job's processes: workers, spares and the zygote carry its dir in their environment."""
    marker = f"UNDYING_JOB_DIR={job_dir}".encode()
    return _processes(lambda env: marker in env)


def zygote_pids(job: Job) -> list[int]:
    """The job's live zygote, as its agent names it (``zygote_pid`` of the node in the status): its ranks and
    spares are forked from it and show its command line too, and they are the agent's children as it is."""
    status = _look(job) or {}
    return sorted({int(n.get("zygote_pid") or 0) for n in status.get("nodes", [])} - {0})


def verifier_pids(job_dir: Path) -> list[int]:
    """The job's verifiers: rank 0 starts one with none of the job's variables but the folder it serves, in the
    job dir."""
    serve = f"{VERIFY_SERVE_DIR_ENV}={job_dir}{os.sep}".encode()
    return sorted(_processes(lambda env: any(e.startswith(serve) for e in env)))


def _is(pid: int, what: bytes) -> bool:
    try:
        return what in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# --- what the job says ---------------------------------------------------------------


def _look(job: Job) -> dict[str, Any] | None:
    with contextlib.suppress(JobNotRunningError, UsageError, OSError):
        return job.status()
    return None


def _rank_pids(status: dict[str, Any]) -> dict[int, int]:
    return {int(r["rank"]): int(r["pid"]) for r in status["ranks"] if r.get("pid") and r.get("state") != "exited"}


def _new(status: dict[str, Any], before: int) -> list[dict[str, Any]]:
    return [i for i in status["incidents"][before:] if i["kind"] not in TOLD]


def _kinds(incidents: list[dict[str, Any]]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in Counter(f"{i['kind']}:{i['status']}" for i in incidents).items())


def _ended(job: Job, what: str) -> dict[str, Any]:
    status = _look(job)
    state = status["state"] if status else "gone"
    return {"outcome": "failed", "why": f"{what}; the job is {state}"}


def _quiet(job: Job, before: int) -> dict[str, Any] | None:
    """The status once the job runs with every incident since ``before`` closed (or None if it ended)."""
    status = _look(job)
    if status is None or status["state"] in ("succeeded", "failed", "stopped", "stopping"):
        return None
    if status["state"] == "running" and all(i["status"] != "open" for i in _new(status, before)):
        return status
    return None


def _recovered(job: Job, before: int, timeout: float, want: int = 1) -> tuple[dict[str, Any] | None, list[dict]]:
    """Wait until at least ``want`` new incidents exist, all closed, the job running; returns (status, incidents)."""
    def done() -> dict[str, Any] | None:
        status = _quiet(job, before)
        return status if status is not None and len(_new(status, before)) >= want else None

    status = until(done, timeout)
    if status is not None:
        time.sleep(SETTLE_S)
        status = _look(job) or status
    last = _look(job)
    return status, _new(last, before) if last else []


# --- the scenarios ---------------------------------------------------------------------


def zygote_kill(job: Job, rng: random.Random, base: int) -> dict[str, Any]:
    """SIGKILL the agent's zygote. Expected: no rank lost, no incident, a new zygote within the deadline."""
    status = job.status()
    # (the one the last scenario stopped or killed is replaced in the background: a new one imports torch first)
    zygotes = until(lambda: zygote_pids(job), DEADLINE_S)
    if not zygotes:
        return {"outcome": "failed", "why": f"no zygote running (none within {DEADLINE_S:.0f} s)"}
    ranks, before, step = _rank_pids(status), len(status["incidents"]), status["step"]
    os.kill(zygotes[0], signal.SIGKILL)
    replaced = until(lambda: [p for p in zygote_pids(job) if p != zygotes[0]], DEADLINE_S)
    time.sleep(SETTLE_S)
    after = until(lambda: _quiet(job, before), DEADLINE_S)
    if after is None:
        return _ended(job, f"zygote {zygotes[0]} killed: the job did not come back to running with no open incident")
    until(lambda: (_look(job) or {"step": 1 << 60})["step"] >= after["step"] + 3, DEADLINE_S)
    after = _look(job) or after
    problems = []
    if _new(after, before):
        problems.append(f"incidents {_kinds(_new(after, before))}")
    lost = sorted(r for r, pid in ranks.items() if _rank_pids(after).get(r) != pid)
    if lost:
        problems.append(f"ranks {lost} lost (new processes)")
    if not replaced:
        problems.append(f"no new zygote within {DEADLINE_S:.0f} s")
    if after["step"] < step + 3:
        problems.append(f"no progress (step {step} -> {after['step']})")
    return {"outcome": "failed" if problems else "recovered", "why": "; ".join(problems) or
            f"no rank lost, new zygote {replaced[0]}", "zygote": zygotes[0]}


def zygote_stop(job: Job, rng: random.Random, base: int) -> dict[str, Any]:
    """SIGSTOP the zygote, then crash a rank. Expected: the crash seen within a second and recovered, zygote stopped."""
    status = job.status()
    # (the one the last scenario stopped or killed is replaced in the background: a new one imports torch first)
    zygotes = until(lambda: zygote_pids(job), DEADLINE_S)
    if not zygotes:
        return {"outcome": "failed", "why": f"no zygote running (none within {DEADLINE_S:.0f} s)"}
    rank = rng.randrange(len(status["ranks"]) or 1)
    before = len(status["incidents"])
    os.kill(zygotes[0], signal.SIGSTOP)
    try:
        api_post(job.url, "/api/inject", {"kind": "crash", "rank": rank, "at_step": base,
                                          "phase": rng.choice(("step", "forward", "backward", "optimizer"))})
        after, incidents = _recovered(job, before, DEADLINE_S)
    finally:
        if _is(zygotes[0], b"undying.worker.zygote"):  # replaced and killed by the agent meanwhile: nothing to do
            with contextlib.suppress(ProcessLookupError):
                os.kill(zygotes[0], signal.SIGCONT)
    record: dict[str, Any] = {"zygote": zygotes[0], "rank": rank}
    if after is None:
        return {**record, **_ended(job, f"zygote stopped, rank {rank} crashed: not recovered within "
                                        f"{DEADLINE_S:.0f} s ({_kinds(incidents) or 'no incident'})")}
    detected = [float((i.get("phases") or {}).get("detected", 1e9)) for i in incidents]
    problems = []
    if [i["kind"] for i in incidents] != ["crash"] or incidents[0]["status"] != "recovered":
        problems.append(f"incidents {_kinds(incidents)}, expected one crash recovered")
    if detected and max(detected) > SEEN_EXIT_S:
        problems.append(f"the exit was seen after {max(detected):.2f} s (> {SEEN_EXIT_S} s)")
    return {**record, "outcome": "failed" if problems else "recovered", "detected_s": detected,
            "why": "; ".join(problems) or f"crash of rank {rank} recovered with the zygote stopped"}


def launcher_hup(job: Job, rng: random.Random, base: int) -> dict[str, Any]:
    """SIGHUP to the launcher's process group (a closed terminal). Expected: exit 75 after a dying gasp, and the
    relaunch (the same command, as a scheduler requeues it) resumes at the step it stopped at: nothing re-run."""
    rc, took = job.hangup()
    stopped = _last_common_step(job.job_dir / "events.db")
    if not job.relaunch(f"launcher-hup (exit {rc})"):
        return {"outcome": "failed", "why": f"exit {rc}; the relaunch did not come up", "exit": rc}
    # Resumed: the new launch names its checkpoint (none: from step 0) by the time it committed a step.
    status = until(lambda: (s := _look(job)) and (s["checkpoints"].get("resumed_from") or s["step"] > 0) and s,
                    DEADLINE_S)
    resumed = ((status["checkpoints"].get("resumed_from") or {}).get("step", 0)) if status else None
    record = {"exit": rc, "exit_s": round(took, 2), "stopped_at": stopped, "resumed_from": resumed}
    problems = []
    if rc != EXIT_PREEMPTED:
        problems.append(f"exit {rc}, expected {EXIT_PREEMPTED} (a dying gasp)")
    if resumed != stopped:
        problems.append(f"resumed from step {resumed} after stopping at {stopped}: "
                        f"{(stopped or 0) - (resumed or 0)} steps re-run")
    return {**record, "outcome": "failed" if problems else "planned-end",
            "why": "; ".join(problems) or f"exit {rc} at step {stopped}, resumed there"}


def _last_common_step(events_db: Path) -> int | None:
    """The newest step every rank of the launch committed (what a dying gasp saves)."""
    from undying.jobfiles.events import LogReader

    with contextlib.suppress(Exception), LogReader(events_db) as reader:
        last: dict[int, int] = {}
        for rank, step, _ in reader.commit_times():
            last[rank] = max(last.get(rank, 0), step)
        return min(last.values()) if last else None
    return None


def verifier_kill(job: Job, rng: random.Random, base: int) -> dict[str, Any]:
    """SIGKILL the verifier (``--verify-every``). Expected: a new verifier within the deadline, no incident."""
    status = job.status()
    verifiers = until(lambda: verifier_pids(job.job_dir), DEADLINE_S)
    if not verifiers:
        return {"outcome": "failed", "why": f"no verifier running (none within {DEADLINE_S:.0f} s)"}
    before = len(status["incidents"])
    os.kill(verifiers[0], signal.SIGKILL)
    restarted = until(lambda: [p for p in verifier_pids(job.job_dir) if p not in verifiers], DEADLINE_S)
    after = _look(job)
    if after is None:
        return _ended(job, "verifier killed")
    problems = []
    if not restarted:
        problems.append(f"not restarted within {DEADLINE_S:.0f} s")
    if _new(after, before):
        problems.append(f"incidents {_kinds(_new(after, before))}")
    return {"outcome": "failed" if problems else "recovered", "verifier": verifiers[0],
            "why": "; ".join(problems) or f"restarted as {restarted[0]}"}


def rank_leave(job: Job, rng: random.Random, base: int) -> dict[str, Any]:
    """A rank exits 0 while the others go on (``sys.exit(0)`` in a step, or its loop returning). Expected: a
    ``left-early`` incident recovered like a crash (never the job's success).

    A rank leaves at most once per launch: the script's own early end a second time from a rank already
    replaced for it fails the job by design (``manager/recovery/leaving.py``: no replacement changes a script whose
    loop ends early; tests/unit/test_leaving.py), which is not this scenario's question.
    """
    status = job.status()
    left: list[int] = job.launches[-1].setdefault("left", [])
    ranks = [r for r in range(len(status["ranks"]) or 1) if r not in left]
    if not ranks:
        return {"outcome": "skipped", "why": "every rank left once in this launch"}
    rank, how = rng.choice(ranks), rng.choice(HOWS)
    left.append(rank)
    before = len(status["incidents"])
    job.leave_dir.mkdir(parents=True, exist_ok=True)
    tmp = job.leave_dir / f".order-{os.getpid()}"
    tmp.write_text("")
    os.rename(tmp, job.leave_dir / order_name(rank, base, how))
    after, incidents = _recovered(job, before, DEADLINE_S)
    record = {"rank": rank, "how": how, "at_step": base}
    if after is None:
        return {**record, **_ended(job, f"rank {rank} left ({how}) at step {base}: "
                                        f"{_kinds(incidents) or 'no incident'} within {DEADLINE_S:.0f} s")}
    ok = any(i["kind"] == "left-early" for i in incidents) and all(i["status"] == "recovered" for i in incidents)
    return {**record, "outcome": "recovered" if ok else "failed",
            "why": f"incidents {_kinds(incidents)}" + ("" if ok else ", expected left-early recovered")}


SCENARIOS: dict[str, Callable[[Job, random.Random, int], dict[str, Any]]] = {
    "zygote-kill": zygote_kill, "zygote-stop": zygote_stop, "launcher-hup": launcher_hup,
    "verifier-kill": verifier_kill, "rank-leave": rank_leave,
}
