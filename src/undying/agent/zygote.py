"""How the agent starts its workers: forked by a zygote that imported torch once, or fresh
interpreters.

Decision (issue #15: the first step after a relaunch within 3 s; a suite under
15 minutes on 2 cores). Every worker and warm spare used to be a fresh
``python -m undying.worker.boot`` that spent about a second of CPU importing
torch, all of them side by side. Now each agent starts one zygote
(``undying.worker.zygote``, with the workers' environment) when it starts;
the zygote imports torch and the worker library once, and forks each worker
on request over a Unix socket pair.

Decision (issue #25: the zygote is a fork server and nothing more). The
zygote used to be every worker's parent: its SIGKILL killed every rank of the
node (their parent-death signal), and its SIGSTOP hid every rank's exit (the
status was its to collect). Now it forks each worker detached (a go-between
that exits at once), and the agent, a child subreaper (agent/children.py),
becomes the worker's parent before the zygote even answers. So:

- the PID the agent holds is the worker's own and its own child: signalled,
  its process group killed, its exit seen by a pidfd and its status read by
  the agent's ``waitpid``, within milliseconds whatever the zygote does;
- a worker dies with the agent (its parent-death signal is armed once the
  agent is its parent), the zygote with the agent: no orphans;
- a zygote that dies or is stopped costs no rank and no step: the agent sees
  it (its watch, every fraction of a second, and before every fork: a dead
  process or one in state T), kills what is left of it, starts its workers
  as fresh interpreters meanwhile and starts a new zygote in the background
  (``ZygoteKeeper``; a zygote that cannot start at all leaves the node on
  fresh interpreters, said once);
- a standalone agent waits for its zygote before the job's first generation
  (that is the point); a node of a multi-node job joins its manager first,
  and the ranks it is asked for meanwhile wait for the zygote
  (agent/commands.py's ``_spawn``);
- a node left with no worker and no spare lets its zygote go; the next
  worker wanted starts it again, and starts fresh itself.

``UNDYING_WORKER_START``: ``zygote`` (the default) or ``spawn`` (every worker a
fresh interpreter: for a script that needs one). A zygote that cannot start
(no ``pidfd_open``, no child subreaper, a thread started by an import, an
import error, not ready within the init timeout) leaves the agent on fresh
interpreters; it says so once in its log. A worker always starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from undying.agent.children import ChildProcess, become_subreaper
from undying.agent.liveness import process_state
from undying.errors import UsageError
from undying.protocol.codec import Handlers
from undying.protocol.env import WORKER_START_ENV
from undying.protocol.zygote_wire import (
    Failed,
    FromZygote,
    Ready,
    Spawn,
    Spawned,
    Unfit,
    encode_frame,
    from_zygote,
)

__all__ = ["Zygote", "ZygoteKeeper", "start_mode"]

log = logging.getLogger("undying.agent")

_MODES = ("zygote", "spawn")
# A fork takes milliseconds; a zygote silent this long is broken (the agent's loop waits on it
# meanwhile).
_REPLY_TIMEOUT = 3.0
_MAX_REPLACEMENTS = 20  # zygotes lost in one agent's life before it keeps to fresh interpreters


def start_mode(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    """``zygote`` or ``spawn``, from UNDYING_WORKER_START; anything else is an error that says what
    to set."""
    given = (os.environ if env is None else env).get(WORKER_START_ENV, "zygote")
    value = given.strip().lower() or "zygote"
    if value not in _MODES:
        raise UsageError(f"{WORKER_START_ENV}={value!r}: expected 'zygote' "
                         "(workers forked from one process that imported torch, the default) "
                         "or 'spawn' (a fresh interpreter per worker)")
    return value


class Zygote:
    """The agent's end of one zygote: starts it, asks it for workers (each then the agent's own
    child)."""

    def __init__(self, node: int, *, step_api: bool = False) -> None:
        self.node = node
        # the script uses the step API: the zygote also imports torch._dynamo
        self._step_api = step_api
        self._popen: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        self._frames = from_zygote()
        # Answers to Spawn by request id: the process forked, or why none was.
        self._replies: dict[int, ChildProcess | Failed] = {}
        self._on_frame: Callable[[FromZygote], None] = Handlers[None]({
            Spawned: self._on_spawned, Failed: self._on_failed, Ready: self._on_ready,
            Unfit: self._on_ready}).handle
        self._next_id = 0
        self._ready: asyncio.Future[str] | None = None  # "" when ready, else why not
        self.alive = False
        self.reason = ""  # why it stopped serving, once it did
        self.unfit = False  # it never served: a new one would not either
        self._lost = False  # killed or stopped from outside
        self._settled = asyncio.Event()  # set once it serves, gave up or was let go

    @property
    def pid(self) -> int:
        return self._popen.pid if self._popen is not None else 0

    async def start(self, env: dict[str, str], timeout: float) -> bool:
        """Start the zygote with the workers' environment; True once it imported torch and
        serves."""
        if not become_subreaper():
            self.unfit = True
            self._give_up("this platform has no child subreaper (prctl): a forked worker would "
                          "not be the agent's child")
            return False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-u", "-m", "undying.worker.zygote", str(theirs.fileno()),
                 str(os.getpid()), *(["--step-api"] if self._step_api else [])],
                env=env, pass_fds=[theirs.fileno()], start_new_session=True)
        except OSError as e:
            ours.close()
            self.unfit = True
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
            code = self._popen.poll()
            # Killed or stopped while importing: a new one may serve; an import error or a timeout:
            # no.
            self.unfit = not self._lost and (code is None or code >= 0)
            self._give_up(reason)
            return False
        self.alive = True
        self._settled.set()
        log.info("node %d: worker zygote pid %d ready in %.2fs", self.node, self._popen.pid,
                 time.monotonic() - started)
        return True

    @property
    def pending(self) -> bool:
        """Still importing: not serving, not given up, not let go (a worker wanted now had better
        wait)."""
        return not self.alive and not self._settled.is_set()

    async def settled(self) -> None:
        """Until the zygote serves, gives up or is let go (``start`` bounds that by the init
        timeout)."""
        await self._settled.wait()

    def check(self) -> bool:
        """Whether it serves: one that died or is stopped (state T, t), serving or importing, is
        given up now."""
        if self._popen is None or (self._settled.is_set() and not self.alive):
            return False
        state = process_state(self._popen.pid)
        if state in ("?", "Z", "X"):
            self._lost = True
            self._give_up("the zygote exited" + self._status())
        elif state in ("T", "t"):
            self._lost = True
            self._give_up("the zygote is stopped (SIGSTOP, or traced)")
        return self.alive

    def spawn(self, args: list[str], env: dict[str, str], cwd: str) -> ChildProcess | None:
        """Fork a worker (called on the loop; blocks for the fork, milliseconds); None: start it
        fresh."""
        if not self.check() or self._channel is None:
            return None
        self._next_id += 1
        request = self._next_id
        # a closed one stays closed in the worker, as with Popen
        stdio = [fd for fd in (0, 1, 2) if _is_open(fd)]
        frame = encode_frame(Spawn(request, args, env, cwd, stdio))
        try:
            # they ride on the frame's first byte
            sent = socket.send_fds(self._channel, [frame[:1]], stdio)
            self._send(frame[sent:])
            reply = self._await_reply(request)
        except (OSError, ValueError) as e:
            self._give_up(f"the zygote's channel failed: {e}")
            return None
        if isinstance(reply, Failed):
            log.warning("node %d: the zygote could not fork a worker (%s); "
                        "starting it as a fresh interpreter", self.node, reply.error)
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
                wait_s = max(0.0, deadline - time.monotonic())
                if not select.select([], [self._channel], [], wait_s)[1]:
                    raise OSError(f"the zygote took no bytes for {_REPLY_TIMEOUT:.0f}s") from None

    def _await_reply(self, request: int) -> ChildProcess | Failed | None:
        """Read frames until the answer to ``request``."""
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

    def _on_spawned(self, frame: Spawned) -> None:
        # The worker is this process's child already (the zygote reaped the go-between before
        # answering).
        self._replies[frame.id] = ChildProcess(frame.pid)

    def _on_failed(self, frame: Failed) -> None:
        self._replies[frame.id] = frame

    def _on_ready(self, frame: Ready | Unfit) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(
                f"the zygote is unfit: {frame.error}" if isinstance(frame, Unfit) else "")

    def _status(self) -> str:
        if self._popen is None:
            return ""
        code = self._popen.poll()
        return "" if code is None else f" ({code})"

    def _give_up(self, reason: str) -> None:
        """No more forks from this zygote (its workers live on: they are the agent's children)."""
        if not self.reason:
            self.reason = reason
            log.warning("node %d: %s; no worker is lost (each is the agent's own child); "
                        "the next start as fresh interpreters%s", self.node, reason,
                        "" if self.unfit else " until a new zygote serves")
        self.alive = False
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(reason)
        self.close(kill=True)

    def close(self, *, kill: bool = False) -> None:
        """Let the zygote go: it exits when its channel closes; killed at once when broken (or in 1
        s)."""
        self._settled.set()
        self.alive = False
        channel, self._channel = self._channel, None
        if channel is not None:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(channel.fileno())
            channel.close()
        popen = self._popen
        if popen is not None and popen.poll() is None:
            if kill:
                popen.kill()  # (a stopped one too: SIGKILL needs no SIGCONT)
            try:
                popen.wait(1.0)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()


class ZygoteKeeper:
    """One node's zygote over the agent's life: started, checked, replaced in the background, let go
    when idle.

    ``environment`` gives the workers' environment at each start; ``timeout``
    bounds a start (--init-timeout).
    """

    def __init__(self, node: int, environment: Callable[[], dict[str, str]], timeout: float, *,
                 enabled: bool, step_api: bool = False) -> None:
        self.node = node
        # (worker/zygote.py: what its zygote imports beyond what every worker does)
        self.step_api = step_api
        self._environment = environment
        self._timeout = timeout
        self.enabled = enabled  # UNDYING_WORKER_START=zygote, and no zygote was unfit yet
        self.zygote: Zygote | None = None
        self._task: asyncio.Task[None] | None = None
        self.replaced = 0  # zygotes lost (killed, stopped) and started again

    @property
    def pid(self) -> int:
        """The live zygote's PID, 0 while there is none (``undying status --json`` shows it per
        node)."""
        return self.zygote.pid if self.zygote is not None and self.zygote.alive else 0

    async def start(self) -> None:
        """Start one and wait for it (a standalone agent, before its first generation)."""
        if self.enabled:
            self.zygote = Zygote(self.node, step_api=self.step_api)
            await self._run(self.zygote)

    def begin(self) -> None:
        """Start one in the background (its workers wait for it: ``ready``)."""
        if not self.enabled or (self.zygote is not None
                                and (self.zygote.alive or self.zygote.pending)):
            return
        self.zygote = zygote = Zygote(self.node, step_api=self.step_api)
        self._task = asyncio.get_running_loop().create_task(self._run(zygote))

    async def _run(self, zygote: Zygote) -> None:
        # one thread at import, whatever the workers get
        env = {"OMP_NUM_THREADS": "1", **self._environment()}
        if not await zygote.start(env, self._timeout) and zygote.unfit:
            self.enabled = False  # said once by the zygote: fresh interpreters from now on

    @property
    def pending(self) -> bool:
        """Importing torch, or let go while the node was idle (the next worker waits for a new
        one)."""
        return self.enabled and (self.zygote is None or self.zygote.pending)

    async def ready(self) -> None:
        """Until the zygote (started again if let go) serves or gives up."""
        if self.zygote is None:
            self.begin()
        if self.zygote is not None:
            await self.zygote.settled()

    def check(self) -> None:
        """A zygote that died or is stopped is replaced in the background; no worker notices."""
        zygote = self.zygote
        if zygote is None or not self.enabled or zygote.check() or zygote.pending:
            return
        self.zygote = None
        self.replaced += 1
        if self.replaced > _MAX_REPLACEMENTS:
            log.warning("node %d: %d zygotes lost; workers start as fresh interpreters from now on",
                        self.node, self.replaced - 1)
            self.enabled = False
            return
        log.info("node %d: starting a new worker zygote in the background (%s)", self.node,
                 zygote.reason)
        self.begin()

    def spawn(self, args: list[str], env: dict[str, str], cwd: str) -> ChildProcess | None:
        """A worker forked by the zygote; None: start it as a fresh interpreter (none serves
        now)."""
        zygote = self.zygote
        if zygote is None:
            self.begin()  # let go while the node was idle: back for the next
            return None
        process = zygote.spawn(args, env, cwd)
        if process is None:
            self.check()
        return process

    def idle(self) -> None:
        """Let the zygote go (a node with no worker and no spare); the next worker wanted starts it
        again."""
        if self.zygote is not None and self.zygote.alive:
            log.info("node %d: no worker left; the worker zygote goes until one is wanted",
                     self.node)
            self.zygote.close()
            self.zygote = None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.zygote is not None:
            self.zygote.close()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
