"""The first code a worker process runs: tie its life to the agent, then run the script.

``python -m undying.worker.boot SCRIPT ARGS...`` behaves like ``python SCRIPT
ARGS...`` except that the process dies with its agent (Linux parent-death
signal), so a killed launcher never leaves orphans.

``python -m undying.worker.boot --spare SCRIPT ARGS...`` is a hot spare: it
imports torch, the worker library and the installed packages the script
imports, tells the agent it is ready, and waits. When the agent assigns it a
rank it takes that rank's environment and runs the script: a replacement with
no interpreter start and no torch import on the recovery's critical path.

By default a worker is not started with ``python -m`` at all: the agent's
zygote (``undying.worker.zygote``), which imported torch once, forks it and
calls ``main`` with the arguments, and the zygote as the parent it dies with.

``-m MODULE`` runs a module as ``python -m`` does, ``--no-python PROGRAM``
executes a program (torchrun's flags of the same names). The rank's output
streams go where torchrun's ``--redirects``/``--tee``/``--local-ranks-filter``
send them (``worker/streams.py``). When the script returns, the process marks
it (the agent counts the rank done) and arms ``--exit-grace``: an exit stuck
past it is ended by SIGALRM (``agent/exits.py``).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import ctypes
import faulthandler
import gc
import importlib
import importlib.util
import io
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

from undying.errors import StateError
from undying.protocol.env import (
    AGENT_ADDR_ENV,
    AGENT_PID_ENV,
    JOB_DIR_ENV,
    RETURNED_FILE_ENV,
    TIMEOUT_EXIT_ENV,
)

_PR_SET_PDEATHSIG = 1
_DUMP_S = 0.5  # between the stack dump at --exit-grace and the end
_UNDYING_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the zygote (worker/zygote.py) imports before it serves: what every worker imports (a spare
# imports these too).
# Not torch._dynamo: imported before the process group is made, gloo's teardown deadlocked on the
# interpreter lock where the tutorial's main() returns (a thread joined while the lock is held, 4 of
# 6 runs; bench/teardown.py). A fresh interpreter imports it later (DDP does): so does a forked
# worker. sympy (with mpmath, a third of torch._dynamo's import) is pure Python and changes nothing
# of that (0 hangs in 8): imported here, it stays off a replacement rank's path.
# And what boot (which the zygote imports itself) imports before the script runs: its streams,
# config and store client (28 ms a worker, each of them forked after the import would have paid it).
PREWARM = ("torch", "torch.distributed", "sympy", "undying.worker", "undying.worker.streams",
           "undying.config", "undying.protocol.store_client")

# Whether the objects frozen (gc.freeze) may hold a file of the script's: None, not known (a process
# that ends through ``end_process`` without ``main``). ``main`` sets it False as the script starts:
# then the frozen objects are the zygote's imports (in a worker it forked) and no file of the
# script's is among them, until the script itself calls gc.freeze (``_freeze_noted``). Noted, not
# counted: gc.get_freeze_count() walks every frozen object, 40 ms a call after torch's import.
_script_froze: bool | None = None
_gc_freeze = gc.freeze


def _freeze_noted() -> None:
    """gc.freeze, as the script sees it: noted, so the end looks at frozen objects too."""
    global _script_froze
    _script_froze = True
    _gc_freeze()


def _die_with_parent(expected_parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the agent channel closing still ends us
        return
    if os.getppid() != expected_parent:  # the agent died before the signal was armed
        os._exit(1)


def _installed_imports(script: Path) -> list[str]:
    """Top-level modules the script imports that are installed packages, not the script's own."""
    try:
        tree = ast.parse(script.read_text(), str(script))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    local = script.resolve().parent
    found = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name.split(".")[0])
        except (ImportError, ValueError):
            continue
        origin = spec.origin if spec else None
        if origin and not Path(origin).resolve().is_relative_to(local):
            found.append(name)
    return found


def _beat(channel: socket.socket, stop: threading.Event, interval: float) -> None:
    """A waiting spare's heartbeat: SpareReady again every ``interval``, so a stopped spare is
    seen as one."""
    from undying.protocol.worker_wire import SpareReady, encode

    while not stop.wait(interval):
        try:
            channel.sendall(encode(SpareReady(os.getpid(), time.time())))
        except OSError:
            return  # the agent closed the line; the main thread hears it too


def _wait_as_spare(script: Path) -> None:
    """Import what a worker needs, announce readiness, beat while waiting, block until assigned a
    rank.

    The answer to an Assign (SpareTaken) is sent before the script runs: the
    agent kills a spare that does not give it within --spare-take-timeout,
    so a stopped or wedged spare costs a recovery seconds, not the init timeout.
    """
    from undying.protocol.channel_key import hello_line
    from undying.protocol.worker_wire import (
        Assign,
        SpareReady,
        SpareTaken,
        encode,
        spare_beat_interval,
    )
    from undying.protocol.worker_wire import decode_to_worker as decode

    for name in [*PREWARM, *_installed_imports(script)]:
        # A prewarm only; the script reports its own import errors.
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    host, port = os.environ[AGENT_ADDR_ENV].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as channel:
        channel.settimeout(None)
        channel.sendall(hello_line() + encode(SpareReady(os.getpid(), time.time())))
        stop = threading.Event()
        beats = threading.Thread(target=_beat, args=(channel, stop, spare_beat_interval()),
                                 name="undying-spare-beat", daemon=True)
        beats.start()
        reader = channel.makefile("rb")
        line = reader.readline()
        stop.set()
        if not line:
            os._exit(0)  # the agent let the spare go
        message = decode(line)
        if not isinstance(message, Assign):
            raise RuntimeError(f"a spare expected a rank, got {message!r}")
        # (a beat in the middle of its send finishes it first: lines never interleave)
        beats.join(5.0)
        channel.sendall(encode(SpareTaken(os.getpid(), time.time())))
        os.environ.update(message.env)


def main(argv: list[str] | None = None, *, parent: int | None = None) -> None:
    """Run a worker. ``argv``: boot's arguments (default ``sys.argv[1:]``); ``parent``: the
    process this one dies with (default the agent, ``UNDYING_AGENT_PID``; the zygote for a worker
    it forked)."""
    args = sys.argv[1:] if argv is None else argv
    spare = bool(args) and args[0] == "--spare"
    if spare:
        args = args[1:]
    kind = args[0] if args and args[0] in ("-m", "--no-python") else ""
    if kind:
        args = args[1:]
    if not args:
        sys.stderr.write("usage: python -m undying.worker.boot "
                         "[--spare] [-m|--no-python] SCRIPT [ARGS...]\n")
        sys.exit(2)
    if parent is None:
        parent = int(os.environ.get(AGENT_PID_ENV, os.getppid()))
    _die_with_parent(parent)
    from undying.worker.title import name_process, prepare

    prepare()  # before a spare's assignment changes the environment (worker.title)
    script = args[0]
    if spare:
        _wait_as_spare(Path(script))
    from undying.worker.streams import direct_streams

    direct_streams()  # --redirects, --tee, --local-ranks-filter: this rank's environment says where
    from undying.config import show_rank_log

    show_rank_log()  # undying's own lines: WARNING and above, INFO too under `undying -v`
    name_process(script)  # `ps` names the job and the rank
    if kind == "--no-python":
        os.execvp(script, args)  # (the parent-death signal stays armed across exec)
    sys.argv = args
    sys.path.insert(0, os.getcwd() if kind else os.path.dirname(os.path.abspath(script)))
    # Registered first, so it runs last, after the script's own exit handlers: the interpreter's
    # shutdown then skips collecting torch's object graph, which took a worker 1.3-3 s of CPU
    # after its last step (every job end, and a whole-job restart, waited for it).
    atexit.register(_gc_freeze)
    global _script_froze
    _script_froze = False
    gc.freeze = _freeze_noted
    from undying.protocol.store_client import use_for_env_rendezvous

    # The script's own init_process_group() meets its peers on the job's store.
    use_for_env_rendezvous()
    try:
        try:
            if kind:
                runpy.run_module(script, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                # (argparse's usage error is one: on every rank, and again on every restart)
                _record(e)
                raise
            _returned()
            _end()
            raise
        _returned()
        _end()
    except (SyntaxError, ImportError, StateError) as e:
        from undying.config import EXIT_SCRIPT_ERROR, SCRIPT_ERROR_FILE

        # An error in the script, not a fault: one line that says where, not a traceback through
        # undying's frames, and once for the job (every rank would say the same): the first rank
        # to fail leaves it in the job dir, where the manager reads it into the job's failure.
        message = script_error(e).replace("\n    ", " :: ")
        job_dir = os.environ.get(JOB_DIR_ENV, "")
        told = False
        if job_dir:
            try:
                fd = os.open(os.path.join(job_dir, SCRIPT_ERROR_FILE),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(message)
                told = True
            except FileExistsError:
                told = True  # another rank told it first
            except OSError:
                pass
        if not told:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        os._exit(EXIT_SCRIPT_ERROR)
    except Exception as e:
        _record(e)  # then the interpreter prints its traceback and exits 1, as it would
        raise


def _record(e: BaseException) -> None:
    """The script raised: leave the error in torchrun's error file, as its ``@record`` would
    (``@record`` leaves a ``SystemExit`` out; this also notes one with an error code, so a start
    that exits so on every rank is seen to fail the same way again, ``policy.certain_start``).

    The manager reads the file back when the rank's process ends (the failure
    report quotes it, and a start-up error every rank raises the same way twice
    in a row ends the job). A script decorated with ``@record`` wrote it first:
    that one stands.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path:
        return
    import json

    data = {"message": {"message": f"{type(e).__name__}: {e}",
                        "extraInfo": {"py_callstack": "" if isinstance(e, SystemExit)
                                      else traceback.format_exc(),
                                      "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)


def _returned() -> None:
    """The script is done: say so to the agent (a file it reads at the exit) and bound the exit
    itself.

    SIGALRM's default action ends the process in the kernel, with no need of the
    interpreter lock: an exit deadlocked on it (a thread joining one that waits
    for the lock) ends too.
    """
    marker = os.environ.get(RETURNED_FILE_ENV, "")
    if not marker:
        return
    from undying.config import Timeouts  # (its field holds the default: written there only)

    try:
        grace = float(os.environ.get(TIMEOUT_EXIT_ENV, Timeouts.exit_grace))
    except ValueError:
        grace = Timeouts.exit_grace
    with contextlib.suppress(OSError), open(marker, "w") as f:
        f.write(str(time.time()))
    grace = max(0.01, grace)
    # First every thread's stack, to the rank's log (faulthandler's own thread: it needs no
    # interpreter lock, so a teardown deadlocked on it is shown too), then the end.
    with contextlib.suppress(Exception):
        sys.stderr.flush()
        faulthandler.dump_traceback_later(grace, exit=False, file=sys.stderr)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGALRM])
    signal.setitimer(signal.ITIMER_REAL, grace + _DUMP_S)


def _end() -> None:
    """After the script returned (a managed worker): what an exit does that matters, then out,
    exit 0.

    That is: the script's other threads joined (as the interpreter waits for
    them), every exit handler run (the script's, logging's, the heartbeat's
    stop). Skipped: the interpreter's teardown of a process that loaded torch,
    1.5-3 s of CPU on a loaded 2-core host, that every job's end waited for
    (its slowest rank's). A stuck thread or handler is still ended by the
    timer ``_returned`` armed.
    """
    if not os.environ.get(RETURNED_FILE_ENV):
        return  # not under an agent: the interpreter ends as it would
    end_process()


def end_process() -> NoReturn:
    """End this process as a worker ends, exit 0: its threads joined, exit handlers run, files
    flushed.

    Not the interpreter's teardown, whose order of destructors (torch's process
    groups among them: gloo's threads joined while the interpreter lock is held,
    or left joinable, "terminate called without an active exception") is not
    the script's to control. A process of the test suite that plays a rank ends
    with this too, as an undying worker does.
    """
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    # No interpreter teardown follows (os._exit), so the freeze ``main`` registered for it has
    # nothing to spare; left in, it froze the script's objects too and the flush below had to
    # unfreeze and walk torch's whole object graph (0.2 s of CPU a rank, each of its pages
    # copied from the zygote's on the way).
    atexit.unregister(_gc_freeze)
    atexit._run_exitfuncs()
    _flush_open_files()
    os._exit(0)


def _flush_open_files() -> None:
    """Every open file's buffered writes written out, as the teardown would have done.

    A script may leave a file open (``log = open(...)`` at module level): the
    teardown that ``_end`` skips would have flushed it on the way out. Buffered
    and text files are tracked by the garbage collector, so they are all found
    here; what other cleanup objects do in ``__del__`` is skipped.
    """
    # get_objects() lists no frozen object. Those frozen before the script started are the
    # zygote's imports (no file of the script's among them), left as they are; where the script
    # froze objects of its own (gc.freeze), or it is not known, every object is looked at.
    if _script_froze is not False:
        gc.unfreeze()
    # Concrete: no ABC check on every object.
    files = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():
        if issubclass(type(obj), files):
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def script_error(e: BaseException) -> str:
    """``FILE, line N: Kind: message`` and the offending line, from the innermost frame outside
    undying."""
    if isinstance(e, SyntaxError) and e.filename:
        where, line, text = e.filename, e.lineno, (e.text or "").strip()
        message = e.msg
    else:
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if not f.filename.startswith(_UNDYING_DIR)
                  and not f.filename.startswith("<frozen")]
        frame = frames[-1] if frames else None
        where = frame.filename if frame else "the script"
        line = frame.lineno if frame else None
        text = frame.line or "" if frame else ""
        message = str(e)
    kind = type(e).__name__
    head = f"{where}, line {line}: {kind}: {message}" if line else f"{where}: {kind}: {message}"
    return head + (f"\n    {text}" if text else "")


if __name__ == "__main__":
    main()
