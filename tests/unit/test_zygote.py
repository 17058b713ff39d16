"""Workers forked by the agent's zygote are the processes a fresh interpreter would have been.

Real processes: one zygote (it imports torch), real forks, real signals. What
the agent relies on: the worker's own PID and session, its exit status as
Popen gives it (-9 for SIGKILL), its environment replaced wholly, its working
directory, the agent's fds 0/1/2 and none of the zygote's descriptors; each
worker is the agent's own child, so a zygote that dies or is stopped costs no
worker and hides no exit (issue #25).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from undying.agent.children import ChildProcess, release_subreaper
from undying.agent.liveness import process_state
from undying.agent.zygote import Zygote, ZygoteKeeper, start_mode
from undying.config import EXIT_SCRIPT_ERROR
from undying.errors import UsageError
from undying.protocol.env import RETURNED_FILE_ENV, WORKER_START_ENV

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "ppid": os.getppid(), "cwd": os.getcwd(),
                      "env": dict(os.environ), "argv": sys.argv, "fds": fds,
                      "sigint": repr(signal.getsignal(signal.SIGINT)),
                      "sigterm": repr(signal.getsignal(signal.SIGTERM)),
                      "main": __name__, "torch": "torch" in sys.modules}), flush=True)
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))
    if sys.argv[1] == "sleep":
        open(f"started-{os.getpid()}", "w").close()
        time.sleep(60)
    if sys.argv[1] == "raise":
        raise RuntimeError("the script failed")
""")


# A script that leaves a file open with its write still buffered (as a library's module-level handle
# does), and with "freeze" freezes its objects first (gc.freeze, as some training scripts do).
LEAVES_OPEN = textwrap.dedent("""
    import gc, sys
    sys.left_open = open(sys.argv[1] + ".txt", "w")
    sys.left_open.write("written, never closed")
    if sys.argv[2:] == ["freeze"]:
        gc.freeze()
""")


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(sys.path),
            "OMP_NUM_THREADS": "1", **extra}


async def _wait(process: ChildProcess) -> int:
    return await asyncio.wait_for(process.wait(), 30)


async def _started(process: ChildProcess, cwd: Path) -> None:
    """Until a sleeping script has reported (it leaves a file in its working directory)."""
    for _ in range(600):
        if (cwd / f"started-{process.pid}").exists():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"pid {process.pid} did not start within 30s")


def _reports(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _fresh_interpreter_handlers() -> list[str]:
    """SIGINT's and SIGTERM's handlers in a fresh interpreter started from this process."""
    code = ("import signal; print(repr(signal.getsignal(signal.SIGINT))); "
            "print(repr(signal.getsignal(signal.SIGTERM)))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=60).stdout.splitlines()


def test_a_forked_worker_is_what_a_fresh_interpreter_would_be(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    # a state the script declares that undying refuses (undying.State): certain, like a SyntaxError
    refused = tmp_path / "refused.py"
    refused.write_text("from undying.errors import StateError\nraise StateError('no such state')\n")
    leaves_open = tmp_path / "leaves_open.py"
    leaves_open.write_text(LEAVES_OPEN)
    work = tmp_path / "work"
    work.mkdir()
    # As the agent starts a rank: its return marked, and its end undying's (boot.end_process), not
    # the interpreter's teardown.
    managed = _env(**{RETURNED_FILE_ENV: str(tmp_path / "returned")})

    async def run() -> dict[str, int]:
        zygote = Zygote(node=0)
        assert await zygote.start(_env(), timeout=120), zygote.reason
        codes = {}
        try:
            for name, args, env in [
                ("exit", [str(script), "exit", "3"], _env(ONLY_HERE="1")),
                ("ok", [str(script), "exit", "0"], _env()),
                ("raise", [str(script), "raise"], _env()),
                ("syntax", [str(broken)], _env()),
                ("state", [str(refused)], _env()),
                ("left-open", [str(leaves_open), "plain"], managed),
                ("left-open-frozen", [str(leaves_open), "frozen", "freeze"], managed),
            ]:
                process = zygote.spawn(args, env, str(work))
                assert process is not None, zygote.reason
                codes[name] = await _wait(process)
            sleeper = zygote.spawn([str(script), "sleep"], _env(), str(work))
            assert sleeper is not None
            await _started(sleeper, work)
            assert sleeper.returncode is None
            os.killpg(sleeper.pid, signal.SIGKILL)  # its own process group, as the agent kills it
            codes["killed"] = await _wait(sleeper)
            stopped = zygote.spawn([str(script), "sleep"], _env(), str(work))
            assert stopped is not None
            await _started(stopped, work)
            os.kill(stopped.pid, signal.SIGSTOP)  # a stop is not an exit
            await asyncio.sleep(0.3)
            assert stopped.returncode is None
            os.kill(stopped.pid, signal.SIGTERM)
            os.kill(stopped.pid, signal.SIGCONT)
            codes["terminated"] = await _wait(stopped)
        finally:
            zygote.close()
            release_subreaper()
        return codes

    codes = asyncio.run(run())
    assert codes == {"exit": 3, "ok": 0, "raise": 1, "syntax": EXIT_SCRIPT_ERROR, "state": EXIT_SCRIPT_ERROR,
                     "left-open": 0, "left-open-frozen": 0, "killed": -signal.SIGKILL,
                     "terminated": -signal.SIGTERM}
    # A file the script left open keeps its buffered write: the end flushes it, whether its object
    # was created after the zygote's frozen imports or frozen by the script itself.
    for name in ("plain", "frozen"):
        assert (work / f"{name}.txt").read_text() == "written, never closed", name
    captured = capfd.readouterr()
    reports = _reports(captured.out)
    assert len(reports) == 5  # the broken script never ran
    first = reports[0]
    assert first["sid"] == first["pid"]  # a session of its own
    assert first["cwd"] == str(work)
    assert first["env"] == _env(ONLY_HERE="1")  # wholly replaced: nothing of the zygote's or the agent's
    assert "ONLY_HERE" not in reports[1]["env"]  # (nor of an earlier worker's)
    assert first["argv"] == [str(script), "exit", "3"] and first["main"] == "__main__"
    assert first["torch"]  # imported once, in the zygote
    # As a fresh interpreter started from here has them: Python's own SIGINT handler, unless this
    # process was started with SIGINT ignored (a shell's background job), which a child inherits
    assert [first["sigint"], first["sigterm"]] == _fresh_interpreter_handlers()
    assert len({r["pid"] for r in reports}) == 5 and all(r["ppid"] == os.getpid() for r in reports)  # the agent's
    # fds 0/1/2 and the descriptor listdir opened: none of the zygote's channel, selector or pidfds.
    assert all(len(r["fds"]) <= 4 and r["fds"][:3] == [0, 1, 2] for r in reports), [r["fds"] for r in reports]
    assert "RuntimeError: the script failed" in captured.err  # the traceback on the agent's stderr


def test_a_killed_or_stopped_zygote_costs_no_worker_and_hides_no_exit(tmp_path: Path) -> None:
    """SIGKILL of the zygote: its worker lives on, and its later exit is the agent's to see at once; a
    SIGSTOPped zygote: a worker's SIGKILL is seen within a second; the keeper replaces both zygotes."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)

    async def run() -> dict[str, object]:
        keeper = ZygoteKeeper(0, _env, 120, enabled=True)
        await keeper.start()
        seen: dict[str, object] = {}
        try:
            first = keeper.zygote
            assert first is not None and first.alive, first and first.reason
            worker = keeper.spawn([str(script), "sleep"], _env(), str(tmp_path))
            assert isinstance(worker, ChildProcess)
            await _started(worker, tmp_path)
            os.kill(first.pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            seen["alive_after_zygote_kill"] = worker.returncode is None and process_state(worker.pid) in "RS"
            keeper.check()  # (the agent's watch does this every fraction of a second)
            os.kill(worker.pid, signal.SIGTERM)
            seen["terminated"] = await _wait(worker)
            await keeper.ready()
            second = keeper.zygote
            assert second is not None and second.alive and second.pid != first.pid, "not replaced"
            worker = keeper.spawn([str(script), "sleep"], _env(), str(tmp_path))
            assert isinstance(worker, ChildProcess)
            await _started(worker, tmp_path)
            os.kill(second.pid, signal.SIGSTOP)
            os.kill(worker.pid, signal.SIGKILL)
            t = asyncio.get_running_loop().time()
            seen["killed"] = await asyncio.wait_for(worker.wait(), 1.0)
            seen["seen_within_s"] = asyncio.get_running_loop().time() - t
            # A fork asked of the stopped zygote: none (a fresh interpreter instead), the zygote replaced.
            seen["from_stopped"] = keeper.spawn([str(script), "exit", "0"], _env(), str(tmp_path))
            seen["stopped_gone"] = process_state(second.pid) in ("?", "Z")
            third = keeper.zygote  # begun in the background (not waited for here: one more torch import)
            seen["third"] = third is not None and third is not second and keeper.replaced == 2
        finally:
            keeper.close()
            release_subreaper()
        return seen

    seen = asyncio.run(run())
    assert seen["alive_after_zygote_kill"] and seen["terminated"] == -signal.SIGTERM
    assert seen["killed"] == -signal.SIGKILL and float(seen["seen_within_s"]) < 1.0  # type: ignore[arg-type]
    assert seen["from_stopped"] is None and seen["stopped_gone"] and seen["third"], seen


def test_a_zygote_that_cannot_start_says_why() -> None:
    """A zygote that cannot import what it needs gives up at once with a reason (the agent logs it once)."""

    async def run() -> tuple[bool, str]:
        zygote = Zygote(node=0)
        env = _env(PYTHONHOME="/nonexistent", PYTHONPATH="")  # no standard library: no interpreter starts
        return await zygote.start(env, timeout=60), zygote.reason

    ok, reason = asyncio.run(run())
    assert not ok and reason


def test_the_start_mode_is_checked() -> None:
    assert start_mode({}) == "zygote"
    assert start_mode({WORKER_START_ENV: "spawn"}) == "spawn"
    with pytest.raises(UsageError, match=f"{WORKER_START_ENV}='fork'.*'zygote'.*'spawn'"):
        start_mode({WORKER_START_ENV: "fork"})
