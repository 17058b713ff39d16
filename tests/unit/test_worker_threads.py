"""A worker's background threads that call into torch are stopped before the interpreter finalizes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from undying.worker.threads import StoppedAtExit

# A gloo group of one and a thread that reads its collective count as fast as it
# can: a call that releases the GIL. Left running into finalization (a plain
# daemon thread), the process aborts with SIGABRT on every run here (Python
# 3.11, torch 2.13: "terminate called without an active exception").
SCRIPT = textwrap.dedent("""
    import time
    import torch.distributed as dist
    from undying.worker.threads import StoppedAtExit

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = dist.distributed_c10d._get_default_group()

    def read_counts(stopped):
        while not stopped.is_set():
            group._get_sequence_number_for_group()

    StoppedAtExit(read_counts, name="reader")
    time.sleep(0.2)
""")


def test_a_thread_inside_a_torch_call_does_not_abort_the_exit() -> None:
    for attempt in range(2):
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"attempt {attempt}: exit {done.returncode}\n{done.stderr[-2000:]}"


def test_stop_ends_the_loop_and_waits_for_it() -> None:
    ticks: list[float] = []

    def loop(stopped: threading.Event) -> None:
        while not stopped.wait(0.01):
            ticks.append(time.monotonic())

    thread = StoppedAtExit(loop, name="ticker")
    time.sleep(0.1)
    thread.stop()
    assert not thread.is_alive() and thread.stopped.is_set()
    count = len(ticks)
    time.sleep(0.05)
    assert ticks and len(ticks) == count, "the loop ran on after stop()"
    thread.stop()  # again (as at exit): nothing to do


def test_a_stuck_loop_does_not_hold_up_the_exit() -> None:
    release = threading.Event()
    thread = StoppedAtExit(lambda stopped: release.wait(10), name="stuck", join_s=0.1)
    started = time.monotonic()
    thread.stop()
    assert time.monotonic() - started < 2 and thread.is_alive()
    release.set()
