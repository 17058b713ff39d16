"""The soak's fault kinds and its seeded schedule: pure, no process (unit-tested in tests/unit/test_soak_plan.py).

Two soaks share this table. The single-node soak (``undying run -n 4``) runs
the rank faults of issue #14 and the faults of undying's own single-node
parts; the multi-node soak (2 nodes x 2 ranks on network-namespace hosts,
``undying manager`` alone on a host, a warm standby parked) runs the faults
of the multi-node parts. A kind's expected outcome is in bench/soak.py's
docstring and docs/benchmarks.md.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Kind", "KINDS", "SINGLE", "MULTI", "OWN", "kind", "soaks_of", "schedule", "faults_of", "SOAK_SCRIPT",
           "LEAVE_ENV", "PACE_ENV", "HOWS", "order_name"]

SOAK_SCRIPT = Path(__file__).resolve().parent / "soak_train.py"  # the soak's job (both runs of each soak)
LEAVE_ENV = "SOAK_LEAVE_DIR"  # where the driver puts a rank's order to leave early (see soak_train.py)
PACE_ENV = "SOAK_PACE_FILE"  # a file holding the seconds a step lasts at least
HOWS = ("exit", "return")  # how a rank leaves: sys.exit(0) in a step, or its loop returning


def order_name(rank: int, step: int, how: str) -> str:
    return f"leave-r{rank}-s{step}-{how}"


@dataclass(frozen=True)
class Kind:
    name: str
    soak: str  # "single" or "multi"
    weight: int  # of the weighted draw that fills the schedule up to --faults
    faults: int = 1  # faults one scenario of the kind injects (an overlap: two)
    own: bool = False  # a fault of undying's own parts: at least --at-least of it in a full run


KINDS = (
    # The rank faults (issue #14): single faults most of the time, overlaps one time in five.
    Kind("crash", "single", 4), Kind("hang-stop", "single", 2), Kind("hang-spin", "single", 1),
    Kind("hang-block", "single", 1), Kind("comm-error", "single", 3),
    Kind("overlap-two-at-once", "single", 1, 2), Kind("overlap-during-recovery", "single", 1, 2),
    Kind("overlap-replacement-dies", "single", 1, 2),
    Kind("spare-stop", "single", 1, 2), Kind("spare-kill", "single", 1),
    # undying's own parts on one node (issue #25).
    Kind("zygote-kill", "single", 1, own=True), Kind("zygote-stop", "single", 1, 2, own=True),
    Kind("launcher-hup", "single", 1, own=True), Kind("verifier-kill", "single", 1, own=True),
    Kind("rank-leave", "single", 1, own=True),
    # undying's own parts across nodes (issue #25).
    Kind("agent-kill", "multi", 1, own=True), Kind("agent-pause", "multi", 1, own=True),
    Kind("manager-kill", "multi", 1, own=True), Kind("manager-pause", "multi", 1, own=True),
    Kind("standby-kill", "multi", 1, own=True),
)
SINGLE = tuple(k.name for k in KINDS if k.soak == "single")
MULTI = tuple(k.name for k in KINDS if k.soak == "multi")
OWN = tuple(k.name for k in KINDS if k.own)
_BY_NAME = {k.name: k for k in KINDS}


def kind(name: str) -> Kind:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown fault kind {name!r}; choose from {', '.join(_BY_NAME)}") from None


def soaks_of(names: Sequence[str]) -> list[str]:
    """The soaks that run some of ``names``, single first."""
    return [s for s in ("single", "multi") if any(kind(n).soak == s for n in names)]


def faults_of(scenarios: Sequence[str]) -> int:
    return sum(kind(s).faults for s in scenarios)


def schedule(names: Sequence[str], faults: int, at_least: int, rng: random.Random) -> list[str]:
    """The scenarios to run, in order: at least ``faults`` faults of the kinds ``names``.

    Each of undying's own kinds among ``names`` comes ``at_least`` times (dealt
    in turn, so a smaller ``faults`` still gets each the same share); the rest
    is drawn with the kinds' weights, and the whole deck is shuffled. Seeded:
    the same arguments give the same schedule.
    """
    if faults < 1:
        raise ValueError(f"--faults {faults}: give at least 1")
    chosen = [kind(n) for n in dict.fromkeys(names)]
    if not chosen:
        raise ValueError("no fault kind chosen")
    own = [k for k in chosen if k.own]
    deck: list[str] = []
    total = 0
    for _ in range(at_least):
        for k in own:
            if total < faults:
                deck.append(k.name)
                total += k.faults
    while total < faults:
        picked = rng.choices(chosen, [k.weight for k in chosen])[0]
        deck.append(picked.name)
        total += picked.faults
    rng.shuffle(deck)
    return deck


def counts(deck: Sequence[str]) -> dict[str, int]:
    return dict(Counter(deck))


def until(predicate: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    """``predicate()`` again every ``every`` s until it is truthy or ``timeout`` s passed; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(every)
