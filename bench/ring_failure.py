"""How a rank's death reaches its peers in a gloo all-reduce: the floor under any recovery on gloo.

Issue #28's recovery sweep (``bench/recovery.py --ranks``) found undying's
recovery growing from 4 to 16 ranks, and the rank-by-rank timeline showed
why: the survivors learn of the death one at a time, in the ring's order.
Gloo's ring all-reduce makes each rank wait on one neighbour; when a rank dies
only its neighbours' waits fail, and a survivor further along the ring waits
until the survivor before it closes its own links. This bench measures that
without undying: ``--ranks`` processes (plain ``torch.distributed``, gloo, a
``TCPStore``) enter an all-reduce that one rank (1) never joins; the bench
SIGKILLs that rank and records when each survivor's all-reduce fails.

Two behaviours for a survivor whose collective failed, run one after the
other at each size:

* ``break``: it shuts down its sockets at once with undying's own
  ``undying.worker.group.break_connections`` (what a worker does on leaving; the
  group is plain c10d), so the next survivor's wait fails now;
* ``linger``: it keeps them open for ``--linger`` seconds (a script that does
  not leave at once: each survivor further along waits that long more).

Prints, per size and behaviour, when the first and the last survivor failed
(ms after the kill) and the median gap between consecutive failures (a hop);
``--json`` writes every run's failure times. It reports numbers and asserts
nothing. Every process it starts is killed by PID on the way out.

    python bench/ring_failure.py --ranks 4,16 --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

_VICTIM = 1
_ELEMENTS = 6000  # about the demo's small model (24 KB of float32)


def _rank(port: int, rank: int, world: int, linger: float, collective_s: float) -> None:
    """One rank: a group, one all-reduce together, then the one the victim never joins."""
    import torch
    import torch.distributed as dist

    from undying.worker.group import break_connections, claim_existing_sockets

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=collective_s))
    claim_existing_sockets()  # the group's (and the store's, which is no longer needed then)
    tensor = torch.ones(_ELEMENTS)
    dist.all_reduce(tensor)
    if rank == _VICTIM:
        time.sleep(3600)  # killed by the bench
    store.set(f"waiting/{rank}", "1")
    try:
        dist.all_reduce(tensor)
        outcome: dict[str, Any] = {"rank": rank, "failed": False, "t": time.time()}
    except Exception as e:  # the failure this bench times
        outcome = {"rank": rank, "failed": True, "t": time.time(), "error": str(e)[:120]}
        if linger <= 0:
            break_connections()
    print(json.dumps(outcome), flush=True)
    time.sleep(max(linger, 0.0))
    os._exit(0)  # no teardown: the group is broken


def one_run(world: int, linger: float, collective_s: float, timeout_s: float) -> dict[str, Any]:
    """Each survivor's failure time, seconds after the victim's kill."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60),
                      wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, __file__, "--rank-of", str(server.port)]
    processes = [subprocess.Popen([*argv, str(rank), str(world), str(linger), str(collective_s)],
                                  stdout=subprocess.PIPE, env=env, text=True)
                 for rank in range(world)]
    try:
        server.wait([f"waiting/{r}" for r in range(world) if r != _VICTIM],
                    timedelta(seconds=timeout_s))
        time.sleep(0.3)  # every survivor is inside the all-reduce by now
        killed = time.time()
        os.kill(processes[_VICTIM].pid, signal.SIGKILL)
        times: dict[int, float | None] = {}
        for rank, process in enumerate(processes):
            if rank == _VICTIM:
                continue
            out, _ = process.communicate(timeout=timeout_s)
            lines = out.strip().splitlines()
            outcome = json.loads(lines[-1]) if lines else {}
            times[rank] = round(outcome["t"] - killed, 4) if outcome.get("failed") else None
        return {"ranks": world, "linger_s": linger, "failed_at_s": times}
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last failure and the median hop, each the median over the runs."""
    firsts, lasts, hops, unfailed = [], [], [], 0
    for run in runs:
        failed = sorted(t for t in run["failed_at_s"].values() if t is not None)
        unfailed += sum(1 for t in run["failed_at_s"].values() if t is None)
        if not failed:
            continue
        firsts.append(failed[0])
        lasts.append(failed[-1])
        gaps = [b - a for a, b in itertools.pairwise(failed)]
        if gaps:
            hops.append(statistics.median(gaps))
    return {"first_ms": _ms(firsts), "last_ms": _ms(lasts), "hop_ms": _ms(hops),
            "last_spread_ms": [round(1000 * min(lasts), 1), round(1000 * max(lasts), 1)]
            if lasts else None, "survivors_not_failed": unfailed}


def _ms(values: list[float]) -> float | None:
    return round(1000 * statistics.median(values), 1) if values else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-of"]:
        port, rank, world, linger, collective_s = argv[1:6]
        _rank(int(port), int(rank), int(world), float(linger), float(collective_s))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", default="4,16", help="world sizes, comma-separated (3 to 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--linger", type=float, default=0.5,
                        help="seconds a lingering survivor keeps its links after its failure")
    parser.add_argument("--collective-timeout", type=float, default=60.0,
                        help="the group's collective timeout (a survivor never reached fails then)")
    parser.add_argument("--json", action="store_true", help="every run as JSON on stdout")
    args = parser.parse_args(argv)
    try:
        sizes = [int(part) for part in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks {args.ranks!r}: give world sizes, comma-separated, e.g. 4,16")
    if any(not 3 <= size <= 64 for size in sizes) or args.repeats < 1 or args.linger <= 0:
        parser.error("--ranks from 3 to 64, --repeats at least 1, --linger positive")
    timeout_s = args.collective_timeout + 60 * args.linger + 120
    results: dict[str, Any] = {"runs": [], "summary": {}}
    for size in sizes:
        for linger in (0.0, args.linger):
            name = f"{size} ranks, {'break' if linger == 0 else f'linger {linger:g} s'}"
            runs = [one_run(size, linger, args.collective_timeout, timeout_s)
                    for _ in range(args.repeats)]
            results["runs"] += runs
            results["summary"][name] = line = summary(runs)
            print(f"{name:>24}: first {line['first_ms']} ms, last {line['last_ms']} ms "
                  f"(range {line['last_spread_ms']}), hop {line['hop_ms']} ms; not failed "
                  f"{line['survivors_not_failed']}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
