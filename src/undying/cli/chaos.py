"""``undying chaos``: random real faults against a running job, to rehearse before a long
run."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from undying.cli.client import AccessDeniedError, add_job_arguments, connect
from undying.errors import JobNotRunningError, UsageError
from undying.inputs import finite_arg
from undying.protocol.kinds import InjectKind

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chaos",
        help="inject random faults into a running job until stopped",
        description="Inject random faults of the given kinds at random ranks of a running job, "
        "about every --every seconds (uniformly 0.5x to 1.5x), until Ctrl-C, --count faults, or "
        "the job ends. Each fault shows up as an incident in `undying status`. A hang is found "
        "only after the job's --heartbeat-timeout.",
    )
    p.add_argument("--every", type=finite_arg("--every"), required=True,
                   help="mean seconds between faults")
    p.add_argument("--kinds", default=",".join(InjectKind),
                   help=f"comma-separated fault kinds (default {','.join(InjectKind)})")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the fault schedule (default: random)")
    p.add_argument("--count", type=int, default=0,
                   help="stop after this many faults (default: no limit)")
    p.add_argument("--during-recovery", action="store_true",
                   help="also inject while the job is recovering (overlapping faults)")
    add_job_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per fault on stdout")
    p.set_defaults(func=run)


def _parse_kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in InjectKind]
    if not kinds or unknown:
        raise UsageError(
            f"unknown fault kind(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{InjectKind.names()}"
        )
    return kinds


def run(args: argparse.Namespace) -> int:
    if not 0 < args.every <= 24 * 3600:
        raise UsageError(f"--every must be > 0 seconds (and at most a day), got {args.every}")
    if args.count < 0:
        raise UsageError(f"--count must be >= 0, got {args.count}")
    kinds = _parse_kinds(args.kinds)
    api = connect(args.manager, args.job_dir, args.token_file)
    rng = random.Random(args.seed)
    injected = 0
    try:
        while args.count == 0 or injected < args.count:
            time.sleep(args.every * rng.uniform(0.5, 1.5))
            try:
                status = api.get("/api/status")
            except JobNotRunningError:
                break
            if status["state"] in ("succeeded", "failed", "stopped", "stopping"):
                break
            if status["state"] != "running" and not args.during_recovery:
                continue
            kind, rank = rng.choice(kinds), rng.randrange(status["world_size"])
            try:
                answer: dict[str, Any] = api.post("/api/inject", {"kind": kind, "rank": rank})
            except JobNotRunningError:
                break
            except AccessDeniedError:  # not a passing moment: say it once and stop (exit 2)
                raise
            except UsageError as e:  # e.g. the rank is between processes: try another moment
                print(f"skipped {kind} of rank {rank}: {e}", file=sys.stderr)
                continue
            injected += 1
            record = {"n": injected, "t": time.time(), "kind": kind, "rank": rank,
                      "pid": answer.get("pid")}
            print(json.dumps(record) if args.json else
                  f"[{injected}] {kind} of rank {rank} (pid {answer.get('pid')})", flush=True)
    except KeyboardInterrupt:
        pass
    print(f"chaos: {injected} fault(s) injected", file=sys.stderr)
    return 0
