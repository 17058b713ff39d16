"""``undying run`` standalone: the manager and the node's agent in one process.

Nothing to install or start beside it: the manager's TCPStore, SQLite log and
HTTP API live in the launcher. Ctrl-C stops the job in order. SIGTERM (what
Kubernetes sends before it deletes a pod) is a preemption: the ranks agree on a
stop step, finish it, rank 0 writes a dying-gasp checkpoint of it, and the
launcher exits with EXIT_PREEMPTED (75); the same command resumes. SIGHUP (the
terminal closed, an ssh session dropped) and SIGQUIT (Ctrl-\\, after a dump of the
launcher's stacks) are the same preemption (``agent.hangup``). When that
dying gasp could not be written, an older checkpoint stands: exit 74, and the
last line says how many steps the resume re-runs. If the
launcher is killed outright, its workers die with it (parent-death signal).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from undying.agent import hangup
from undying.agent.agent import Agent
from undying.agent.commands import NodeCommands, report_state
from undying.agent.netif import interface_for
from undying.checkpoint.mac import key_from_token
from undying.cli.progress_show import ProgressShow
from undying.cli.summary import print_banner, print_end_summary
from undying.config import WHOLE_GROUP_LINE, JobConfig, fit_terminal
from undying.errors import UsageError
from undying.jobfiles.events import read_job_table
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.records import JobState
from undying.launch.in_process import InProcessLine, InProcessReports
from undying.launch.manager_host import JobFiles, ManagerHost, exit_code
from undying.manager import heap
from undying.manager.checkpoints import resume_line
from undying.manager.manager import Manager
from undying.manager.node_reports import NodeReports
from undying.manager.node_slot import NodeSlot
from undying.protocol.env import CHECKPOINT_KEY_ENV, STORE_KEY_ENV
from undying.protocol.store_wire import store_key_from_token
from undying.worker.boot import script_error

__all__ = ["launch"]

log = logging.getLogger("undying.launcher")

# the agent's beat to its manager: live ranks, their phases, spares (as across hosts)
_STATE_EVERY_S = 0.5


def _check_script(script: str, config: JobConfig) -> str | None:
    """A missing or unreadable script is a usage error; one that does not compile is returned, in
    two lines."""
    if config.launch.module:
        if not all(part.isidentifier() for part in script.split(".")):
            raise UsageError(f"-m {script}: not a module name "
                             "(dotted Python identifiers, e.g. pkg.train)")
        return None  # (a module that cannot be imported: the first rank says so, as a script error)
    if config.launch.no_python:
        if shutil.which(script) is None:
            raise UsageError(f"--no-python {script}: no such executable program "
                             "(a path, or a name on PATH)")
        return None
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"training script {script} does not exist; pass the path of a Python file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"training script {script} is not readable; check its permissions")
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as e:
        return script_error(e)
    return None


async def _launch(config: JobConfig, script: str, script_args: list[str],
                  token_file: str | None = None) -> int:
    files = JobFiles.open(Path(config.job_dir), token_file=token_file)
    events = files.event_log()
    events.set_job("command", [script, *script_args])  # what a re-run compares (_already_succeeded)
    hosted = ManagerHost(config, files, events)
    manager, control_port = hosted.manager, hosted.control_port
    try:
        # The node's slot, and the in-process line to its agent (launch/in_process.py): the manager
        # and the agent speak the messages a multi-node job sends over TCP, each table on its own
        # side.
        slot = NodeSlot(config.node_rank)
        to_manager = InProcessReports(NodeReports(lambda: manager, _never_lost), slot)
        agent = Agent(
            config, node=config.node_rank, script=script, script_args=script_args,
            report=to_manager.send, control_port=control_port,
            extra_env=_agent_env(config, files.token),
        )
        commands = NodeCommands(agent, to_manager.send)
        slot.attach_line(InProcessLine(commands.handle), host="localhost", pid=os.getpid(),
                         session="in-process")
        await agent.start()
        manager.add_agent(slot)
        beat = asyncio.ensure_future(report_state(agent, to_manager.send, _STATE_EVERY_S))
        url = await hosted.serve_api(open_status=config.open_status)
    except BaseException:
        manager.close()
        raise
    print_banner(config.job_id, config.job_dir, url, ranks=config.world_size,
                 open_status=config.open_status, token_from=files.token_from)
    log.info("job %s: %d ranks, manager at %s, job dir %s, token from %s", config.job_id,
             config.world_size, url, config.job_dir, files.token_from)
    if not config.step_api:
        say(f"job {config.job_id}: {WHOLE_GROUP_LINE.format(max_restarts=config.max_restarts)}")
    loop = asyncio.get_running_loop()
    interrupted: list[int] = []

    def on_signal(sig: signal.Signals, detached: Path | None) -> None:
        interrupted.append(sig)
        if sig in hangup.PREEMPT_SIGNALS:
            log.warning("job %s: %s", config.job_id,
                        hangup.hangup_line(sig, detached, "preempted, taking the dying gasp"))
            manager.preempt(f"{sig.name} to the launcher")
            return
        log.warning("job %s: %s received, stopping the workers", config.job_id, sig.name)
        manager.stop(f"stopped by {sig.name}")

    # (one ignored at start stays so: nohup)
    unhandle = hangup.handle_on(loop, hangup.handle, config.job_dir, on_signal)
    # (a live line on a terminal, else a line every --progress-every seconds: cli/progress_show.py)
    shown = ProgressShow(manager.status, url, config.launch.progress_every).start()
    try:
        final = await manager.run()
    finally:
        shown.close()  # (what follows prints where the live line was)
        unhandle()
        hangup.after_the_job(config.job_dir)
        await slot.stop_all(config.timeouts.stop_grace)  # (StopNode, answered by NodeStopped)
        beat.cancel()
        commands.cancel()
        slot.detach("the job ended")
        await agent.close()
        await hosted.close()
    # (before the report: its warning or resume line stays the last line)
    print_end_summary(config.job_dir)
    _report(config, manager, final)
    return exit_code(manager, final, signal.Signals(interrupted[0]) if interrupted else None)


def _agent_env(config: JobConfig, token: str) -> dict[str, str]:
    """What this node's processes get beside undying's own: the job's derived keys (its workers sign
    and check checkpoints, and reach the job's stores) and the interface the job listens on."""
    env = {CHECKPOINT_KEY_ENV: key_from_token(token).hex(),
           STORE_KEY_ENV: store_key_from_token(token).hex()}
    # gloo binds the address of the machine's hostname: on one node, keep its connections on the
    # interface the job listens on (loopback by default) unless the user chose one.
    interface = interface_for(config.host)
    if interface is not None:
        env["GLOO_SOCKET_IFNAME"] = interface
    return env


def _never_lost(slot: NodeSlot, reason: str) -> None:
    """(Only an agent across the network leaves its job: this one ends with its launcher.)"""
    log.error("node %d: %s; ignored (the agent is in this process)", slot.node, reason)


def _report(config: JobConfig, manager: Manager, final: JobState) -> None:
    recovered = [i for i in manager.incidents if i.status == "recovered"]
    if final is JobState.SUCCEEDED:
        if manager.status().get("has_steps", True):
            say(f"job {config.job_id} succeeded: {config.world_size} ranks, "
                f"generation {manager.generation}, "
                f"{len(recovered)} incident(s) recovered, "
                f"{len(manager.rerun_steps)} step(s) re-run")
        else:  # (a script that never calls job.steps: its faults restarted the group, no step)
            restarts = len({i.recovery for i in recovered if i.action == "restart"})
            say(f"job {config.job_id} succeeded: {restarts} whole-group restart(s), "
                f"{len(recovered)} incident(s) recovered")
        if any(i.kind == "diverged" for i in manager.incidents):
            # A recovery that did not reproduce the run is not a plain success: the last line says
            # so.
            _, _, warning = manager.exit_reason.partition("; warning: ")
            log.warning("job %s: warning: %s", config.job_id,
                        warning or "the run diverged after a fault")
        health = manager.checkpoint_health
        if health.failures:
            # The last line printed: a success whose saves failed says so, and what it left on disk.
            _, _, warning = manager.exit_reason.partition("; warning: ")
            log.warning("job %s: warning: %s", config.job_id, warning or (
                f"{health.failures} checkpoint save attempt(s) failed during the run "
                f"({health.last_os_error or health.last_error}); "
                "a later one succeeded"))
    elif final is JobState.FAILED:
        # The last line: the reason, quoting the first failure. A traceback it carries is not
        # repeated here: the manager's "failed" line just showed it (the log and status keep it).
        log.error("job %s FAILED: %s", config.job_id, manager.exit_reason.partition("\n")[0])
    elif final is JobState.PREEMPTED:
        log.warning("job %s %s", config.job_id, manager.exit_reason)
        log.warning("job %s: %s", config.job_id, resume_line(manager.preemption or {}))
    else:
        log.warning("job %s stopped: %s", config.job_id, manager.exit_reason)


def say(line: str) -> None:
    """A line the user reads whatever the log level, and no warning: the start and end of a run that
    went well."""
    try:
        sys.stderr.write(fit_terminal(f"[undying {time.strftime('%H:%M:%S')}] {line}",
                                      sys.stderr) + "\n")
        sys.stderr.flush()
    except OSError:
        # a terminal that hung up with no SIGHUP to this process: the line has nowhere to go
        pass


def launch(config: JobConfig, script: str, script_args: list[str],
           token_file: str | None = None) -> int:
    """Run the job to its end; returns the launcher's exit code (``token_file``:
    ``--token-file``)."""
    config.validate()
    broken = _check_script(script, config)
    if broken is not None:  # before any rank, folder or port: the error where it is, and exit 1
        sys.stderr.write(f"undying: error in the training script: {broken}\n")
        return 1
    done = _already_succeeded(config, [script, *script_args])
    if done:
        log.warning("job %s %s; nothing to train. "
                    "Pass --force to train it again, or another --job-id",
                    config.job_id, done)
        return 0
    heap.at_start()  # (the launcher is the job's manager)
    return asyncio.run(_launch(config, script, script_args, token_file))


def _already_succeeded(config: JobConfig, command: list[str]) -> str:
    """How this job (same job id, job dir and command) already ended in success, or "" (then it
    runs).

    Another command (more epochs, say) is the user extending the job: it resumes as before.
    """
    if config.force:
        return ""
    log_path = JobDir(Path(config.job_dir)).events_db
    if not log_path.is_file():
        return ""
    try:
        job = read_job_table(log_path)
    except Exception:  # an unreadable log is no proof of success: the run goes on (and archives it)
        return ""
    if (job.get("state") != "succeeded" or job.get("job_id") != config.job_id
            or job.get("command") != command):
        return ""
    ended = job.get("ended_at")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ended))
            if isinstance(ended, (int, float)) else "earlier")
    return f"already succeeded ({when}, job dir {config.job_dir})"
