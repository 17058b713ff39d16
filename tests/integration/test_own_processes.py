"""undying's own processes cost no step (issue #25, items 1 and 5), with real processes and real signals.

- The worker zygote is a fork server and nothing more: its SIGKILL mid-job
  costs no rank (no incident at all), and with it SIGSTOPped a rank's SIGKILL
  is seen and recovered as any crash; the per-step losses are those of the
  fault-free run (the oracle).
- A process a rank starts in a session of its own (``setsid``) or a process
  group of its own outlives neither the rank's kill nor the job's end.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.jobs import (
    alive,
    events,
    manager_url,
    start_job,
    status,
    wait_for,
    wait_running,
)
from tests.oracle import Oracle
from undying.demo.oracle import compare_runs, load_run

ARGS = ["--epochs", "2"]  # the fault-free reference of test_checkpoints (2 ranks) is this one too
PACED = [*ARGS, "--step-seconds", "0.15"]  # 64 steps, long enough for a zygote to be replaced under load


def _children(pid: int, marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid and marker in cmdline:
            found.append(int(entry))
    return found


def _zygote(launcher: int, url: str, other_than: int = 0) -> int:
    """The launcher's zygote (its forked workers are the launcher's children too, with the same command line)."""
    def find() -> int:
        ranks = {r["pid"] for r in status(url)["ranks"]}
        return next((p for p in _children(launcher, "undying.worker.zygote")
                     if p != other_than and p not in ranks and alive(p)), 0)
    return int(wait_for(find, 60, "a worker zygote"))


def test_a_killed_then_a_stopped_zygote_cost_no_step(oracle: Oracle, tmp_path: Path, reap: list[int]) -> None:
    baseline = oracle.baseline(ARGS, ranks=2)
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, PACED, ranks=2, reap=reap, run_args=["--spares", "0"])
    url = manager_url(job_dir)
    wait_running(url, min_step=3)
    first = _zygote(launcher.pid, url)
    # The status names it (an operator's and the soak's way to find it: its forks share its command line).
    wait_for(lambda: status(url)["nodes"][0]["zygote_pid"] == first, 60, "the status naming the zygote")
    ranks = {r["rank"]: r["pid"] for r in status(url)["ranks"]}
    os.kill(first, signal.SIGKILL)  # no rank dies with it
    second = _zygote(launcher.pid, url, other_than=first)  # replaced in the background
    time.sleep(0.5)
    assert all(alive(pid) for pid in ranks.values()), "a rank died with its zygote"
    assert {r["rank"]: r["pid"] for r in status(url)["ranks"]} == ranks
    os.kill(second, signal.SIGSTOP)
    reap.append(second)
    os.kill(ranks[1], signal.SIGKILL)  # its exit is the agent's to see, whatever the zygote does
    killed_at = time.time()
    wait_for(lambda: any(i["rank"] == 1 for i in status(url)["incidents"]), 10, "the crash of rank 1 seen")
    seen = time.time() - killed_at
    assert launcher.wait(timeout=150) == 0, (tmp_path / "job.log").read_text()[-3000:]
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(baseline, run)
    assert comparison.identical and comparison.lost_steps == 0, comparison.reasons
    assert [(i["kind"], i["rank"], i["status"]) for i in run.incidents] == [("crash", 1, "recovered")], run.incidents
    assert seen < 3.0, f"the crash was seen {seen:.1f}s after the kill"  # (a second, plus the API round trips)
    assert not alive(second), "the stopped zygote was left behind"
    log = (tmp_path / "job.log").read_text()
    assert "the zygote exited" in log and "the zygote is stopped" in log


SPAWNER = textwrap.dedent("""
    import os, subprocess, sys, time
    import undying
    from pathlib import Path
    # The demo's own training, after leaving two processes of its own: one in a session of its own,
    # one in a process group of its own; each writes its PID where the test finds it.
    out = Path(os.environ["SPAWN_OUT"])
    rank = os.environ["RANK"]
    if not (out / f"group-{rank}").exists():  # (a replacement rank starts none)
        for how in ("session", "group"):
            kw = {"start_new_session": True} if how == "session" else {"process_group": 0}
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], **kw)
            (out / f"{how}-{rank}").write_text(str(child.pid))
    sys.argv[0] = os.environ["TRAIN"]
    exec(compile(open(os.environ["TRAIN"]).read(), os.environ["TRAIN"], "exec"))
""")


def test_what_a_rank_starts_outlives_neither_its_kill_nor_the_job(tmp_path: Path, reap: list[int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from undying.demo import TRAIN_SCRIPT

    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    monkeypatch.setenv("SPAWN_OUT", str(out))
    monkeypatch.setenv("TRAIN", str(TRAIN_SCRIPT))
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, ["--epochs", "2", "--step-seconds", "0.08"], ranks=2, script=script,
                         reap=reap, run_args=["--spares", "0"])
    url = manager_url(job_dir)
    wait_running(url, min_step=2)
    pids = {f.name: int(f.read_text()) for f in wait_for(lambda: len(list(out.iterdir())) == 4 and list(
        out.iterdir()), 30, "the ranks' children")}
    reap.extend(pids.values())
    assert all(alive(p) for p in pids.values())
    rank1 = next(r["pid"] for r in status(url)["ranks"] if r["rank"] == 1)
    os.kill(rank1, signal.SIGKILL)
    wait_for(lambda: not alive(pids["session-1"]) and not alive(pids["group-1"]), 10,
             "rank 1's own-session and own-group children to go with it")
    assert alive(pids["session-0"]) and alive(pids["group-0"])  # rank 0 lives: so do its children
    assert launcher.wait(timeout=150) == 0, (tmp_path / "job.log").read_text()[-3000:]
    assert not alive(pids["session-0"]) and not alive(pids["group-0"]), "outlived the job"


ENDINGS = textwrap.dedent("""
    import os, runpy, threading, time
    # The DDP tutorial's script, unchanged (examples/tutorial_plain.py): 4 gloo ranks, DDP(Linear(20, 1)),
    # a snapshot, destroy_process_group(), then main() returns and gloo's teardown runs.
    tutorial = runpy.run_path(os.environ["TUTORIAL"])
    tutorial["main"](1, 1, 32, os.environ["SNAPSHOT"])
    rank = int(os.environ["RANK"])
    if rank == 3:  # a thread that never ends, no daemon: this process's exit would wait for it forever
        threading.Thread(target=threading.Event().wait, name="never-ends").start()
    if rank == 0:  # works on after the others exited, four times the exit grace: never touched
        began = time.monotonic()
        while time.monotonic() - began < 4:
            sum(range(10000))
        open(os.environ["DONE"], "w").write("done")
""")


def test_how_ranks_end_the_tutorial_ends_a_stuck_exit_is_ended_late_work_is_not(
        tmp_path: Path, reap: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The tutorial's teardown never hangs (workers forked from the zygote, the default); a rank stuck in its
    exit after its script returned is ended after --exit-grace, its stack in the log, the job's result
    standing; a rank still working after the others exited is not touched."""
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "endings.py"
    script.write_text(ENDINGS)
    monkeypatch.setenv("TUTORIAL", str(root / "examples" / "tutorial_plain.py"))
    monkeypatch.setenv("SNAPSHOT", str(tmp_path / "snapshot.pt"))
    monkeypatch.setenv("DONE", str(tmp_path / "done"))
    job_dir = tmp_path / "job"
    launcher = start_job(job_dir, [], ranks=4, script=script, reap=reap,
                         run_args=["--spares", "0", "--exit-grace", "1"])
    assert launcher.wait(timeout=150) == 0, (tmp_path / "job.log").read_text()[-3000:]
    log = (tmp_path / "job.log").read_text()
    assert (tmp_path / "done").read_text() == "done"
    stuck = events(job_dir / "events.db", "exit_stuck")
    assert len(stuck) == 1 and stuck[0]["exit_grace_s"] == 1, stuck
    assert "rank 3 (pid" in log and "its script returned, but the process was still in its exit 1s later" in log
    assert "(most recent call first)" in log and "threading.py" in log, log[-3000:]  # its threads' stacks
    assert not events(job_dir / "events.db", "exit_after_return")
