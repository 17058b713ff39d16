"""The worker zygote: one process per agent that imported torch once and forks the node's workers.

``python -u -m undying.worker.zygote FD AGENT_PID`` is started by the agent
(``undying.agent.zygote.Zygote``) with the agent's worker environment. It
imports torch, torch.distributed and the worker library, and then, on a
Unix-socket channel (FD), forks a worker per request: a rank or a warm spare
that starts in milliseconds instead of spending a second of CPU importing
torch (on a 2-core node, four ranks and a spare importing side by side was
most of a small job's start and of a relaunch after preemption).

Why a fork is safe here: the zygote runs no torch op and starts no thread
before forking (it checks: more than one thread in the process and it refuses
to serve, the agent then starts fresh interpreters), so torch's intra-op pool
and OpenMP are not initialised in it, and no lock is held by a thread that
would not exist in the child. It blocks on its channel, single-threaded, with
no signal handler, and does nothing but fork.

A worker is forked detached (``_fork_detached``): a go-between forks it and
exits, so the worker is re-parented to the agent (a child subreaper,
agent/children.py) before the zygote answers ``Spawned``. The worker then
waits until its parent is the agent (microseconds) and arms its parent-death
signal on the agent: it dies with the agent, and neither a SIGKILL nor a
SIGSTOP of the zygote reaches it; its exit status is the agent's own to read.

What a forked worker gets, exactly as a fresh ``python -u -m
undying.worker.boot`` would: its own session (setsid), the interpreter's
default signal handlers and an empty signal mask, the request's working
directory, ``os.environ`` replaced wholly by the request's environment, fds
0/1/2 dup'ed from the ones the agent sent with the request (SCM_RIGHTS: the
agent's own, as Popen would have inherited them), none of the zygote's own
descriptors. Nothing that changes training results is seeded:
torch's generators are untouched (never used here, so at their defaults as in
a fresh interpreter), Python's ``random`` re-seeds itself at fork, and NumPy's
global generator, if NumPy was imported, is re-seeded from the OS as a fresh
interpreter's would be. The modules imported before the fork are those a
fresh worker has imported before its script runs (``PREWARM``), and no more:
a module a fresh interpreter would import later (``torch._dynamo``, which DDP
imports) imported earlier changed how gloo's threads end (issue #25). What
differs from a fresh interpreter: settings read once at import (PYTHONPATH,
OMP_*, TORCH_* read by torch's import, the hash seed) are those the zygote
started with, the agent's environment at its start, which is also what a warm
spare has always had. A script that needs a fresh interpreter per worker:
``UNDYING_WORKER_START=spawn``.

Wire: ``undying.protocol.zygote_wire`` (length-prefixed frames, a JSON object
each, named by ``op``): Spawn from the agent, Ready or Unfit once and Spawned
or Failed per Spawn from the zygote.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

from undying.protocol.zygote_wire import (
    Failed,
    Ready,
    Spawned,
    Unfit,
    encode_frame,
    to_zygote,
)
from undying.worker.boot import PREWARM

__all__ = ["Request", "PREWARM", "main"]

# A script of the step API imports torch._dynamo before its process group anyway (``undying.init``
# prewarms it in a thread: worker/job.py), and ends through undying (boot.end_process), never
# through gloo's teardown: its zygote imports it once (``--step-api``) instead of every worker
# paying a second of CPU for it (1.1 s here; the suite's 2 cores ran 4 min longer without it).
# So with the step API itself (``undying.init``, worker/job.py and the checkpoint, protocol and
# trace modules under it: 70 ms a rank, on a cold replacement's path to its first step too); none
# starts a thread or reads the environment as it is imported.
STEP_API_PREWARM = ("torch._dynamo", "undying.worker.job")
_PR_SET_PDEATHSIG = 1


@dataclass
class Request:
    """A worker to fork: boot's arguments, its whole environment, its working directory, its stdio.

    ``stdio``: which of fds 0, 1, 2 the agent has open (any other is closed in the worker);
    ``fds``: the descriptors received for them, in that order.
    """

    id: int
    args: list[str]
    env: dict[str, str]
    cwd: str
    stdio: list[int]
    fds: list[int]


def _die_with_agent(agent_pid: int) -> None:
    """The zygote goes when the agent goes (and its workers with it, by their own parent-death
    signal)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != agent_pid:
        os._exit(1)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _send(channel: socket.socket, message: Ready | Unfit | Spawned | Failed) -> None:
    channel.sendall(encode_frame(message))


def _fork_detached() -> int:
    """Fork a worker that is the agent's child, not the zygote's: its PID here, 0 in the worker,
    -1 if none.

    The zygote forks a go-between, which forks the worker, writes its PID on a
    pipe and exits: the worker is orphaned at once and re-parented to the
    nearest child subreaper, the agent (agent/children.py). Once the zygote
    has reaped the go-between, the worker is the agent's child: its exit
    status is the agent's own to collect, and nothing the zygote does
    afterwards (a SIGKILL, a SIGSTOP, a crash) reaches it.
    """
    read_end, write_end = os.pipe()
    go_between = os.fork()
    if go_between == 0:
        os.close(read_end)
        try:
            pid = os.fork()
        except OSError:
            os._exit(1)
        if pid == 0:
            os.close(write_end)
            return 0
        os.write(write_end, pid.to_bytes(8, "little"))
        os._exit(0)
    os.close(write_end)
    data = b""
    try:
        while len(data) < 8:
            chunk = os.read(read_end, 8 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(go_between, 0)  # once it is reaped, the worker is the agent's
    return int.from_bytes(data, "little") if len(data) == 8 else -1


def _serve(channel: socket.socket, defaults: dict[int, object]) -> Request:
    """Fork a worker per request; returns only in a forked worker. A fork server and nothing
    more."""
    frames = to_zygote()
    fds: list[int] = []  # received with requests' bytes, taken three per spawn in order
    while True:
        data, got, _, _ = socket.recv_fds(channel, 1 << 16, 16)
        fds.extend(got)
        if not data:
            os._exit(0)  # the agent closed the channel: nothing more to start
        for frame in frames.feed(data):
            request = Request(frame.id, frame.args, frame.env, frame.cwd, frame.stdio,
                              fds[:len(frame.stdio)])
            del fds[:len(frame.stdio)]
            try:
                pid = _fork_detached()
            except OSError as e:
                pid, error = -1, f"fork: {e}"
            else:
                error = "fork failed in the go-between"
            if pid == 0:
                # The worker: drop every descriptor of the zygote's (the channel, fds that came for
                # later requests).
                for fd in fds:
                    os.close(fd)
                channel.close()
                _restore_signals(defaults)
                return request
            for fd in request.fds:
                os.close(fd)
            _send(channel, Spawned(request.id, pid) if pid > 0 else Failed(request.id, error))


def _default_signals() -> dict[int, object]:
    """The interpreter's handlers as a fresh one has them (taken before anything else runs)."""
    handlers: dict[int, object] = {}
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(sig)
            if handler is not None:
                handlers[sig] = handler
    return handlers


def _restore_signals(defaults: dict[int, object]) -> None:
    for sig, handler in defaults.items():
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, handler)  # type: ignore[arg-type]
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _become(request: Request) -> None:
    """Make the forked child the worker the agent asked for: session, directory, environment,
    fds 0/1/2."""
    os.setsid()
    for target, fd in zip(request.stdio, request.fds, strict=True):
        os.dup2(fd, target)
    for fd in request.fds:
        os.close(fd)  # (never 0-2: the zygote holds those open)
    for target in {0, 1, 2} - set(request.stdio):
        with contextlib.suppress(OSError):
            os.close(target)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    sys.path[0] = request.cwd  # as `python -m` puts the working directory first
    gc.enable()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # a fresh interpreter's NumPy draws its global seed from the OS
        numpy_random.seed()
    sys.argv = ["-m", *request.args]


def _adopted_by(agent_pid: int, timeout: float = 10.0) -> None:
    """Until the go-between is gone and the worker is the agent's child (microseconds); exit if
    never."""
    deadline = time.monotonic() + timeout
    while os.getppid() != agent_pid:
        if time.monotonic() > deadline or not _exists(agent_pid):
            # the agent is gone, or is no subreaper: nobody would see this worker's exit
            os._exit(1)
        time.sleep(0.0005)


def _exists(pid: int) -> bool:
    """Whether ``pid`` is still there (an agent killed as it forked this worker: the worker goes
    at once, not after the adoption's timeout, its parent-death signal never armed for it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def main() -> None:
    """The zygote's life; in a forked child, the worker's (boot.main, ending the interpreter as
    it would)."""
    # No collection while torch imports: its hundreds of thousands of new objects made the
    # collector run over and over (a fifth of the zygote's start: 2.7 -> 2.2 s of CPU for torch
    # and torch._dynamo, measured). The objects are frozen before the first fork and each worker
    # collects again (``_become``): what Python's documentation of ``gc.freeze`` advises for a
    # fork server. The imports' few cyclic leftovers (about 9,000 objects) stay, frozen with
    # the rest, rather than pay a full collection (0.24 s).
    gc.disable()
    defaults = _default_signals()
    fd, agent_pid = int(sys.argv[1]), int(sys.argv[2])
    prewarm = PREWARM + (STEP_API_PREWARM if sys.argv[3:] == ["--step-api"] else ())
    for std in (0, 1, 2):  # held open, so no descriptor received for a worker ever lands on 0-2
        try:
            os.fstat(std)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != std:
                os.dup2(null, std)
                os.close(null)
    _die_with_agent(agent_pid)
    from undying.worker.title import prepare

    prepare()  # before a child's environment is replaced: its title is set from it (worker.title)
    channel = socket.socket(fileno=fd)
    try:
        import importlib

        for name in prewarm:
            importlib.import_module(name)
        threads = _threads()
        if threads != 1:
            raise RuntimeError(f"{threads} threads after importing {', '.join(prewarm)}: forking "
                               "is not safe (a BLAS or OpenMP pool started at import; "
                               "OMP_NUM_THREADS=1 keeps it from starting)")
        if not hasattr(os, "pidfd_open"):
            raise RuntimeError("no pidfd_open on this platform")
        gc.freeze()  # the imports' objects stay shared with the children (no copy-on-write by GC)
    except Exception as e:
        _send(channel, Unfit(f"{type(e).__name__}: {e}"))
        os._exit(1)
    _send(channel, Ready(os.getpid()))
    request = _serve(channel, defaults)
    _become(request)
    _adopted_by(agent_pid)
    from undying.worker import boot

    # dies with the agent (parent-death signal), not with the zygote
    boot.main(request.args, parent=agent_pid)


if __name__ == "__main__":
    main()
