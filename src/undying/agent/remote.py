"""An agent whose manager runs on another host: ``undying run --nnodes N --node-rank I --manager
HOST:PORT``.

The agent is the same one a standalone run uses; only its link to the manager
changes. Its reports travel as messages on one TCP connection, and the
manager's commands come back on it. When the connection breaks, the node's
workers train on (the manager is only needed to recover), the agent keeps
what it has to report (``reports.py``: numbered, each kept until the manager's
log holds it) and connects again with its session; a restarted
manager takes it back from its log. If the manager instead declared this node
lost meanwhile, the agent is fenced: it kills its workers and joins afresh.

A warm standby (``undying run --standby``) joins with no node: the manager
parks it (``StandbyParked``), it starts its zygote and enough spares for a
node's ranks and beats (``StandbyBeat``). When a node is lost the manager
welcomes it as that node on the same connection; from then on it is that
node's agent, and the lost ranks' replacements start on its warm spares.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from pathlib import Path

from undying.agent import hangup
from undying.agent.agent import Agent
from undying.agent.commands import NodeCommands, report_state
from undying.agent.netif import gloo_interface_env
from undying.agent.node_signals import NodeSignals
from undying.agent.reports import ManagerClient
from undying.checkpoint.mac import key_from_token
from undying.config import JobConfig
from undying.inputs import check_address
from undying.protocol.codec import Handlers, Message
from undying.protocol.env import CHECKPOINT_KEY_ENV, HOST_NAME_ENV, STORE_KEY_ENV
from undying.protocol.judge_clock import JudgeClock
from undying.protocol.node_wire import (
    Acked,
    AgentFenced,
    AgentJoin,
    AgentRefused,
    AgentWelcome,
    JobEnded,
    ManagerBeat,
    NodeLeaving,
    StandbyBeat,
    StandbyJoin,
    StandbyParked,
    decode_to_agent,
    encode,
)
from undying.protocol.store_wire import store_key_from_token
from undying.protocol.worker_wire import TraceSet

__all__ = ["NodeRunner", "run_node", "parse_manager_address", "SESSION_MESSAGES", "JOIN_ANSWERS",
           "ManagerLost"]

log = logging.getLogger("undying.agent.remote")

_STATE_EVERY_S = 0.5
# What the manager's line says of the session itself (every other message is a command:
# agent/commands.py), and what answers a join (read by ``_session`` and ``_park`` before any other
# line).
SESSION_MESSAGES = (ManagerBeat, Acked, AgentRefused, AgentFenced, JobEnded)
JOIN_ANSWERS = (AgentWelcome, StandbyParked)
_STANDBY = -1  # a standby's node number (in its logs) until the manager gives it one
_EXIT_SIGTERM = 143


def parse_manager_address(address: str) -> tuple[str, int]:
    return check_address("--manager", address)  # (the one rule of an address: undying.inputs)


class ManagerLost(Exception):
    """The manager stayed unreachable past ``manager_lost_s``: its node is taken as lost (Slurm's
    first node; ``launch/slurm_node.py`` resumes the job elsewhere)."""


class _Fenced(Exception):
    pass


class _Refused(Exception):
    pass


class _Ended(Exception):
    def __init__(self, ended: JobEnded) -> None:
        super().__init__(ended.reason)
        self.ended = ended


def _refused(message: AgentRefused) -> None:
    raise _Refused(message.reason)


def _fenced(message: AgentFenced) -> None:
    raise _Fenced(message.reason)


def _ended(message: JobEnded) -> None:
    raise _Ended(message)


class NodeRunner:
    """One node of a multi-node job: the agent, its connection to the manager, and its signals."""

    def __init__(self, config: JobConfig, script: str, script_args: list[str], manager: str,
                 token: str, *, job_dir_given: bool = True, standby: bool = False,
                 manager_lost_s: float | None = None) -> None:
        self.config = config
        # A manager joined once, then unreachable this long: ManagerLost (None: exit 1 as below)
        self._manager_lost_s = manager_lost_s
        self._joined = False
        self._job_dir_given = job_dir_given
        self.manager_host, self.manager_port = parse_manager_address(manager)
        self.token = token
        self.client = ManagerClient()
        # A standby has no node until the manager gives it a lost one (``_park``).
        self.node = _STANDBY if standby else config.node_rank
        self._standby = standby
        extra_env = {
            # its workers sign and check checkpoints
            CHECKPOINT_KEY_ENV: key_from_token(token).hex(),
            STORE_KEY_ENV: store_key_from_token(token).hex(),  # and reach the job's stores
            **gloo_interface_env(self.manager_host, self.node),
        }
        # A stop signal here: the node's leaving, or the job's preemption reaching it.
        self.signals = NodeSignals(lambda: self.node, self._leave_now, self.client.send)
        self.agent = Agent(config, node=self.node, script=script, script_args=script_args,
                           report=self.signals.worker_report, control_port=0,
                           manager_host=self.manager_host,
                           extra_env=extra_env,
                           # a standby keeps enough warm spares for a whole node's ranks
                           spares=max(config.spares, config.nproc_per_node) if standby else None)
        # the manager's commands, one table
        self.commands = NodeCommands(self.agent, self.client.send)
        self.session = ""
        self._last_beat = 0.0  # monotonic: the manager's last line
        # Its manager silent or unreachable: judged only over time this agent ran
        # (protocol/judge_clock.py).
        heartbeat_s = config.timeouts.heartbeat_timeout
        self.clock = JudgeClock(min(0.2, heartbeat_s / 5), heartbeat_s, "this agent")
        self._leaving: str = ""
        self._leave = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._commands = self._session_handlers()

    async def run(self) -> int:
        # (a standby's agent waits for its zygote at start: its spares are forked from it)
        await self.agent.start(join_first=not self._standby)
        loop = asyncio.get_running_loop()
        # (cancelled with the others at the end)
        self._tasks.add(loop.create_task(self.clock.keep_ticking()))
        # SIGHUP and SIGQUIT as SIGTERM: this node leaves (agent.hangup); an ignored one stays so
        unhandle = hangup.handle_on(loop, hangup.handle, self.config.job_dir, self._on_signal)
        try:
            return await self._serve()
        finally:
            unhandle()
            self.signals.close()
            hangup.after_the_job(self.config.job_dir)
            for task in list(self._tasks):
                task.cancel()
            self.commands.cancel()
            await self.agent.stop_all(self.config.timeouts.stop_grace)
            await self.agent.close()

    def _on_signal(self, sig: signal.Signals, detached: Path | None = None) -> None:
        if self._leaving:
            return
        if detached is not None:  # (SIGHUP: the terminal is gone; where the rest goes)
            log.warning("node %d: %s", self.node,
                        hangup.hangup_line(sig, detached, "judged as a SIGTERM"))
        self.signals.signalled(sig)  # the node leaves, unless the job is being preempted

    def _leave_now(self, sig: signal.Signals) -> None:
        if self._leaving:
            return
        self._leaving = f"{sig.name} to the agent of node {self.node}"
        log.warning("node %d: %s", self.node,
                    hangup.hangup_line(sig, None, "this node leaves the job"))
        self.client.send(NodeLeaving(self.node, self._leaving, time.time()))
        self._leave.set()

    async def _serve(self) -> int:
        """Connect, serve the manager, connect again after a break; until the job ends or this node
        leaves."""
        offline_since = time.monotonic()
        while True:
            if self._leaving:
                await self._flush_leaving()
                return _EXIT_SIGTERM
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.manager_host, self.manager_port,
                                            limit=16 * 1024 * 1024), 5.0)
            except (OSError, asyncio.TimeoutError) as e:
                if (code := self._given_up(offline_since, "unreachable", e)) is not None:
                    return code
                await self._sleep_or_leave(0.5)
                continue
            try:
                await self._session(reader, writer)
                offline_since = max(offline_since, self._last_beat)  # its last word
            except _Refused as e:
                log.error("node %d: the manager refused this agent: %s", self.node, e)
                return 2
            except _Fenced as e:
                log.warning("node %d: fenced: %s", self.node, e)
                self.client.new_session()
                await self.agent.stop_all(0.0)
                self.agent.resume_after_stop()
                self.session = ""
                offline_since = time.monotonic()
            except (ConnectionError, OSError, asyncio.TimeoutError, ValueError) as e:
                # A manager stopped for good (SIGSTOP) still accepts connections, in its
                # listener's queue, and never answers: judged by its silence, as unreachable.
                if (code := self._given_up(offline_since, "silent", e)) is not None:
                    return code
                log.warning("node %d: the connection to the manager failed (%s: %s); "
                            "connecting again", self.node, type(e).__name__, e)
                await self._sleep_or_leave(0.5)
            except _Ended as e:
                ended = e.ended
                log.warning("node %d: the job %s: %s", self.node, ended.state, ended.reason)
                return ended.exit_code
            finally:
                self.client.disconnected()
                writer.close()

    def _given_up(self, offline_since: float, how: str, error: BaseException) -> int | None:
        """None: try again. Past the bound since the manager's last word: this node's exit code,
        or ManagerLost (under Slurm, a manager joined before and now unreachable: its node is
        taken as lost; one that answers no more is a stopped one, which its launcher ends)."""
        lost_s = self._manager_lost_s if self._joined and how == "unreachable" else None
        bound = lost_s or self.config.timeouts.rendezvous_timeout
        if self.clock.silent_s(max(offline_since, self._last_beat)) <= bound:
            return None
        where = f"the manager at {self.manager_host}:{self.manager_port} stayed {how} for"
        if lost_s:
            raise ManagerLost(f"{where} {lost_s:.0f}s ({error})") from error
        log.error("node %d: %s %.0fs (%s); stopping", self.node, where, bound, error)
        return 1

    async def _sleep_or_leave(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._leave.wait(), seconds)

    async def _flush_leaving(self) -> None:
        """Say we leave (if the manager can be reached at all), then the finally stops the
        workers."""
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            if self.client.writer is None and self.session and self.client.has_kept():
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.manager_host, self.manager_port), 2.0)
                writer.write(encode(self._join_message()))
                self.client.connected(writer, 0)
                await asyncio.wait_for(writer.drain(), 2.0)
                writer.close()

    def _join_message(self) -> AgentJoin:
        return AgentJoin(
            job_id=self.config.job_id, node=max(self.node, 0), nnodes=self.config.nnodes,
            nproc_per_node=self.config.nproc_per_node, token=self.token, session=self.session,
            pid=os.getpid(), host=os.environ.get(HOST_NAME_ENV) or socket.gethostname(),
            config=self.config.to_dict(),
            live={str(r): pid for r, pid in self.agent.live_pids().items()}, t=time.time(),
        )

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        join = self._join_message()
        writer.write(encode(StandbyJoin(join) if self.node == _STANDBY else join))
        # (never longer than this agent waits for its manager at all)
        line = await asyncio.wait_for(reader.readline(),
                                      min(30.0, self.config.timeouts.rendezvous_timeout))
        if not line:
            raise ConnectionError("the manager closed the connection")
        reply = decode_to_agent(line)
        self._joined = self._joined or isinstance(reply, JOIN_ANSWERS)
        if isinstance(reply, StandbyParked):
            welcome = await self._park(reply, reader, writer)
            if welcome is None:
                return  # the connection broke, or this agent leaves
            reply = welcome
        if not isinstance(reply, AgentWelcome):
            self._commands.handle(reply)  # a refusal or a fence raises
            raise ConnectionError(f"unexpected first reply {reply!r:.200}")
        resumed = self.session == reply.session
        self.session = reply.session
        self._follow(reply.control_port, reply.job_dir, reply.trace)
        kept = self.client.connected(writer, reply.acked)
        log.warning("node %d: %s the manager at %s:%d (session %s%s)", self.node,
                    "back with" if resumed else "joined", self.manager_host, self.manager_port,
                    reply.session, f", {kept} reports kept while away sent" if kept else "")
        self._last_beat = time.monotonic()
        beat = asyncio.ensure_future(report_state(self.agent, self.client.send, _STATE_EVERY_S))
        leave = asyncio.ensure_future(self._leave.wait())
        try:
            while True:
                read = asyncio.ensure_future(reader.readline())
                done, _ = await asyncio.wait({read, leave}, timeout=self._silence_limit(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if leave in done:
                    read.cancel()
                    self.client.flush()  # NodeLeaving, made in this pass
                    await asyncio.wait_for(writer.drain(), 2.0)
                    return
                if read not in done:
                    read.cancel()
                    if (silent := self.clock.silent_s(self._last_beat)) > self._silence_limit():
                        log.warning("node %d: no word from the manager for %.1fs; connecting again",
                                    self.node, silent)
                        return
                    continue
                line = read.result()
                if not line:
                    log.warning("node %d: the manager closed the connection; connecting again",
                                self.node)
                    return
                self._last_beat = time.monotonic()
                command = decode_to_agent(line)
                self.signals.heard(command)  # a Preempt: the job's stop reached this node
                self._commands.handle(command)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            log.warning("node %d: connection to the manager failed (%s); connecting again",
                        self.node, e)
        finally:
            beat.cancel()
            leave.cancel()

    def _follow(self, control_port: int, job_dir: str, trace: TraceSet | None) -> None:
        """What the manager says of the job: the control store's port, the job dir, the trace
        switch."""
        # Without --job-dir, one job dir for the job (a shared filesystem): the manager's, where it
        # looks for checkpoints.
        self.agent.follow(control_port, "" if self._job_dir_given else job_dir)
        if trace is not None:
            self.agent.set_trace(trace)

    async def _park(self, parked: StandbyParked, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> AgentWelcome | None:
        """A standby: spares warm, beating, until the manager gives it a node (the welcome
        returned).

        None: the connection broke or went silent (the caller connects again and
        parks again), or the agent leaves. The job's end or a refusal raise.
        """
        self._follow(parked.control_port, parked.job_dir, parked.trace)
        self.agent.keep_spares()
        log.info("standby: parked at the manager at %s:%d; warming %d spare(s)", self.manager_host,
                 self.manager_port, self.agent.spares.want)
        self._last_beat = time.monotonic()
        beat = asyncio.ensure_future(self._beat_parked(writer))
        leave = asyncio.ensure_future(self._leave.wait())
        try:
            while True:
                read = asyncio.ensure_future(reader.readline())
                done, _ = await asyncio.wait({read, leave}, timeout=self._silence_limit(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if leave in done or read not in done:
                    read.cancel()
                    if (leave in done
                            or self.clock.silent_s(self._last_beat) > self._silence_limit()):
                        return None
                    continue
                line = read.result()
                if not line:
                    return None
                self._last_beat = time.monotonic()
                message = decode_to_agent(line)
                if isinstance(message, AgentWelcome):
                    self._become(message.node)
                    return message
                if not isinstance(message, ManagerBeat):
                    # the job's end or a refusal raises; nothing else is for a standby
                    self._commands.handle(message)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            log.warning("standby: the connection to the manager failed (%s); connecting again", e)
            return None
        finally:
            beat.cancel()
            leave.cancel()

    async def _beat_parked(self, writer: asyncio.StreamWriter) -> None:
        while not writer.is_closing():
            writer.write(encode(StandbyBeat(self.agent.spares_ready(), time.time())))
            await asyncio.sleep(_STATE_EVERY_S)

    def _become(self, node: int) -> None:
        """The standby is node ``node`` now: its ranks, its reports and its spares go by that
        number."""
        log.info("standby: the manager gave this agent node %d (a lost node's); "
                 "its ranks start on the warm spares", node)
        self.node = node
        self.config = dataclasses.replace(self.config, node_rank=node)
        self.agent.become(node)

    def _silence_limit(self) -> float:
        return self.config.timeouts.heartbeat_timeout

    def _session_handlers(self) -> Handlers[object]:
        """What the agent does with each line of its manager: the session's own words here, commands
        in ``commands``."""
        return Handlers[object]({
            ManagerBeat: lambda message: None,  # (only counts as word from it)
            Acked: lambda message: self.client.acked(message.seq),
            AgentRefused: _refused,
            AgentFenced: _fenced,
            JobEnded: _ended,
        }, otherwise=self._command)

    def _command(self, message: Message) -> None:
        if type(message) in self.commands.table:
            self.commands.handle(message)
        else:
            log.warning("node %d: unexpected command %r", self.node, message)


def run_node(config: JobConfig, script: str, script_args: list[str], manager: str, token: str,
             *, job_dir_given: bool = True, standby: bool = False,
             manager_lost_s: float | None = None) -> int:
    """Run this node's agent until the job ends (its exit code) or the node leaves (143).

    ``standby``: join as a warm standby with no node, until the manager gives it a lost one.
    ``manager_lost_s``: a manager this agent joined once, then unreachable this long, raises
    ManagerLost (its workers stopped first), rather than ending the agent with 1 after the
    rendezvous timeout (which still bounds the wait for the first join).
    """
    config.validate()
    return asyncio.run(NodeRunner(config, script, script_args, manager, token,
                                  job_dir_given=job_dir_given, standby=standby,
                                  manager_lost_s=manager_lost_s).run())

