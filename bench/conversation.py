"""What the one conversation costs `undying run` on one node: each report and command through the in-process line.

Method
------
Since issue #26 the standalone launcher's manager and agent speak
``protocol/node_wire.py`` messages to each other (``launch/in_process.py``):
each report is encoded and decoded before the manager's table takes it, each
command before the agent's table does. Before, the agent called the manager's
method and the manager the agent's. This measures both ways in one process,
interleaved, on the messages of a training step: a rank's ``StepCommitted``
(one per rank per step, the only report on the step path), the node's
``AgentState`` (twice a second), and a ``SpawnRank`` (one per recovery).

* baseline: the table's handler called with the message object (what a
  direct call costs: the dispatch, the manager's work stubbed out);
* in-process line: the same message through ``InProcessReports.send`` /
  ``InProcessLine.write``, i.e. encoded, decoded, then the same dispatch.

It prints the added microseconds per message and, for a step of ``--step-ms``
(the demo job's, docs/benchmarks.md) on ``--ranks`` ranks, the share of the
step the line adds.

    python bench/conversation.py [--ranks 4] [--step-ms 57] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from undying.launch.in_process import InProcessLine, InProcessReports
from undying.manager.node_reports import NodeReports
from undying.manager.node_slot import NodeSlot
from undying.protocol.codec import Message
from undying.protocol.generations import GenerationRecord
from undying.protocol.node_wire import AgentState, SpawnRank, encode
from undying.protocol.worker_wire import StepCommitted


class _Sink:
    """The manager's side, its work stubbed out: what is measured is the way there."""

    def on_messages(self, messages: list[Message]) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _per_call_us(call: Any, message: Any, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call(message)
    return (time.perf_counter() - start) / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=57.0, help="the step the cost is a share of")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--n", type=int, default=20000, help="messages per timing")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    slot = NodeSlot(0)
    reports = NodeReports(lambda: _Sink(), lambda slot, reason: None)  # type: ignore[arg-type, return-value]
    line = InProcessReports(reports, slot)
    commands: list[Message] = []
    slot.attach_line(InProcessLine(commands.append), host="localhost", pid=1, session="bench")
    commit = StepCommitted(1, 3, 1234, time.time(), {"loss": 0.123456789, "lr": 0.01})
    state = AgentState(0, {str(r): 1000 + r for r in range(args.ranks)}, {str(r): "step" for r in range(args.ranks)},
                       1, time.time(), zygote_pid=999)
    record = GenerationRecord(generation=7, world_size=args.ranks, store_host="127.0.0.1", store_port=29501)
    spawn = SpawnRank(2, record, True, "", 9)
    to_agent = InProcessLine(lambda message: None)
    cases = {
        "StepCommitted": (lambda m: reports.handle(m, slot), line.send, commit),
        "AgentState": (lambda m: reports.handle(m, slot), line.send, state),
        "SpawnRank": (lambda m: None, lambda m: to_agent.write(encode(m)), spawn),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, (direct, through, message) in cases.items():
        base, line_us = [], []
        for _ in range(args.repeats):  # interleaved: a baseline timing, then the line's, each round
            base.append(_per_call_us(direct, message, args.n))
            line_us.append(_per_call_us(through, message, args.n))
        added = [b - a for a, b in zip(base, line_us, strict=True)]
        results[name] = {"direct_us": statistics.median(base), "line_us": statistics.median(line_us),
                         "added_us": statistics.median(added), "added_us_each": [round(a, 2) for a in added]}
    per_step_us = results["StepCommitted"]["added_us"] * args.ranks + results["AgentState"]["added_us"] * (
        args.step_ms / 500.0)
    share = per_step_us / (args.step_ms * 1000.0) * 100.0
    out = {"ranks": args.ranks, "step_ms": args.step_ms, "repeats": args.repeats, "messages": results,
           "added_per_step_us": round(per_step_us, 1), "added_per_step_pct": round(share, 3)}
    for name, r in results.items():
        print(f"{name:14s} direct {r['direct_us']:7.2f} us  in-process line {r['line_us']:7.2f} us  "
              f"added {r['added_us']:6.2f} us (each round: {r['added_us_each']})", file=sys.stderr)
    print(f"per step of {args.step_ms:g} ms on {args.ranks} ranks: +{per_step_us:.1f} us = {share:.3f}% of the step",
          file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
