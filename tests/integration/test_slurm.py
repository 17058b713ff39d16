"""undying under a real Slurm cluster (slurmctld + one slurmd per node, each node a network
namespace): `srun undying run` with no other flag, and what is refused.

The cluster is tests/slurm_cluster.py; it skips, with the reason, where the machine cannot run
one (not root, no namespaces, no slurm-wlm/munge).
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.oracle import Oracle
from tests.slurm_cluster import SlurmCluster, slurm_unavailable_reason, wait_for
from undying.demo import TRAIN_SCRIPT
from undying.demo.oracle import RunRecord, compare_runs, load_run, merge_runs
from undying.jobfiles.events import LogReader, read_job

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(slurm_unavailable_reason() is not None,
                                 reason=str(slurm_unavailable_reason()))]

# 64 steps of ~0.1 s on 2 nodes x 1 rank (a small job: 2 cores run the whole cluster): a crash at
# step 12 lands mid-run.
SCRIPT_ARGS = ["--epochs", "2", "--samples", "512", "--step-seconds", "0.1"]
UNDYING = [sys.executable, "-m", "undying"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path / "slurm", nodes=2) as made:
        yield made


def test_srun_undying_run_needs_no_other_flag_and_survives_a_rank_crash(
        cluster: SlurmCluster, tmp_path: Path, oracle: Oracle) -> None:
    work = tmp_path / "work"
    work.mkdir()
    srun = cluster.popen(
        ["srun", "-N2", "--ntasks-per-node=1", *UNDYING, "run", "-n", "1", str(TRAIN_SCRIPT),
         *SCRIPT_ARGS], cwd=work, env=cluster.job_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        job_dir = work / "undying-jobs" / "slurm-1"
        wait_for("job dir", lambda: (job_dir / "token").exists(), 60)
        inject = cluster.run([*UNDYING, "inject", "crash", "--rank", "1", "--at-step", "12",
                              "--job-dir", str(job_dir)], check=False, cwd=work, env=cluster.job_env())
        assert inject.returncode == 0, inject.stdout + inject.stderr
        out, _ = srun.communicate(timeout=240)
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait(10)
    text = out.decode(errors="replace")
    assert srun.returncode == 0, text[-4000:]
    # What the launchers read from Slurm, in their first lines.
    assert "Slurm job 1, node 0 of 2 (n0), manager on n0 (here)" in text, text[-4000:]
    assert "Slurm job 1, node 1 of 2 (n1), manager on n0;" in text, text[-4000:]
    # The job dir is the documented default, private to the user.
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    baseline = oracle.baseline(SCRIPT_ARGS, ranks=2)
    run = load_run(job_dir / "events.db")
    comparison = compare_runs(baseline, run)
    assert comparison.identical, (comparison.reasons, text[-4000:])
    assert comparison.lost_steps == 0 and not run.rerun_steps
    job = read_job(job_dir / "events.db")
    crashed = [i for i in job["incidents"] if i.get("kind") == "crash"]
    assert [i["rank"] for i in crashed] == [1], json.dumps(job["incidents"])[:2000]


def _batch(cluster: SlurmCluster, folder: Path, body: str, *, nodes: int = 1) -> str:
    """Submit ``body`` as a batch script, wait for its end, return its output."""
    script = folder / "job.sh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    out = folder / "job.out"
    r = cluster.run(["sbatch", "--parsable", "-N", str(nodes), "--ntasks-per-node=2", "-o",
                     str(out), str(script)],
                    cwd=folder, env=cluster.job_env())
    job = r.stdout.strip().split(";")[0]
    wait_for(f"end of batch job {job}", lambda: cluster.squeue(job) == "" and out.exists(), 90)
    return out.read_text(errors="replace")


def test_outside_a_step_or_with_several_tasks_a_node_it_is_refused_saying_what_to_write(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    run = f"{' '.join(UNDYING)} run -n 1 {TRAIN_SCRIPT} --epochs 1 --samples 64"
    text = _batch(cluster, tmp_path, f"{run}; echo exit=$?\n"
                  f"srun -N1 --ntasks-per-node=2 {run}; echo exit=$?")
    lines = text.splitlines()
    shell = [line for line in lines if "not in an srun step" in line]
    assert shell and "srun --ntasks-per-node=1 undying run" in shell[0], text
    assert "--standalone" in shell[0], text
    tasks = [line for line in lines if "tasks on a node" in line]
    assert tasks and "-n RANKS_PER_NODE" in tasks[0], text
    assert lines.count("exit=2") == 2, text
    assert not (tmp_path / "undying-jobs").exists(), os.listdir(tmp_path)


# 64 steps of ~0.1 s on 2 ranks: preempted at step 10 or a little later (and at 30), requeued,
# resumed.
LONG_ARGS = ["--epochs", "2", "--samples", "1024", "--step-seconds", "0.1"]


def _launches(job_dir: Path) -> RunRecord:
    """Every launch of a job that was requeued, oldest first, as one record."""
    older = sorted(job_dir.glob("events.*.db"), key=lambda p: p.stat().st_mtime)
    merged = load_run(older[0]) if older else load_run(job_dir / "events.db")
    for db in [*older[1:], job_dir / "events.db"] if older else []:
        merged = merge_runs(merged, load_run(db))
    return merged


def test_the_written_batch_script_preempted_both_ways_requeues_and_resumes_identically(
        cluster: SlurmCluster, tmp_path: Path, oracle: Oracle) -> None:
    """The batch script `undying slurm` writes, submitted as it is, stopped twice:

    - `scancel --signal=TERM` (as a preemption and the time limit do) reaches every process of
      the job's steps, agents and workers too, not only the manager: the job is preempted (each
      node stays for the gasp rather than leave), requeues itself and resumes;
    - `scancel --batch --signal=TERM` (as `--signal=B:TERM@T` does) reaches the batch shell alone,
      whose trap passes it on: the same.

    The three starts' losses are the fault-free run's, no step run twice."""
    work = tmp_path / "work"
    work.mkdir()
    made = subprocess.run(
        [*UNDYING, "slurm", "--nodes", "2", "-n", "1", "--undying", " ".join(UNDYING),
         "--", str(TRAIN_SCRIPT), *LONG_ARGS], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    script = made.stdout.replace("#SBATCH --output=undying-%j.out",
                                 f"#SBATCH --output={work}/slurm-%j.out")
    script = script.replace("srun_pid=$!", "srun_pid=$!\necho restart=${SLURM_RESTART_COUNT:-0}")
    script = script.replace('exit "$code"', 'echo srun-exit=$code\nexit "$code"')
    job = cluster.submit(work, script)
    job_dir = work / "undying-jobs" / f"slurm-{job}"
    out = work / f"slurm-{job}.out"

    def said() -> str:
        return out.read_text(errors="replace") if out.exists() else ""

    for restart, (at, signal_it) in enumerate([(10, ["scancel", "--signal=TERM", job]),
                                                (30, ["scancel", "--batch", "--signal=TERM", job])],
                                               start=1):
        # (from the job's log, as the first-node test reads it: a status call can take seconds)
        wait_for(f"step {at}", lambda at=at: SlurmCluster.logged_step(job_dir) >= at, 120)
        this_start = said().split(f"restart={restart - 1}")[-1]  # (the file holds every start's)
        assert "srun-exit=" not in this_start, f"the job ended before its signal: {said()[-2000:]}"
        cluster.run(signal_it)
        wait_for(f"requeue {restart}", lambda restart=restart: f"restart={restart}" in said(), 120)
    wait_for("the job's end", lambda: "srun-exit=0" in said(), 180)
    text = said()
    assert text.count("requeueing Slurm job") == 2 and text.count("exit 75") >= 2, text[-6000:]
    # Each node heard each SIGTERM, and stayed for the job's gasp rather than leave.
    assert text.count("this node stays for") == 4, text[-6000:]
    assert not re.search(r"this node leaves the job$", text, re.M), text[-6000:]
    assert "fenced" not in text, text[-6000:]
    merged = _launches(job_dir)
    comparison = compare_runs(oracle.baseline(LONG_ARGS, ranks=2), merged)
    assert comparison.identical and comparison.lost_steps == 0 and not merged.rerun_steps, (
        comparison.reasons, text[-6000:])


@pytest.fixture
def cluster3(tmp_path: Path) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path / "slurm", nodes=3) as made:
        yield made


def _with_a_spare_node(cluster: SlurmCluster, work: Path) -> tuple[str, Path]:
    """A 2-node job with a third node as its warm standby (`--spare-nodes 1`), at step 10."""
    run = " ".join([*UNDYING, "run", "-n", "1", "--spare-nodes", "1", "--heartbeat-timeout",
                    "3", str(TRAIN_SCRIPT), *LONG_ARGS])
    job = cluster.submit(work, f"""#!/bin/bash
#SBATCH -N3 --ntasks-per-node=1 --no-kill -o {work}/slurm-%j.out
srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 {run}
echo srun-exit=$?
""")
    job_dir = work / "undying-jobs" / f"slurm-{job}"
    # (from the job's log: a status call can take seconds on a loaded machine, and the fault
    # must land while the job has steps to go)
    wait_for("step 10", lambda: SlurmCluster.logged_step(job_dir) >= 10, 120)
    return job, job_dir


def _trained_on(cluster: SlurmCluster, work: Path, job: str, job_dir: Path,
                oracle: Oracle) -> str:
    out = work / f"slurm-{job}.out"
    wait_for("the job's end", lambda: "srun-exit=" in (out.read_text() if out.exists() else ""),
              180)
    text = out.read_text(errors="replace")
    with LogReader(job_dir / "events.db") as reader:  # (the banner names the standby from the start)
        promoted = [e.data["host"] for e in reader.events("standby_promoted")]
    assert promoted == ["n2"], (promoted, text[-5000:])
    comparison = compare_runs(oracle.baseline(LONG_ARGS, ranks=2), load_run(job_dir / "events.db"))
    assert comparison.identical and comparison.lost_steps == 0, (comparison.reasons, text[-5000:])
    return text


def test_a_lost_node_s_ranks_start_on_the_spare_node_of_the_allocation(
        cluster3: SlurmCluster, tmp_path: Path, oracle: Oracle) -> None:
    """`sbatch --no-kill`: node n1 (its slurmd and every process on it) is lost; the job's
    third node, a warm standby, takes its ranks and the job trains on, identical."""
    work = tmp_path / "work"
    work.mkdir()
    job, job_dir = _with_a_spare_node(cluster3, work)
    cluster3.kill_node(1)
    _trained_on(cluster3, work, job, job_dir, oracle)
    run = load_run(job_dir / "events.db")
    assert run.state == "succeeded", run.state
    assert [i["kind"] for i in run.incidents if i["status"] == "recovered"], run.incidents


def test_a_sigterm_to_one_node_s_processes_alone_is_that_node_leaving(
        cluster3: SlurmCluster, tmp_path: Path, oracle: Oracle) -> None:
    """Not the job's preemption: node n1's launcher and ranks get SIGTERM (slurmd does not);
    the node leaves, the standby takes its ranks, no gasp, the job trains on identically."""
    work = tmp_path / "work"
    work.mkdir()
    job, job_dir = _with_a_spare_node(cluster3, work)
    for pid in cluster3.hosts.pids(2):  # host 2 is node n1
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"slurm" not in command:
            os.kill(pid, signal.SIGTERM)
    text = _trained_on(cluster3, work, job, job_dir, oracle)
    assert re.search(r"node 1: SIGTERM: this node leaves the job$", text, re.M), text[-5000:]
    # The node left while the job had steps to go (no preemption), and the standby took its rank.
    incidents = read_job(job_dir / "events.db")["incidents"]
    assert [(i["kind"], i["status"]) for i in incidents] == [("node-loss", "recovered")], (
        incidents, text[-5000:])
    assert incidents[0]["step"] < 64, (incidents, text[-5000:])


def _processes(cluster: SlurmCluster, host: int) -> str:
    """Each process of ``host``: its state, where the kernel has it waiting, its command line."""
    lines = []
    for pid in cluster.hosts.pids(host):
        proc = Path(f"/proc/{pid}")
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (proc / "wchan").read_text()
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
        lines.append(f"{pid} {state} {wchan or '-'} {command}")
    return "\n".join(lines)


def _what_happened(cluster: SlurmCluster, job: str, job_dir: Path) -> str:
    """For a failed wait: the survivor's processes, its lines in the job dir, the job as Slurm
    has it, and the controller's and the survivor's slurmd's last lines."""
    said_there = job_dir / "launcher.log"
    shown = cluster.run(["scontrol", "show", "job", "--oneliner", job], check=False, timeout=30)
    return "\n".join([
        f"the survivor's processes:\n{_processes(cluster, 2)}",
        f"launcher.log:\n{said_there.read_text() if said_there.exists() else '(none)'}",
        f"scontrol show job: {shown.stdout.strip()[:1500]} {shown.stderr.strip()[:300]}",
        f"slurmctld:\n{cluster.log('slurmctld')[-2500:]}",
        f"slurmd n1:\n{cluster.log('slurmd-n1')[-2500:]}"])


def test_losing_the_first_node_requeues_the_job_which_resumes_from_its_newest_checkpoint(
        cluster3: SlurmCluster, tmp_path: Path, oracle: Oracle) -> None:
    """Node n0 (the manager's, and the batch shell's) is lost: its slurmd and every process on
    it SIGKILLed. The survivor judges the manager lost, stops its rank, ends with 74 and requeues
    the job; Slurm starts it again on the two nodes left, and it resumes from its newest
    periodic checkpoint. Every logged loss is the fault-free run's and the final states are
    bit-identical; only the steps after that checkpoint run again (about --save-every at most);
    the restart count is in the log and status."""
    work = tmp_path / "work"
    work.mkdir()
    save_every = 5
    # (--heartbeat-timeout 10: the survivor judges its manager only over time it ran itself, and
    # a tick gap past half its window is a stall of its own that starts the count again; at 3 s,
    # a 2-core machine loaded by the suite's other jobs kept restarting the 20 s count)
    run = " ".join([*UNDYING, "run", "-n", "1", "--heartbeat-timeout", "10", "--save-every",
                    str(save_every), str(TRAIN_SCRIPT), *LONG_ARGS])
    job = cluster3.submit(work, f"""#!/bin/bash
#SBATCH -N2 --ntasks-per-node=1 --no-kill --requeue --open-mode=append -o {work}/slurm-%j.out
echo restart=${{SLURM_RESTART_COUNT:-0}} nodes=$SLURM_JOB_NODELIST
srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 {run}
echo srun-exit=$?
""")
    job_dir = work / "undying-jobs" / f"slurm-{job}"
    out = work / f"slurm-{job}.out"

    def said() -> str:
        return out.read_text(errors="replace") if out.exists() else ""

    # (read from the job's log here, not by `undying status`: a loaded machine made each status
    # call seconds long, and once the whole 6 s job had ended before its node was lost)
    wait_for("step 12", lambda: SlurmCluster.logged_step(job_dir) >= 12, 120)
    cluster3.kill_node(0)
    assert "srun-exit=" not in said() and SlurmCluster.logged_step(job_dir) < 64, (
        f"the job ended before its first node was lost: {said()[-2000:]}")
    try:
        wait_for("the requeue", lambda: "restart=1" in said(), 120)
    except TimeoutError as e:
        # (three times in CI under load: what the survivor said, and what Slurm did, to see why)
        raise AssertionError(f"{e}; {_what_happened(cluster3, job, job_dir)}\n{said()[-3000:]}") from e
    wait_for("the job's end", lambda: "srun-exit=" in said().split("restart=1")[-1], 180)
    text = said()
    assert "srun-exit=0" in text.split("restart=1")[-1], text[-6000:]
    assert "restart=1 nodes=n[1-2]" in text, text[-6000:]  # not on the lost node
    # The survivor's one line, and its requeue, in the job dir (its srun was on the lost node);
    # the next start says it was requeued.
    said_there = (job_dir / "launcher.log").read_text()
    assert re.search(r"node 1: the manager at n0:\d+ stayed unreachable for 20s .*: its node "
                     r"\(n0\) is taken as lost; this node ends with 74", said_there), said_there
    assert f"node 1: requeueing Slurm job {job} (requeue 1 of at most 20)" in said_there, said_there
    assert f"Slurm job {job}, requeued 1x, node 0 of 2 (n1)" in text, text[-6000:]
    # Resumed from the newest periodic checkpoint (a multiple of save_every): every step the job
    # logged has the fault-free run's loss, and the final states are bit-identical.
    resumed = re.search(r"resuming from checkpoint \S+/step-0*(\d+) \(step (\d+), periodic\)",
                        text)
    assert resumed is not None and resumed[1] == resumed[2], text[-6000:]
    checkpoint = int(resumed[1])
    assert checkpoint % save_every == 0, checkpoint
    merged = _launches(job_dir)
    comparison = compare_runs(oracle.baseline(LONG_ARGS, ranks=2), merged)
    assert comparison.steps == 64 and comparison.digests_equal, (comparison, text[-6000:])
    assert not comparison.mismatched_steps, comparison
    # Run again: the steps after that checkpoint that the first launch had completed (the oracle
    # counts them as lost work), fewer than save_every or, where the kill came while the newest
    # was being written, than twice that. Missing from the record: steps the first launch
    # completed up to its checkpoint whose commits its manager, killed with the node, had not yet
    # written to its log (they ran once; the checkpoint holds them).
    (first_log,) = job_dir.glob("events.*.db")
    logged = max(load_run(first_log).losses)
    assert merged.rerun_steps == list(range(checkpoint + 1, logged + 1)), (merged, checkpoint)
    assert comparison.lost_steps == len(merged.rerun_steps) < 2 * save_every, comparison
    assert comparison.missing_steps == list(range(logged + 1, checkpoint + 1)), (comparison, logged)
    facts = read_job(job_dir / "events.db")["job"]
    assert facts["state"] == "succeeded", facts["state"]
    with LogReader(job_dir / "events.db") as reader:
        started = [e.data for e in reader.events("slurm_job")]
    assert started == [{"job_id": job, "restarts": 1}], started
    status = cluster3.run([*UNDYING, "status", "--job-dir", str(job_dir), "--json"],
                          env=cluster3.job_env(), timeout=30)
    assert json.loads(status.stdout)["slurm"] == {"job_id": job, "restarts": 1}, status.stdout
    shown = cluster3.run([*UNDYING, "status", "--job-dir", str(job_dir)], env=cluster3.job_env(),
                         timeout=30)
    assert f"Slurm job {job} requeued 1x" in shown.stdout, shown.stdout
