"""How the agent starts its workers: forked from a zygote that imported torch once, or fresh interpreters.

Decision (issue #15: the first step after a relaunch within 3 s; a suite under
15 minutes on 2 cores). Every worker and warm spare used to be a fresh
``python -m undying.worker.boot`` that spent about a second of CPU importing
torch, all of them side by side. Now each agent starts one zygote
(``undying.worker.zygote``, with the workers' environment) when it starts;
the zygote imports torch and the worker library once, and forks each worker
on request over a Unix socket pair. The worker is the zygote's child, so:

- the PID the agent holds is the worker's own, and it can be signalled and
  its process group killed as before (the child calls ``setsid``);
- the exit status is the zygote's to collect: it reports it (the real
  ``waitid`` status, -N for a signal as ``Popen`` says it) and keeps the child a
  zombie until the agent has recorded it and answers ``reap``, so a PID is
  never reused while the agent may still signal it (as with its own children);
- a standalone agent waits for its zygote before the job's first generation
  (that is the point); a node of a multi-node job joins its manager first, and
  the ranks it is asked for meanwhile wait for the zygote (agent/remote.py's
  ``_spawn``): started beside it as fresh interpreters, they doubled the CPU of
  every start and regroup on the host for no earlier start (spares wanted
  before it is ready still start fresh);
- a node left with no worker and no spare (a job waiting for nodes, a node
  stopped) lets its zygote go: nothing of the job but the agent runs on the
  host; the next worker wanted starts it again, and starts fresh itself;
- the worker dies with the zygote and the zygote with the agent (parent-death
  signals): no orphans. Should the zygote die on its own, its workers die with
  it (-9, SIGKILL, is what the agent then records for them) and the agent starts
  fresh interpreters from then on; the manager recovers the ranks as from
  any crash.

Not chosen: making the agent a child subreaper with a double fork in the
zygote (workers reparented to the agent, statuses from its own ``waitpid``).
It needs process-wide state in the agent (the launcher's process, which may
host the manager and tests), it adopts every orphaned grandchild, whose
zombies the agent would then have to reap without stealing the statuses of
its other subprocesses.

``UNDYING_WORKER_START``: ``zygote`` (the default) or ``spawn`` (every worker a
fresh interpreter, as before: for a script that needs one). A zygote that
cannot start (no ``pidfd_open``, a thread started by an import, an import
error, not ready within the init timeout), that dies, or that fails a fork
leaves the agent on fresh interpreters; it says so once in its log. A worker
always starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from undying.errors import UsageError
from undying.protocol.codec import Handlers
from undying.protocol.env import ENV_PREFIX
from undying.protocol.zygote_wire import (
    Exit,
    Failed,
    FromZygote,
    Ready,
    Reap,
    Spawn,
    Spawned,
    Unfit,
    encode_frame,
    from_zygote,
)

__all__ = ["START_ENV", "ZygoteProcess", "Zygote", "start_mode"]

log = logging.getLogger("undying.agent")

START_ENV = f"{ENV_PREFIX}WORKER_START"
_MODES = ("zygote", "spawn")
_REPLY_TIMEOUT = 10.0  # a fork takes milliseconds; a zygote silent this long is broken


def start_mode(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    """``zygote`` or ``spawn``, from UNDYING_WORKER_START; anything else is an error that says what to set."""
    value = (os.environ if env is None else env).get(START_ENV, "zygote").strip().lower() or "zygote"
    if value not in _MODES:
        raise UsageError(f"{START_ENV}={value!r}: expected 'zygote' (workers forked from one process that "
                         "imported torch, the default) or 'spawn' (a fresh interpreter per worker)")
    return value


class ZygoteProcess:
    """A worker forked by the zygote, with the interface of the agent's ``PopenProcess``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def _exited(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._done.set_result(returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


class Zygote:
    """The agent's end: starts the zygote, asks it for workers, hears their exits."""

    def __init__(self, node: int) -> None:
        self.node = node
        self._popen: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        self._frames = from_zygote()
        self._children: dict[int, ZygoteProcess] = {}
        # Answers to Spawn by request id: the process forked, or why none was.
        self._replies: dict[int, ZygoteProcess | Failed] = {}
        self._on_frame: Callable[[FromZygote], None] = Handlers[None]({Exit: self._on_exit, Spawned: self._on_spawned, Failed: self._on_failed,
                                   Ready: self._on_ready, Unfit: self._on_ready}).handle
        self._next_id = 0
        self._ready: asyncio.Future[str] | None = None  # "" when ready, else why not
        self.alive = False
        self.reason = ""  # why the agent starts fresh interpreters, once it does
        self._settled = asyncio.Event()  # set once it serves, gave up or was let go

    async def start(self, env: dict[str, str], timeout: float) -> bool:
        """Start the zygote with the workers' environment; True once it imported torch and serves."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-u", "-m", "undying.worker.zygote", str(theirs.fileno()), str(os.getpid())],
                env=env, pass_fds=[theirs.fileno()], start_new_session=True)
        except OSError as e:
            ours.close()
            self._give_up(f"the zygote did not start: {e}")
            return False
        finally:
            theirs.close()
        ours.setblocking(False)
        self._channel = ours
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_readable)
        started = time.monotonic()
        try:
            reason = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except asyncio.TimeoutError:
            reason = f"the zygote was not ready within {timeout:.0f}s (--init-timeout)"
        if reason:
            self._give_up(reason)
            return False
        self.alive = True
        self._settled.set()
        log.info("node %d: worker zygote pid %d ready in %.2fs", self.node, self._popen.pid,
                 time.monotonic() - started)
        return True

    @property
    def pending(self) -> bool:
        """Still importing: not serving, not given up, not let go (a worker wanted now had better wait)."""
        return not self.alive and not self._settled.is_set()

    async def settled(self) -> None:
        """Until the zygote serves, gives up or is let go (``start`` bounds that by the init timeout)."""
        await self._settled.wait()

    def spawn(self, args: list[str], env: dict[str, str], cwd: str) -> ZygoteProcess | None:
        """Fork a worker (called on the loop; blocks for the fork, milliseconds); None: start it fresh."""
        if not self.alive or self._channel is None:
            if not self.reason:
                log.info("node %d: the zygote is not ready yet: this worker starts as a fresh interpreter", self.node)
            return None
        self._next_id += 1
        request = self._next_id
        stdio = [fd for fd in (0, 1, 2) if _is_open(fd)]  # a closed one stays closed in the worker, as with Popen
        frame = encode_frame(Spawn(request, args, env, cwd, stdio))
        try:
            sent = socket.send_fds(self._channel, [frame[:1]], stdio)  # they ride on the frame's first byte
            self._send(frame[sent:])
            reply = self._await_reply(request)
        except (OSError, ValueError) as e:
            self._give_up(f"the zygote's channel failed: {e}")
            return None
        if isinstance(reply, Failed):
            log.warning("node %d: the zygote could not fork a worker (%s); starting it as a fresh interpreter",
                        self.node, reply.error)
            return None
        return reply

    def _send(self, data: bytes) -> None:
        assert self._channel is not None
        view = memoryview(data)
        deadline = time.monotonic() + _REPLY_TIMEOUT
        while view:
            try:
                view = view[self._channel.send(view):]
            except BlockingIOError:
                if not select.select([], [self._channel], [], max(0.0, deadline - time.monotonic()))[1]:
                    raise OSError("the zygote took no bytes for 10s") from None

    def _await_reply(self, request: int) -> ZygoteProcess | Failed | None:
        """Read frames (exits included) until the answer to ``request``."""
        assert self._channel is not None
        deadline = time.monotonic() + _REPLY_TIMEOUT
        while request not in self._replies:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._give_up(f"the zygote did not answer a fork within {_REPLY_TIMEOUT:.0f}s")
                return None
            if select.select([self._channel], [], [], remaining)[0] and not self._read():
                return None
        return self._replies.pop(request)

    def _on_readable(self) -> None:
        self._read()

    def _read(self) -> bool:
        """Take what the zygote said; False when it is gone."""
        channel = self._channel
        if channel is None:
            return False
        try:
            data = channel.recv(1 << 16)
        except BlockingIOError:
            return True
        except OSError as e:
            self._give_up(f"the zygote's channel failed: {e}")
            return False
        if not data:
            self._give_up("the zygote exited" + self._status())
            return False
        try:
            frames = self._frames.feed(data)
        except ValueError as e:
            self._give_up(str(e))
            return False
        for frame in frames:
            self._on_frame(frame)
        return True

    def _on_exit(self, frame: Exit) -> None:
        process = self._children.pop(frame.pid, None)
        if process is not None:
            process._exited(frame.returncode)
        with contextlib.suppress(OSError):  # recorded: the zygote may let the PID go
            self._send(encode_frame(Reap(frame.pid)))

    def _on_spawned(self, frame: Spawned) -> None:
        # Known before any later frame: its exit may come in the same read.
        self._children[frame.pid] = self._replies[frame.id] = ZygoteProcess(frame.pid)

    def _on_failed(self, frame: Failed) -> None:
        self._replies[frame.id] = frame

    def _on_ready(self, frame: Ready | Unfit) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(f"the zygote is unfit: {frame.error}" if isinstance(frame, Unfit) else "")

    def _status(self) -> str:
        if self._popen is None:
            return ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = self._popen.wait(0.5)
            return f" ({code})"
        return ""

    def _give_up(self, reason: str) -> None:
        """No more forks: the agent starts fresh interpreters. Said once; the zygote's workers die with it."""
        first = not self.reason
        self.reason = self.reason or reason
        self.alive = False
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(reason)
        if first:
            log.warning("node %d: %s; workers start as fresh interpreters from now on "
                        "(%s=spawn chooses that from the start)", self.node, reason, START_ENV)
        self.close()

    def close(self) -> None:
        """Let the zygote go (it exits when its channel closes; killed if it does not)."""
        self._settled.set()
        channel, self._channel = self._channel, None
        if channel is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(channel.fileno())
            channel.close()
        popen = self._popen
        if popen is not None and popen.poll() is None:
            try:
                popen.wait(1.0)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        children, self._children = self._children, {}
        for process in children.values():
            asyncio.get_running_loop().create_task(_died_with_zygote(process))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


async def _died_with_zygote(process: ZygoteProcess) -> None:
    """A worker whose zygote is gone dies by its parent-death signal, SIGKILL: recorded once it is gone."""
    try:
        fd = os.pidfd_open(process.pid)
    except OSError:  # already gone
        process._exited(-signal.SIGKILL)
        return
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(fd, ready)
    try:
        await asyncio.wait_for(gone, 30.0)
    except asyncio.TimeoutError:
        log.warning("pid %d outlived its zygote by 30s; recorded as killed", process.pid)
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    process._exited(-signal.SIGKILL)
