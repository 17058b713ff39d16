"""``undying manager``: the manager on its own (a process, or a pod), agents on other hosts.

It listens for agents on its port. The first agent's flags make the job (the
world size, timeouts, checkpoint and trace settings); every later agent must
agree with them, carry the job's token and take a free node rank, or it is
refused with the reason. Once every node joined, generation 0 opens.

A manager started on the job dir of a job whose manager died mid-run carries
the job on: it reads the generation, ranks, incidents and commits back from
the SQLite log, serves the control store on the same port again, and takes
back the agents that reconnect with their sessions. The workers never needed
it to train; only a recovery does.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from undying.agent.hangup import handle_on
from undying.cli.progress_show import ProgressShow
from undying.config import JobConfig, ManagerOptions, Timeouts
from undying.errors import UsageError
from undying.jobfiles.events import read_job_table
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.records import JobState
from undying.jobfiles.tokens import where_the_token_is
from undying.launch.manager_host import JobFiles, ManagerHost, exit_code
from undying.launch.slurm import slurm_facts
from undying.manager import heap
from undying.manager.checkpoints import resume_line
from undying.manager.http import tokens_match
from undying.manager.manager import Manager
from undying.manager.nodes import AgentServer, JobFacts
from undying.protocol.node_wire import AgentJoin, JobEnded

__all__ = ["ManagerOptions", "serve_manager"]

log = logging.getLogger("undying.launch.manager_service")


class _Gate:
    """Decides who may join: the token, the job, a node rank in range, and flags like the first
    agent's."""

    def __init__(self, options: ManagerOptions, token: str) -> None:
        self.options = options
        self.token = token
        # (None until ``bind``: the first agent's flags make the job)
        self.config: JobConfig | None = None
        # why no new ranks there ("": they may come)
        self.host_out: Callable[[str], str] = lambda host: ""

    def bind(self, config: JobConfig, host_out: Callable[[str], str]) -> None:
        """The job the first agent's flags made, and why a host gets no new ranks (the manager's
        hosts): from now on every join is checked against them. Known only once the manager
        exists."""
        self.config = config
        self.host_out = host_out

    def __call__(self, join: AgentJoin) -> str:
        if not tokens_match(join.token, self.token):
            return ("wrong or missing token: pass the job's token with --token-file or "
                    f"UNDYING_TOKEN ({where_the_token_is(self.options.job_dir)})")
        if join.job_id != self.options.job_id:
            return (f"this manager runs job {self.options.job_id!r}, "
                    f"the agent is for job {join.job_id!r}; "
                    f"pass --job-id {self.options.job_id}")
        config = self.config
        if config is None:
            if not 0 <= join.node < join.nnodes:
                return (f"--node-rank {join.node} is outside 0..{join.nnodes - 1} "
                        f"(--nnodes {join.nnodes})")
            return ""
        if join.nnodes != config.nnodes or join.nproc_per_node != config.nproc_per_node:
            return (f"the job has --nnodes {config.nnodes} and "
                    f"--nproc-per-node {config.nproc_per_node}; "
                    f"this agent has {join.nnodes} and {join.nproc_per_node}")
        if not 0 <= join.node < config.nnodes:
            return (f"--node-rank {join.node} is outside 0..{config.nnodes - 1} "
                    f"(--nnodes {config.nnodes})")
        try:
            theirs = JobConfig.from_dict(join.config)
        except UsageError as e:
            return str(e)
        differ = config.differences(theirs)
        if differ:
            return ("this agent's flags differ from the job's in " + ", ".join(differ)
                    + "; every node must pass the same `undying run` flags")
        # (a node's agent coming back is let in)
        if not join.session and (out := self.host_out(join.host)):
            return out
        return ""


def _resumable(job_dir: JobDir, job_id: str) -> tuple[bool, str]:
    """A log of this job whose manager stopped before the job ended: carry it on (not one of an
    earlier Slurm launch: SLURM_RESTART_COUNT changed). And why a log that is there is not carried
    on, said once the manager listens (a refusal stays one line)."""
    if not job_dir.events_db.exists():
        return False, ""
    try:
        job = read_job_table(job_dir.events_db)
    except Exception as e:  # a damaged log is no job to carry on; the new run says so
        return False, (f"job dir {job_dir.path}: its event log cannot be read ({e}); starting a "
                       "new job")
    state = job.get("state", "")
    resumable = (job.get("job_id") == job_id and state in ("running", "recovering")
                 and "config" in job)
    slurm = slurm_facts(os.environ)
    if resumable and slurm is not None and job.get("slurm", slurm) != slurm:
        # Slurm requeued the job (its first node was lost): a new launch, which resumes from the
        # newest checkpoint; the log's agents and ranks are gone with the old allocation.
        return False, (f"job dir {job_dir.path}: its log is of Slurm job {slurm['job_id']}'s "
                       "launch before its latest requeue, now gone; this launch resumes from the "
                       "newest checkpoint")
    return resumable, ""


async def _serve(options: ManagerOptions) -> int:
    looked = JobDir(Path(options.job_dir))
    restart, unreadable = (_resumable(looked, options.job_id) if looked.path.is_dir()
                           else (False, ""))
    files = JobFiles.open(looked.path, keep_log=restart)
    job_dir = files.job_dir
    gate = _Gate(options, files.token)
    prior = read_job_table(job_dir.events_db) if restart else {}
    prior_timeouts = prior.get("config", {}).get("timeouts", {})
    heartbeat = float(prior_timeouts.get("heartbeat_timeout", Timeouts.heartbeat_timeout))
    # Which of each node's reports the log holds (a restart's, from its log): the agents resend the
    # rest.
    acked = {int(n): int(seq) for n, seq in prior.get("acked", {}).items()}
    server = AgentServer(options.host, options.port, gate, heartbeat_s=heartbeat, acked=acked,
                         max_connections=options.connections.cap,
                         join_wait_s=options.connections.http_header_timeout)
    try:
        await server.start()
    except OSError as e:
        raise UsageError(f"cannot listen for agents on {options.host}:{options.port} "
                         f"({e.strerror or e}); pass another --port") from e
    if unreadable:
        log.warning("%s", unreadable)
    log.warning("manager of job %s listening for agents on %s:%d, token from %s%s",
                options.job_id, options.host, server.port, files.token_from,
                " (carrying on the job from its log)" if restart else "")
    if restart:
        config = JobConfig.from_dict(prior["config"])
    else:
        first = await server.first_join()
        config = JobConfig.from_dict(first.config)
    config = JobConfig(**{**config.__dict__, "job_id": options.job_id,
                          "job_dir": str(job_dir.path), "host": options.host,
                          "port": server.port + 1, "http_port": options.http_port,
                          "node_rank": 0, "connections": options.connections})
    config.validate()
    events = files.event_log()
    # Which of each node's reports the log holds commits with them: a restarted manager asks for the
    # rest.
    events.before_flush(lambda: events.set_job("acked", server.positions()))
    if (slurm := slurm_facts(os.environ)) is not None:  # its Slurm job, and Slurm's requeues
        events.set_job("slurm", slurm)
        events.event("slurm_job", job_id=slurm["job_id"], restarts=slurm["restarts"])
    try:
        hosted = ManagerHost(config, files, events, restoring=restart)
    except BaseException:
        await server.close()
        job_dir.clear_manager()
        raise
    manager = hosted.manager
    # (the book is replaced on a restore)
    gate.bind(config, lambda host: manager.core.hosts.refusal(host))
    # A node moved (undying migrate --node, drain) goes to a standby. (Allowed in test_architecture:
    # the migrations, in manager/placement, take no constructor argument for it yet.)
    manager.migrations.server = server
    try:
        server.bind(JobFacts(manager, config.nnodes, config.timeouts.heartbeat_timeout,
                             hosted.control_port, str(job_dir.path),
                             known_sessions=hosted.known_sessions,
                             # no standby on a drained host
                             blocked_hosts=lambda: manager.core.hosts.blocked_hosts()))
        for slot in server.slots.values():
            manager.add_agent(slot)
        url = await hosted.serve_api(open_status=options.open_status, agent_port=server.port)
        log.warning("job %s: %d nodes x %d ranks, API at %s, job dir %s", config.job_id,
                    config.nnodes, config.nproc_per_node, url, job_dir.path)
        return await _run(manager, server, config, restart,
                          ProgressShow(manager.status, url, options.progress_every))
    finally:
        await server.close()
        await hosted.close()


async def _run(manager: Manager, server: AgentServer, config: JobConfig, restart: bool,
               shown: ProgressShow) -> int:
    loop = asyncio.get_running_loop()
    interrupted: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        interrupted.append(sig)
        # Ctrl-\: what it was doing first (as agent.hangup does), never a core dump
        if sig == signal.SIGQUIT:
            faulthandler.dump_traceback(all_threads=True)
        # SIGHUP (its terminal closed) and SIGQUIT are SIGTERM, as for a launcher
        if sig != signal.SIGINT:
            manager.preempt(f"{sig.name} to the manager")
        else:
            manager.stop(f"stopped by {sig.name} to the manager")

    # What ends `undying manager` in order: SIGINT stops the job, the others preempt it
    # (agent.hangup's rule); one ignored at start stays so (nohup)
    unhandle = handle_on(loop, on_signal)
    # (the live line on a terminal, else a line every --progress-every seconds; agents show none)
    shown.start()
    try:
        if restart:
            waiting = asyncio.ensure_future(
                _lose_absent_nodes(server, config.timeouts.heartbeat_timeout))
        else:
            waiting = asyncio.ensure_future(_wait_for_nodes(manager, server, config))
        try:
            final = await manager.run(restored=restart, ready=waiting)
        except UsageError as e:
            # the job cannot start as asked (another job's checkpoint): every node hears why
            await _tell_nodes(server, JobEnded(JobState.FAILED.value, str(e), 2))
            raise
        finally:
            waiting.cancel()
    finally:
        shown.close()
        unhandle()
    code = exit_code(manager, final, interrupted[0] if interrupted else None)
    # the last line: what the same command resumes from, what it re-runs
    if final is JobState.PREEMPTED:
        log.warning("job %s: %s", config.job_id, resume_line(manager.preemption or {}))
    grace_s = config.timeouts.stop_grace
    await asyncio.gather(*(slot.stop_all(grace_s) for slot in server.slots.values()))
    await _tell_nodes(server, JobEnded(final.value, manager.exit_reason, code))
    return code


async def _tell_nodes(server: AgentServer, ended: JobEnded) -> None:
    """Every attached agent hears how the job ended, and exits with its code (so does every
    standby)."""
    server.standbys.tell_all(ended)
    for slot in server.slots.values():
        slot.send(ended)
        if slot.writer is not None:
            await slot.writer.drain()


async def _wait_for_nodes(manager: Manager, server: AgentServer, config: JobConfig) -> None:
    if config.elastic:
        await _wait_for_enough_nodes(manager, server, config)
        return
    if not await server.all_joined(config.timeouts.rendezvous_timeout):
        joined = sorted(n for n, s in server.slots.items() if s.attached)
        manager.fail(f"only nodes {joined} of {config.nnodes} joined within the rendezvous timeout "
                     f"({config.timeouts.rendezvous_timeout:.0f}s); "
                     "start `undying run --node-rank I --manager ...` on the others")
        raise asyncio.CancelledError


async def _wait_for_enough_nodes(manager: Manager, server: AgentServer, config: JobConfig) -> None:
    """An elastic job (--nnodes MIN:MAX) starts with every node, or with MIN once --node-wait passed
    without more."""
    deadline = time.monotonic() + config.timeouts.rendezvous_timeout
    enough_since = 0.0
    while True:
        joined = sorted(n for n, s in server.slots.items() if s.attached)
        now = time.monotonic()
        if len(joined) >= config.nnodes:
            return
        if len(joined) >= config.fewest_nodes:
            enough_since = enough_since or now
            if now - enough_since >= config.timeouts.node_wait:
                log.warning("job %s: starting on nodes %s (%d of at most %d); "
                            "a node that joins later grows the job",
                            config.job_id, joined, len(joined), config.nnodes)
                return
        elif now > deadline:
            manager.fail(f"only nodes {joined} joined within the rendezvous timeout "
                         f"({config.timeouts.rendezvous_timeout:.0f}s) "
                         f"and the job needs at least {config.fewest_nodes} "
                         f"(--nnodes {config.fewest_nodes}:{config.nnodes}); "
                         "start `undying run --node-rank I --manager ...` on the others")
            raise asyncio.CancelledError
        await asyncio.sleep(0.2)


async def _lose_absent_nodes(server: AgentServer, heartbeat_s: float) -> None:
    """After a restart, a node whose agent does not come back within its heartbeat timeout is
    lost."""
    await asyncio.sleep(heartbeat_s)
    for slot in server.slots.values():
        if not slot.attached and not slot.lost_at:
            server.lose(slot, f"node {slot.node} did not come back within {heartbeat_s:g}s "
                              "of the manager's restart")


def serve_manager(options: ManagerOptions) -> int:
    """Run the manager until its job ends; the exit code says how (as `undying run`'s does)."""
    heap.at_start()
    return asyncio.run(_serve(options))
