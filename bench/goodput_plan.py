"""bench/goodput.py's pure parts: the interruption mix, the seeded schedule, Young's interval, the ratios.

Unit-tested in tests/unit/test_goodput_bench.py; no process, no clock.

The mix is the Llama 3 405B pre-training's (Meta, "The Llama 3 Herd of Models", 2024: 466
interruptions in a 54-day snapshot on 16,384 GPUs, 47 planned and 419 unexpected, about 78% of
the unexpected ones hardware), read from the paper's table of root causes and mapped to the
faults this machine can cause on purpose:

==================  =====  ===========================================================
fault here           count  causes in the table
==================  =====  ===========================================================
crash (hardware)      308  faulty GPU 148, GPU HBM3 memory 72, unplanned host
                           maintenance 32, GPU SRAM 19, GPU system processor 17, GPU
                           thermal/sensor 6, SSD 3, power supply 3, chassis 2, IO board 2,
                           CPU 2, system memory 2
crash (software)       56  software bug 54, dependency 2
comm-error             42  network switch/cable 35, NIC 7
hang                    7  NCCL watchdog timeouts
bitflip                 6  silent data corruption
preempt                47  planned (maintenance, upgrades)
==================  =====  ===========================================================
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MIX", "LLAMA3", "Fault", "apportion", "schedule", "young_interval_s",
           "checkpoint_every", "goodput", "verified_step"]

# The Llama 3 405B snapshot, as the paper states it.
LLAMA3 = {"interruptions": 466, "days": 54, "gpus": 16384, "planned": 47, "unexpected": 419}
# fault kind -> interruptions of the snapshot it stands for (module doc); the counts sum to 466.
MIX = {"crash-hw": 308, "crash-sw": 56, "comm-error": 42, "hang": 7, "bitflip": 6, "preempt": 47}
KINDS = tuple(MIX)


@dataclass(frozen=True)
class Fault:
    """One interruption: ``kind`` strikes rank ``rank`` at the start of step ``step`` (a bitflip:
    in that step's backward; a preemption: the whole job, at that step)."""

    kind: str
    rank: int
    step: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def apportion(count: int, weights: dict[str, int], *, every_kind: bool) -> dict[str, int]:
    """``count`` faults shared by ``weights`` (largest remainder); with ``every_kind``, each kind
    at least once (taken from the largest shares), so a short run still tries every kind."""
    if count < 1:
        raise ValueError(f"{count} interruptions: give at least 1")
    if every_kind and count < len(weights):
        raise ValueError(f"{count} interruptions cannot hold each of the {len(weights)} kinds once; "
                         "give more, or a longer job")
    total = sum(weights.values())
    exact = {k: count * w / total for k, w in weights.items()}
    shares = {k: math.floor(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (exact[k] - shares[k], weights[k]), reverse=True):
        if sum(shares.values()) >= count:
            break
        shares[k] += 1
    if every_kind:
        for k in weights:
            while shares[k] < 1:
                donor = max(shares, key=lambda d: (shares[d], weights[d]))
                shares[donor] -= 1
                shares[k] += 1
    return shares


def verified_step(step: int, every: int, world: int) -> tuple[int, int]:
    """The first step from ``step`` on that ``--verify-every every`` verifies, and the rank whose
    step it replays there (worker.verify_plan: steps K, 2K, ...; the ranks in turn)."""
    at = -(-step // every) * every
    return at, (at // every - 1) % world


def schedule(count: int, total_steps: int, world: int, rng: random.Random, *,
             verify_every: int, every_kind: bool = True, lead_steps: int = 20,
             tail_steps: int = 20) -> list[Fault]:
    """``count`` interruptions of the mix over a job of ``total_steps`` steps, seeded.

    Jittered arrivals: the steps from ``lead_steps`` to ``total_steps - tail_steps`` are cut into
    ``count`` equal slices, and each slice gets one interruption at a random step of its middle
    half (so two never come closer than half a slice: each is recovered before the next). The
    kinds are dealt by ``apportion`` and shuffled; the rank is drawn; a bitflip moves to the next
    step ``--verify-every`` verifies, on the rank verified there (what a verifier can find).
    """
    span = total_steps - lead_steps - tail_steps
    if span < 4 * count:
        raise ValueError(f"{count} interruptions need at least {4 * count + lead_steps + tail_steps} "
                         f"steps; the job has {total_steps}: give a longer job or fewer")
    if verify_every < 1 or 4 * verify_every > span // count:
        raise ValueError(f"--verify-every {verify_every} must be from 1 to a quarter of the "
                         f"{span // count} steps between interruptions")
    deck = [k for k, n in apportion(count, MIX, every_kind=every_kind).items() for _ in range(n)]
    rng.shuffle(deck)
    faults = []
    for i, kind in enumerate(deck):
        lo = lead_steps + (span * i) // count
        hi = lead_steps + (span * (i + 1)) // count
        quarter = (hi - lo) // 4
        step = rng.randint(lo + quarter, hi - quarter)
        rank = rng.randrange(world)
        if kind == "bitflip":
            step, rank = verified_step(step, verify_every, world)
        faults.append(Fault(kind, rank, step))
    return faults


def young_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval: sqrt(2 * save cost * mean time between failures)."""
    if save_cost_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"save cost {save_cost_s} s and MTBF {mtbf_s} s must both be positive")
    return math.sqrt(2 * save_cost_s * mtbf_s)


def checkpoint_every(save_cost_s: float, mtbf_s: float, step_s: float) -> int:
    """Young's interval in whole steps of ``step_s`` seconds (at least 1)."""
    if step_s <= 0:
        raise ValueError(f"step time {step_s} s must be positive")
    return max(1, round(young_interval_s(save_cost_s, mtbf_s) / step_s))


def goodput(reference_s: float, wall_s: float, *, total_steps: int = 0,
            untrusted_steps: int = 0) -> float | None:
    """Fault-free wall time of the same steps / wall time under faults; with ``untrusted_steps``
    (steps trained on a state an undetected corruption had reached), only the trusted share of
    the reference counts."""
    if wall_s <= 0 or reference_s < 0:
        return None
    trusted = 1.0 if total_steps <= 0 else max(0, total_steps - untrusted_steps) / total_steps
    return reference_s * trusted / wall_s
