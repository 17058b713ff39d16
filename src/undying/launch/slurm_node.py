"""One node of an ``srun undying run`` job: the first node also runs the manager.

Every node runs the same command. The step's first node starts ``undying manager`` as a
child process (the job's manager, as a multi-node job has one, listening at the node's own
address), then every node, that one included, joins it as an agent.

The job's token and keys are in the job dir, which the manager makes private to the user
(0700): a token derived from the job id or from the environment would be readable by other
users (``squeue``, ``scontrol show job``). So every other node waits, bounded, for
``<job dir>/token`` to appear; the token seen from another node is also the proof that the
job dir is on a filesystem every node shares. Not seen in time: one line that says which of
the two it may be.

A job preempted (exit 75, or 74 with an older checkpoint) puts itself back in Slurm's queue
(``requeue``), where its allocation allows it, and says so or says how to resume.

The first node lost (its host gone, and the manager with it): the job is requeued and resumes
from its newest checkpoint; the manager is not moved to a survivor (the workers' stores are
pinned to its host). Each surviving node's agent judges the manager lost once it stayed
unreachable for ``manager_lost_after`` (longer than a restarted manager takes to listen again),
stops its ranks, says so in one line and ends with 74 ("resume me; steps after the newest
checkpoint run again"); the lowest surviving node asks for the requeue first (each waits
``REQUEUE_STAGGER_S`` a node rank before it asks, and the requeue ends every node of the job).
Slurm keeps the requeued job completing until it marks the lost node down (``SlurmdTimeout``),
and places it on other nodes then.

The manager child is supervised: killed by a signal while the job runs (the OOM killer, a
stray ``kill``), it is started again on the same job dir, and carries the job on from its log
as a restarted manager does; the agents reconnect. Stopped (SIGSTOP, a debugger), the job waits
for it, and a SIGCONT carries the job on; stopped for ``MANAGER_STOPPED_LIMIT`` (counted only
while this launcher runs: a whole job suspended by ``scontrol suspend`` is no stop of it), it is
ended, and the job with it, in one line, rather than holding the allocation forever. At the
job's end the node's exit code is the manager's (the job's), and no manager outlives its node's
launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from undying.agent.hangup import open_launcher_log
from undying.config.exits import EXIT_PREEMPTED, EXIT_PREEMPTED_BEHIND
from undying.config.timeouts import Timeouts
from undying.errors import UsageError
from undying.jobfiles.tokens import TOKEN_FILE, check_shared_token
from undying.launch.slurm import SlurmStep
from undying.procfs import process_state
from undying.protocol.judge_clock import JudgeClock

__all__ = ["ManagerChild", "listen_address", "manager_lost", "manager_lost_after", "requeue",
           "run_slurm_node", "wait_for_token"]

log = logging.getLogger("undying.slurm")

TOKEN_WAIT = 120.0  # the first node's manager is up in seconds; a shared filesystem shows it
MANAGER_END_WAIT = 60.0  # after this node's agent ended: the manager's last words (the summary)
MAX_MANAGER_RESTARTS = 3
# A manager stopped this long (SIGSTOP kept) is ended, and the job with it: the agents' own bound
# for a manager they cannot reach (--rendezvous-timeout's default).
MANAGER_STOPPED_LIMIT = 300.0
WATCH_EVERY = 0.5  # how often the launcher looks at its manager child
DEFAULT_MAX_REQUEUES = 20  # a job preempted this often in a row without ending is looping
SCONTROL_TIMEOUT = 30.0
# A controller that does not answer a requeue is asked again (restarting, failing over, busy).
REQUEUE_ATTEMPTS = 3
REQUEUE_RETRY_S = 5.0
# The manager unreachable this long (at least; two heartbeat timeouts when longer, at most the
# rendezvous timeout): its node is lost. A manager killed alone is started again at once by its
# launcher and listens again in seconds.
MANAGER_LOST_FLOOR_S = 20.0
# The first node lost: node k asks for the requeue after k x this (a lower survivor asks first,
# and its requeue ends this node too), at most REQUEUE_STAGGER_MAX_S.
REQUEUE_STAGGER_S = 3.0
REQUEUE_STAGGER_MAX_S = 60.0
_RESTARTS = re.compile(r"\bRestarts=(\d+)\b")


def listen_address(node: str) -> str:
    """Where the manager listens: the address ``node`` (this host's Slurm name) resolves to.

    A name that resolves to loopback (Debian maps the host's own name to 127.0.1.1) or not at
    all: every interface (0.0.0.0), which other nodes reach; the token guards it as always.
    """
    try:
        infos = socket.getaddrinfo(node, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return "0.0.0.0"
    addresses = [str(info[4][0]) for info in infos]
    usable = [a for a in addresses if not a.startswith("127.")]
    return usable[0] if usable else "0.0.0.0"


def wait_for_token(job_dir: Path, timeout: float, alive: Callable[[], str | None]) -> None:
    """Until ``<job_dir>/token`` exists, then checked as the first node's manager writes it
    (``check_shared_token``: the user's own job dir and file, no link, nobody else's writes);
    UsageError after ``timeout``, when ``alive()`` says why it never will (the manager exited),
    or when another user may have made the token."""
    path = job_dir / TOKEN_FILE
    deadline = time.monotonic() + timeout
    while not os.path.lexists(path):  # (a link to nowhere is refused below, not waited for)
        why = alive()
        if why is not None:
            raise UsageError(why)
        if time.monotonic() > deadline:
            raise UsageError(
                f"no {path} after {timeout:g}s: the job dir is not on a filesystem every node "
                "shares, or the first node's manager did not start (see its output); pass "
                "--job-dir with a folder every node sees")
        time.sleep(0.2)
    check_shared_token(job_dir)


class ManagerChild:
    """The job's manager, a child of the first node's launcher, started again if killed, ended
    if stopped for good."""

    def __init__(self, argv: list[str], *,
                 stopped_limit: float = MANAGER_STOPPED_LIMIT) -> None:
        self.argv = argv
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.stopped_limit = stopped_limit
        self.gave_up = ""  # why the manager was ended (stopped for good); "" while it is not
        self._ending = threading.Event()
        self._watch: threading.Thread | None = None
        # the launcher judges its manager's stop: only over time the launcher itself ran
        self._clock = JudgeClock(WATCH_EVERY, stopped_limit, "this node's launcher")

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv)
        self._watch = threading.Thread(target=self._supervise, name="manager-child", daemon=True)
        self._watch.start()

    def exited(self) -> str | None:
        """Why the manager will never write the token (it exited), or None while it runs."""
        process = self.process
        if self.gave_up:
            return self.gave_up
        if process is None or process.poll() is None or self.restarts:
            return None
        return f"the job's manager exited ({process.returncode}) before it started; see its output"

    def _supervise(self) -> None:
        self._clock.start()
        stopped_since: float | None = None
        while not self._ending.is_set():
            process = self.process
            assert process is not None
            try:
                code = process.wait(timeout=WATCH_EVERY)
            except subprocess.TimeoutExpired:
                self._clock.tick()
                stopped_since = self._watch_stop(process, stopped_since)
                if self.gave_up:
                    return
                continue
            stopped_since = None
            if self._ending.is_set() or code >= 0 or self.restarts >= MAX_MANAGER_RESTARTS:
                return
            self.restarts += 1
            log.warning("the job's manager was killed (signal %d); starting it again (%d of %d)",
                        -code, self.restarts, MAX_MANAGER_RESTARTS)
            self.process = subprocess.Popen(self.argv)

    def _watch_stop(self, process: subprocess.Popen[bytes],
                    since: float | None) -> float | None:
        """One look at a running manager: stopped, since when (None: it runs); ended when it was
        stopped ``stopped_limit`` by this launcher's own clock."""
        state = process_state(process.pid)
        if state not in STOPPED_STATES:
            if since is not None:
                log.warning("the job's manager (pid %d) continues after %.0fs stopped",
                            process.pid, time.monotonic() - since)
            return None
        if since is None:
            log.warning("the job's manager (pid %d) is stopped (%s); the job waits for it: "
                        "`kill -CONT %d` carries it on; still stopped after %gs, it is ended "
                        "and the job with it", process.pid, STOPPED_STATES[state], process.pid,
                        self.stopped_limit)
            return time.monotonic()
        stopped_s = self._clock.silent_s(since)
        if stopped_s < self.stopped_limit:
            return since
        self.gave_up = (
            f"the job's manager (pid {process.pid}) stayed stopped for {stopped_s:.0f}s "
            f"({STOPPED_STATES[state]}); ended, and the job with it: every node stops as it finds "
            "the manager gone, and a new start resumes from the newest checkpoint. To pause a "
            "job, suspend all of it (scontrol suspend) or preempt it (scancel --signal=TERM: "
            "the dying gasp, exit 75)")
        log.error("%s", self.gave_up)
        process.kill()  # (a stopped process dies of SIGKILL too)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        return since

    def finish(self, agent_code: int) -> int:
        """After this node's agent ended: the manager's exit code (the job's); none outlives
        us."""
        process = self.process
        assert process is not None
        try:
            code = process.wait(timeout=MANAGER_END_WAIT)
        except subprocess.TimeoutExpired:
            log.warning("the job's manager did not end %gs after this node's agent; stopping "
                        "it", MANAGER_END_WAIT)
            self.stop()
            return agent_code
        finally:
            self._ending.set()
        if self.gave_up:
            return agent_code or 1
        return code if code >= 0 else agent_code

    def stop(self) -> None:
        self._ending.set()
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGCONT)  # a stopped manager takes its SIGTERM now
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


# The states of /proc/<pid>/stat a process makes no progress in until someone continues it.
STOPPED_STATES = {"T": "SIGSTOP", "t": "held by a debugger"}


def manager_argv(step: SlurmStep, job_id: str, job_dir: str, port: int,
                 verbose: bool) -> list[str]:
    return [sys.executable, "-m", "undying", *(["-v"] if verbose else []), "manager",
            "--job-id", job_id, "--job-dir", job_dir, "--host", listen_address(step.nodes[0]),
            "--port", str(port)]


def manager_lost_after(timeouts: Timeouts) -> float:
    """Seconds the manager may stay unreachable before a node takes the first node as lost."""
    return min(timeouts.rendezvous_timeout,
               max(MANAGER_LOST_FLOOR_S, 2 * timeouts.heartbeat_timeout))


def run_slurm_node(step: SlurmStep, job_id: str, job_dir: str, port: int, *, verbose: bool,
                   join: Callable[[], int], max_requeues: int = DEFAULT_MAX_REQUEUES) -> int:
    """This node's part: the manager first (on the first node), then ``join()``, the agent."""
    from undying.agent.remote import ManagerLost  # (the agent's: loaded by join() in any case)

    manager: ManagerChild | None = None
    if step.node_rank == 0:
        manager = ManagerChild(manager_argv(step, job_id, job_dir, port, verbose))
        manager.start()
    try:
        wait_for_token(Path(job_dir), TOKEN_WAIT, manager.exited if manager else lambda: None)
        code = join()
    except ManagerLost as e:
        if manager is not None:
            manager.stop()
        return manager_lost(step, job_id, job_dir, str(e), max_requeues)
    except BaseException as e:
        if manager is not None:
            manager.stop()
        if step.node_rank > 0:
            _say(job_dir, f"job {job_id}: node {step.node_rank}: ended by {type(e).__name__}: "
                          f"{str(e)[:300]}")
        raise
    if step.node_rank > 0 and code != 0:
        # (its output goes through srun on the first node, which may be gone with it)
        _say(job_dir, f"job {job_id}: node {step.node_rank}: this node's agent ended with {code}")
    if manager is not None:
        code = manager.finish(code)
        if code in (EXIT_PREEMPTED, EXIT_PREEMPTED_BEHIND):
            log.warning("job %s: %s", job_id, requeue(step, max_requeues))
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    return code


def manager_lost(step: SlurmStep, job_id: str, job_dir: str, why: str, max_requeues: int) -> int:
    """The job's manager is lost with its node: this node's ranks are stopped; the lowest surviving
    node requeues the job, which resumes from its newest checkpoint. 74: resume me.

    The lines are also appended to ``<job dir>/launcher.log``: this node's output goes through
    ``srun``, which ran on the lost first node (the batch host) and is gone with it.
    """
    _say(job_dir, f"job {job_id}: node {step.node_rank}: {why}: its node ({step.nodes[0]}) is "
                  f"taken as lost; this node ends with {EXIT_PREEMPTED_BEHIND}, and the job "
                  "resumes from its newest checkpoint")
    # (a lower node that survived asks first: its requeue ends this node, asleep or not)
    time.sleep(min(step.node_rank * REQUEUE_STAGGER_S, REQUEUE_STAGGER_MAX_S))
    prefix = f"job {job_id}: node {step.node_rank}: "
    _say(job_dir, prefix + requeue(step, max_requeues, lambda line: _say(job_dir, prefix + line)))
    return EXIT_PREEMPTED_BEHIND


def _say(job_dir: str, line: str) -> None:
    """``line`` logged, and appended to ``<job dir>/launcher.log`` (0600, never through a link)."""
    log.warning("%s", line)
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    try:
        fd = open_launcher_log(job_dir)
    except OSError:
        return  # (the job dir unwritable: the log line stands alone)
    with contextlib.suppress(OSError), os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(f"[undying {time.strftime('%H:%M:%S')} WARNING] {line}\n")


def _scontrol(*argv: str) -> subprocess.CompletedProcess[str] | str:
    """``scontrol ARGV``'s result, or why it did not run (not found, or no answer in time)."""
    try:
        return subprocess.run(["scontrol", *argv], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"no answer from scontrol in {SCONTROL_TIMEOUT:g}s"
    except OSError as e:
        return f"scontrol did not run: {e}"


def _failure(result: subprocess.CompletedProcess[str] | str) -> str | None:
    """Why an scontrol call failed, or None when it did not."""
    if isinstance(result, str):
        return result
    if result.returncode == 0:
        return None
    return result.stderr.strip()[:200] or f"exit {result.returncode}"


def requeue(step: SlurmStep, max_requeues: int,
            say: Callable[[str], None] | None = None, *,
            attempts: int = REQUEUE_ATTEMPTS, pause_s: float = REQUEUE_RETRY_S) -> str:
    """After a preemption, or the first node lost: put the job back in Slurm's queue, where it may
    be; what happened (``say``: where the line before the ask goes; the log by default).

    Slurm requeues a job that exits 75 only where its admin set ``RequeueExit=75``; the job
    asks for it itself instead (``scontrol requeue``), when its allocation allows requeueing
    (``sbatch --requeue``, or the cluster's default) and it was requeued fewer than
    ``max_requeues`` times, and no other node requeued it meanwhile (Slurm's ``Restarts``). The
    next start resumes from the dying gasp, or the newest checkpoint, in the job dir. A requeue
    ends every process of the job at once, this one included: the line that says so is logged
    before it is asked for.

    A controller that does not answer (restarting, failing over, too busy) is asked again,
    ``attempts`` times ``pause_s`` apart: the job's only way back into the queue is this call. Each
    try looks at ``Restarts`` first, so a requeue that was done but whose answer was lost is not
    asked for twice.
    """
    resume = "to resume, submit the same batch script again (it continues from the job dir)"
    if step.restart_count >= max_requeues:
        return (f"not requeued: Slurm job {step.job_id} was requeued {step.restart_count} "
                f"times (--max-requeues {max_requeues}); {resume}")
    failed = ""
    asked = False  # a requeue was sent whose answer did not come back
    for attempt in range(attempts):
        if attempt:
            (say or log.warning)(f"{failed}; asking Slurm again in {pause_s:g}s "
                                 f"(try {attempt + 1} of {attempts})")
            time.sleep(pause_s)
        shown = _scontrol("show", "job", "--oneliner", step.job_id)
        if (why := _failure(shown)) is not None:
            failed, asked = f"cannot ask Slurm about job {step.job_id} ({why})", False
            continue
        assert not isinstance(shown, str)
        restarts = _RESTARTS.search(shown.stdout)
        if restarts is not None and int(restarts.group(1)) > step.restart_count:
            if asked:  # (ours: its answer was lost)
                return f"requeued Slurm job {step.job_id}"
            return (f"not requeued again: Slurm job {step.job_id} was requeued already "
                    f"(Restarts={restarts.group(1)}); it resumes from the job dir")
        if "Requeue=1" not in shown.stdout.split():
            return (f"not requeued: Slurm job {step.job_id} does not allow it (sbatch --requeue); "
                    f"{resume}")
        if not asked:
            (say or log.warning)(
                f"requeueing Slurm job {step.job_id} (requeue {step.restart_count + 1} of at "
                f"most {max_requeues}); its next start resumes from the job dir")
        with contextlib.suppress(OSError):
            sys.stderr.flush()
        if (why := _failure(_scontrol("requeue", step.job_id))) is None:
            return f"requeued Slurm job {step.job_id}"
        failed, asked = f"scontrol requeue {step.job_id} failed ({why})", True
    return f"not requeued: {failed}, {attempts} tries; {resume}"


def slurm_line(step: SlurmStep, job_id: str, *, standby: bool = False) -> str:
    """The launcher's first line under Slurm: what it read, so a wrong layout shows at once."""
    restarts = f", requeued {step.restart_count}x" if step.restart_count else ""
    role = " (a warm standby)" if standby else ""
    return (f"job {job_id}: Slurm job {step.job_id}{restarts}, node {step.node_rank} of "
            f"{step.nnodes} ({step.nodes[step.node_rank]}){role}, manager on {step.nodes[0]}"
            f"{' (here)' if step.node_rank == 0 else ''}; pid {os.getpid()}")
