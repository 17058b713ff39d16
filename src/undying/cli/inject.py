"""``undying inject``: real faults into a running job, for chaos drills.

A drill the job could never take is refused in one line, exit 2 (the manager's
409, ``manager.injection``): a step already passed (leave ``--at-step`` out to
inject now), a step past the job's end, any armed fault in a script without
the step API. ``--wait`` arms a drill before the job's first step: it waits for
the job's manager to come up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from undying.cli.client import Api, add_job_arguments, connect
from undying.errors import JobNotRunningError, UsageError
from undying.inputs import finite_arg
from undying.protocol.kinds import HangHow, InjectKind, InjectPhase, SlowPhase

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inject",
        help="inject a real fault into a running job",
        description="Inject a real fault into a rank of a running job: now, or when it reaches "
        "--at-step (optionally at --phase of that step). `crash` sends SIGKILL to the rank's "
        "process; `hang` sends SIGSTOP (or, with --how spin|block, makes the rank's training "
        "thread loop forever or block forever while the process lives); `comm-error` makes the "
        "rank shut down its process group's connections, so its "
        "next collective fails on every rank while all processes live (a comm-error without "
        "--at-step happens at the rank's next step); `slow --factor F --phase compute|data|ckpt` "
        "makes the rank's steps F times as long from then on, the extra time spent in that phase "
        "(found by slow-rank detection when tracing is on; the job trains on); `nan "
        "[--persistent]` puts a NaN into the rank's gradient before the all-reduce, at one run of "
        "the step (a replay passes) or at every run of it (as a bad batch would); `bitflip "
        "--target grad|param` flips one exponent bit of the rank's gradient (before the "
        "all-reduce) or of a weight of its model, without an error. The last two are drills for "
        "a job that runs with numeric checks (job.steps(..., numerics=True)).",
    )
    p.add_argument("kind", choices=[k.value for k in InjectKind],
                   help="the fault: crash (SIGKILL of the rank's process), hang (SIGSTOP of it: "
                   "found by its missing heartbeats, then killed and replaced) or comm-error (the "
                   "rank breaks its process group's connections, so a real collective fails) or "
                   "slow (the rank's steps take --factor times as long) or nan (a NaN in the "
                   "rank's gradient) or bitflip (one bit of the rank's gradient or weight flipped) "
                   "or leave (the rank's script exits 0 there, sys.exit(0), at phase step, forward "
                   "or optimizer: a rank that leaves early, replaced)")
    p.add_argument("--rank", type=int, required=True, help="the rank to fault")
    p.add_argument("--at-step", type=int, default=None,
                   help="fault when the rank reaches this step (default: now); refused for a "
                   "step the rank already committed, past the job's last step, or in a script "
                   "without the step API (it has no steps)")
    p.add_argument(
        "--phase", choices=[p.value for p in (*InjectPhase, *SlowPhase)], default=None,
        metavar="PHASE",  # (the choices in braces made the usage and help 107 columns wide)
        help=f"one of {', '.join(p.value for p in (*InjectPhase, *SlowPhase))}: where in the "
        "step: step (its start, the default with --at-step), forward, "
        "backward (during the gradient all-reduce), optimizer, recovery (when the rank starts "
        "recovering from another fault), join (once it left the old generation, before it "
        "joins the next: a fault while the others form it), rejoin (the rank's next "
        "replacement process, once it "
        "joined and received its state: a fault of the replacement itself); for slow: compute "
        "(the default: forward and backward), data (the wait for the next batch) or ckpt (the "
        "training loop's checkpoint stall, at steps that save)",
    )
    p.add_argument("--factor", type=finite_arg("--factor"), default=None,
                   help="for slow: how much longer the rank's steps take, e.g. 1.2 for 20%% "
                   "slower")
    p.add_argument(
        "--how", choices=[h.value for h in HangHow], default=None,
        help="for hang: stop (SIGSTOP, the default: heartbeats stop), spin (an endless loop in "
        "Python) or block (a deadlock); spin and block keep the process beating and are found by "
        "the step timeout; they happen at a step (the next one without --at-step)",
    )
    p.add_argument("--persistent", action="store_true",
                   help="for nan: at every run of the step (a replay too), as a bad batch would; "
                   "default: the first run only, a transient fault")
    p.add_argument("--target", choices=("grad", "param", "grad-finite"), default=None,
                   help="for bitflip: the rank's local gradient before the all-reduce (grad, the "
                   "default) or the first weight of its model (param: the model stays wrong), or "
                   "grad-finite: the top mantissa bit of the gradient's largest value, which stays "
                   "finite and no spike (only `undying run --verify-every` finds it)")
    add_job_arguments(p)
    p.add_argument("--wait", type=finite_arg("--wait"), default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS for the job's manager to come up, then inject: arms "
                   "a drill before the job's first step (start the job meanwhile; needs "
                   "--job-dir or --manager; default: the job must be running now)")
    p.add_argument("--json", action="store_true", help="print the manager's answer as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rank < 0:
        raise UsageError(f"--rank must be >= 0, got {args.rank}")
    if args.at_step is not None and args.at_step < 1:
        raise UsageError(f"--at-step must be >= 1, got {args.at_step}")
    if args.how is not None and args.kind != "hang":
        raise UsageError(f"--how applies to hang only, not {args.kind}")
    if args.persistent and args.kind != "nan":
        raise UsageError(f"--persistent applies to nan only, not {args.kind}")
    if args.target is not None and args.kind != "bitflip":
        raise UsageError(f"--target applies to bitflip only, not {args.kind}")
    if args.kind in ("nan", "bitflip") and args.phase not in (None, "backward"):
        raise UsageError(f"{args.kind} strikes in backward, before the all-reduce; leave --phase "
                         "out")
    if args.kind == "slow":
        if args.factor is None:
            raise UsageError("slow needs --factor F (e.g. --factor 1.2 for steps 20% slower)")
        if args.phase is not None and args.phase not in SlowPhase:
            raise UsageError(f"slow's --phase must be one of {SlowPhase.names()}, got "
                             f"{args.phase}")
    elif args.factor is not None:
        raise UsageError(f"--factor applies to slow only, not {args.kind}")
    elif args.phase in SlowPhase:
        raise UsageError(f"--phase {args.phase} applies to slow only; for {args.kind} choose one "
                         f"of {InjectPhase.names()}")
    if not 0 <= args.wait <= _MAX_WAIT_S:
        raise UsageError(f"--wait must be between 0 and {_MAX_WAIT_S:.0f} seconds, got "
                         f"{args.wait:g}")
    if args.wait and args.manager is None and args.job_dir is None:
        raise UsageError("--wait needs --job-dir or --manager: a job not started yet has no "
                         "folder to be found by")
    api = _connect(args)
    body = {"kind": args.kind, "rank": args.rank, "at_step": args.at_step, "phase": args.phase,
            "how": args.how, "factor": args.factor}
    if args.kind == "bitflip":
        body["how"] = args.target or "grad"
    elif args.kind == "nan":
        body["how"] = "persistent" if args.persistent else "once"
    answer = api.post("/api/inject", body)
    if args.json:
        sys.stdout.write(json.dumps(answer) + "\n")
    elif "at_step" in answer:
        factor = f" x{answer['factor']}" if "factor" in answer else ""
        # (no pid yet: armed before the rank's first process, which gets it when it starts)
        pid = f" (pid {answer['pid']})" if answer.get("pid") else ""
        print(f"armed: {args.kind}{factor} of rank {args.rank}{pid} at step "
              f"{answer['at_step']}, phase {answer['phase']}")
    else:
        print(f"injected: {args.kind} of rank {args.rank} (pid {answer['pid']})")
    return 0


# --wait's bound: a drill armed for a job that starts within the hour.
_MAX_WAIT_S = 3600.0


def _connect(args: argparse.Namespace) -> Api:
    """The job's manager; with ``--wait``, once it comes up (a job dir not made yet included)."""
    deadline = time.monotonic() + args.wait
    while True:
        try:
            api = connect(args.manager, args.job_dir, args.token_file)
            if args.wait:  # (a --manager address is only a name until something answers there)
                api.get("/api/status")
            return api
        except JobNotRunningError:
            if not args.wait:
                raise
        except UsageError:
            # (only a job dir the launcher has not made yet is waited for)
            if not args.wait or args.job_dir is None or Path(args.job_dir).exists():
                raise
        if time.monotonic() >= deadline:
            raise JobNotRunningError(f"no job came up in {args.wait:g} s at "
                                     f"{args.manager or args.job_dir}; start it with "
                                     "`undying run`, or wait longer (--wait)")
        time.sleep(0.2)
