"""The soak's verdict: each scenario's outcome per kind, and whether the soak held (pure; tests/unit/test_soak_plan.py)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["outcomes_by_kind", "render_outcomes", "holds"]

PASSED = ("recovered", "planned-end")


def outcomes_by_kind(injected: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: scenarios run, how many ended each way, and the first few reasons of those that failed."""
    kinds: dict[str, dict[str, Any]] = defaultdict(lambda: {"n": 0, "recovered": 0, "planned-end": 0, "failed": 0,
                                                             "failures": []})
    for record in injected:
        outcome = record.get("outcome")
        if record["scenario"] == "disk" or outcome in (None, "skipped"):  # a skipped one injected nothing
            continue
        entry = kinds[record["scenario"]]
        entry["n"] += 1
        if record.get("s") is not None:
            entry.setdefault("seconds", []).append(float(record["s"]))
        entry[outcome if outcome in PASSED else "failed"] += 1
        if outcome not in PASSED and len(entry["failures"]) < 3:
            entry["failures"].append(str(record.get("why", "")))
    for entry in kinds.values():  # the wall time a scenario of the kind took (sizes a run: see docs/benchmarks.md)
        seconds = entry.pop("seconds", [])
        if seconds:
            entry["median_s"] = round(statistics.median(seconds), 1)
    return dict(sorted(kinds.items()))


def holds(result: dict[str, Any], planned_exits: Sequence[int] = ()) -> bool:
    """The soak held: every scenario recovered or ended as planned, the job succeeded in the end, the losses
    identical to the fault-free run, no step lost, nothing left running, and every planned end (a launch's
    exit code) one of ``planned_exits``."""
    outcomes = result.get("outcomes", {})
    launches = result.get("launches", [])
    return (bool(outcomes) and all(k["failed"] == 0 for k in outcomes.values())
            and result.get("job_state") == "succeeded" and result.get("returncode") == 0
            and bool(result.get("identical")) and result.get("lost_steps") == 0
            and not result.get("leaked_processes")
            and all(launch["rc"] in planned_exits for launch in launches[:-1]))


def render_outcomes(outcomes: dict[str, dict[str, Any]], out: Any) -> None:
    for name, k in outcomes.items():
        line = f"  {name:<26} {k['n']:>3} scenarios ({k.get('median_s', '-')} s each): {k['recovered']} recovered"
        if k["planned-end"]:
            line += f", {k['planned-end']} planned ends"
        if k["failed"]:
            line += f", {k['failed']} FAILED: " + " | ".join(k["failures"])
        print(line, file=out)
