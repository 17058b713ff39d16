"""A real Slurm cluster for the tests: Debian's ``slurm-wlm`` and ``munge`` on test hosts.

One controller host and N node hosts, each a network namespace of its own
(``undying.demo.hosts``) with its own address and hostname. ``slurmctld`` runs
on host 0, one ``slurmd`` on each node host; every job step they start lives in
that node's namespaces, so killing a node's host loses the node for real.

What it takes on one machine (learned setting it up; each is a line below):

- ``ip netns exec`` remounts ``/sys``, which hides ``/sys/fs/cgroup`` and makes
  slurmd 22.05 refuse to start: the daemons enter the host's network namespace
  with ``nsenter --net`` and get a mount and UTS namespace of their own
  (``unshare --mount --uts``), where the cluster's hosts file is bound over
  ``/etc/hosts`` (the node names resolve) and the hostname is the node's name.
- ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: no systemd
  or cgroup setup.
- munged runs as user ``munge`` on a socket of this cluster's (``AuthInfo=socket=``),
  so the machine's own munge, if any, is untouched.
- Clients (``sbatch``, ``srun``, ``scancel``) need ``SLURM_CONF``; they run on the
  controller's host through the same wrapper.
- ``AuthInfo=cred_expire=5`` and ``bf_interval=1,sched_interval=1``: a requeued job
  starts again in 6 s, not two minutes. It is also how long each launch's credential lives: a
  slurmd stopped 8 s as a requeued job started failed its launch ("Job credential expired"),
  but the launches of two full suites under load took 0-20 ms, so 5 s is kept;
  ``SlurmdTimeout=10``: a lost node is noticed in about 26 s, not 300; ``KillWait=3``: a requeued job whose batch shell lingers
  (its trap fired again by the requeue's own SIGTERM) is killed after 3 s, not 10 (the
  written-script test: 62 -> 52 s). The gasp is never under it: the tests' SIGTERMs come from
  ``scancel --signal``, which is not followed by a SIGKILL.
- A lost node's processes are all stopped, then killed children first (``Hosts.kill_host``):
  ``srun`` forks a helper that, when ``srun`` dies, SIGKILLs the step's tasks on every node, so
  killed one by one the batch host's ``srun`` and helper took the survivors with them (the
  first-node test failed so in 1 full suite of 3; reproduced at will by killing ``srun`` alone).
  Stopped first but killed in /proc's order, the batch step's slurmstepd died before the batch
  shell, whose process group (the shell, ``srun`` and the helper) the kernel then continued
  (SIGHUP, SIGCONT), with the same end.
- ``SlurmdDebug=verbose``: each task's end in its node's log ("exited with exit code N", "Killed
  by signal 9"): what a test that fails shows of a node whose srun output went with another node.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from undying.demo.hosts import Hosts
from undying.demo.namespaces import NETNS_DIR, netns_unavailable_reason
from undying.errors import UsageError
from undying.jobfiles.events import LogReader

__all__ = ["SlurmCluster", "slurm_unavailable_reason"]

DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "nsenter", "unshare", "runuser")
START_TIMEOUT = 30.0
CONTROLLER = "ctl"


def slurm_unavailable_reason() -> str | None:
    """Why no test cluster can start here, or None."""
    reason = netns_unavailable_reason()
    if reason is not None:
        return reason
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"no Slurm here ({', '.join(missing)} missing): install Debian's slurm-wlm and "
                "munge (.ci/run does, as root)")
    if not Path("/etc/munge/munge.key").exists():
        return "munge has no key (/etc/munge/munge.key): reinstall munge"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no user munge: reinstall munge"
    return None


class SlurmCluster:
    """``nodes`` Slurm nodes named n0..n{nodes-1} (host i + 1), the controller on host 0."""

    def __init__(self, root: Path, nodes: int = 2, *, cpus: int = 2,
                 extra_conf: str = "") -> None:
        reason = slurm_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.nodes = nodes
        self.hosts = Hosts(nodes + 1)
        self.names = [CONTROLLER, *(f"n{i}" for i in range(nodes))]
        self.conf = root / "slurm.conf"
        self.munge_dir = Path(tempfile.mkdtemp(prefix="undying-munge-"))
        os.chmod(self.munge_dir, 0o755)
        self.munge_socket = self.munge_dir / "munge.sock"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []
        try:
            self._write_files(cpus, extra_conf)
            self._start_munge()
            self._daemons["slurmctld"] = self._daemon(0, ["slurmctld", "-D", "-i"])
            for i in range(nodes):
                self.start_node(i)
            self.wait_idle()
        except BaseException:
            self.close()
            raise

    # --- setup -----------------------------------------------------------------------------

    def _write_files(self, cpus: int, extra_conf: str) -> None:
        (self.root / "hosts").write_text(
            "127.0.0.1 localhost\n"
            + "".join(f"{self.hosts.addr(i)} {n}\n" for i, n in enumerate(self.names)))
        state = self.root / "state"
        state.mkdir()
        node_lines = "".join(
            f"NodeName=n{i} NodeAddr={self.hosts.addr(i + 1)} CPUs={cpus} State=UNKNOWN\n"
            for i in range(self.nodes))
        self.conf.write_text(f"""\
ClusterName=undying
SlurmctldHost={CONTROLLER}({self.hosts.addr(0)})
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}
SlurmdSpoolDir={self.root}/spool-%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
ReturnToService=2
SlurmdTimeout=10
SchedulerParameters=bf_interval=1,sched_interval=1
MpiDefault=none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
KillWait=3
SlurmdDebug=verbose
{extra_conf}{node_lines}PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _start_munge(self) -> None:
        # munged (user munge) must reach its folder from /: a folder of its own under the
        # system's temporary folder, not in the caller's (a test's tmp_path is root's alone).
        folder = self.munge_dir
        user = pwd.getpwnam("munge")
        os.chown(folder, user.pw_uid, user.pw_gid)
        self._daemons["munged"] = subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "--foreground",
             f"--socket={self.munge_socket}", f"--pid-file={folder}/munged.pid",
             f"--log-file={folder}/munged.log", f"--seed-file={folder}/seed", "--num-threads=2"],
            stdout=self._log("munged"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not self.munge_socket.exists():
            if self._daemons["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.log('munged')[-2000:]}")
            time.sleep(0.05)

    def _log(self, name: str) -> Any:
        f = open(self.root / f"{name}.out", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(f)
        return f

    def log(self, name: str) -> str:
        """A daemon's output (``munged``, ``slurmctld``, ``slurmd-n0``...)."""
        texts = []
        for path in (self.root / f"{name}.out", self.root / f"{name}.log"):
            if path.exists():
                texts.append(path.read_text(errors="replace"))
        return "\n".join(texts)

    def _wrapped(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` in host ``host``'s network namespace, with its hostname and the hosts file."""
        script = (f"mount --bind {shlex.quote(str(self.root / 'hosts'))} /etc/hosts && "
                  f"hostname {self.names[host]} && exec {shlex.join(argv)}")
        return ["nsenter", f"--net={NETNS_DIR}/{self.hosts.name(host)}", "unshare", "--mount",
                "--uts", "--propagation", "private", "sh", "-c", script]

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def _daemon(self, host: int, argv: list[str]) -> subprocess.Popen[bytes]:
        name = argv[0] if host == 0 else f"{argv[0]}-{self.names[host]}"
        return subprocess.Popen(self._wrapped(host, argv), env=self.env(),
                                stdout=self._log(name), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start_node(self, i: int) -> None:
        """Start node ``i``'s slurmd (again, after :meth:`kill_node`)."""
        self._daemons[f"n{i}"] = self._daemon(i + 1, ["slurmd", "-D", "-N", f"n{i}"])

    def wait_idle(self, timeout: float = START_TIMEOUT) -> None:
        """Until every node is idle (the cluster is up and nothing runs)."""
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            r = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=10)
            states = r.stdout.strip()
            if r.returncode == 0 and states.split() == ["idle"] * self.nodes:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm nodes are not idle after {timeout}s ({states!r}); "
                           f"slurmctld: {self.log('slurmctld')[-2000:]}")

    # --- use --------------------------------------------------------------------------------

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 60,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """A client command (``sbatch``, ``scancel``, ``squeue``...) on the controller's host."""
        r = subprocess.run(self._wrapped(0, argv), env=kwargs.pop("env", self.env()),
                           capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and r.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
        return r

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """A long client command (``srun``) on the controller's host; the caller waits for it."""
        kwargs.setdefault("env", self.env())
        return subprocess.Popen(self._wrapped(0, argv), start_new_session=True, **kwargs)

    def job_env(self) -> dict[str, str]:
        """The env for a job's commands: the test session's without its shared token (the job
        makes and shares its own)."""
        env = self.env()
        env.pop("UNDYING_TOKEN", None)
        return env

    def submit(self, work: Path, script: str) -> str:
        """``script`` written to ``<work>/job.sh`` and submitted from ``work``; the job id."""
        (work / "job.sh").write_text(script)
        r = self.run(["sbatch", "--parsable", str(work / "job.sh")], cwd=work, env=self.job_env())
        return r.stdout.strip().split(";")[0]

    @staticmethod
    def logged_step(job_dir: Path) -> int:
        """The newest step the job's log has, -1 while it has none. Read from the log rather than
        asked of `undying status`: a status call can take seconds on a loaded machine, and a
        test's fault must land while the job has steps to go."""
        try:
            with LogReader(job_dir / "events.db") as reader:
                return reader.newest_step()
        except (OSError, sqlite3.Error, ValueError, UsageError):  # (not made yet, or being made)
            return -1

    def squeue(self, job: str) -> str:
        """The job's state (``RUNNING``, ``PENDING``...), "" once Slurm forgot it."""
        r = self.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False, timeout=10)
        return r.stdout.strip()

    def kill_node(self, i: int) -> None:
        """Lose node ``i``: its slurmd and everything it started stop, then die, as one (the
        host stays). Killed one by one, the batch host's ``srun`` could die a moment before the
        helper it leaves, which then SIGKILLs the step's tasks on every other node."""
        self.hosts.kill_host(i + 1)
        self._daemons.pop(f"n{i}", None)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every daemon and every process in the cluster's hosts; delete the hosts."""
        for proc in list(self._daemons.values()):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._daemons.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._daemons.clear()
        try:
            self.hosts.close()
        finally:
            for f in self._logs:
                f.close()
            shutil.rmtree(self.munge_dir, ignore_errors=True)


def wait_for(what: str, condition: Callable[[], object], timeout: float) -> None:
    """Until ``condition()`` holds; TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise TimeoutError(f"no {what} after {timeout}s")
