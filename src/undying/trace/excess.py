"""One window's excess: each rank's value in a phase against the median of the others' values.

The arithmetic ``SlowDetector`` (``trace/detect.py``) judges by, pure: the
others' medians, the summary value a phase is judged by, each rank's excess in
seconds per step with its evidence, a node's ranks' excess over the ranks on
other nodes, and what the others waited for a rank slow in data or checkpoint.
The detector's module doc says why each is measured as it is.
"""

from __future__ import annotations

from statistics import median
from typing import Any

__all__ = ["others_medians", "judged_basis", "window_excess", "node_excess", "waited_for"]


def _median_without(values: list[float], i: int) -> float:
    """Median of sorted ``values`` with the element at index ``i`` left out, in O(1)."""
    n = len(values) - 1

    def at(k: int) -> float:
        return values[k if k < i else k + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


def others_medians(values: dict[int, float]) -> dict[int, float]:
    """For each rank, the median of the other ranks' values (O(n log n) for all of them)."""
    order = sorted(values, key=lambda r: values[r])
    sorted_vals = [values[r] for r in order]
    return {r: _median_without(sorted_vals, i) for i, r in enumerate(order)}


def node_excess(
    ranks: list[int], values: dict[int, float], comm: dict[int, float], bar: float
) -> tuple[list[float], list[float]]:
    """A node's ranks' excess over the median of the ranks on other nodes: in bars, and in
    seconds."""
    inside = set(ranks)
    outside = sorted(v for r, v in values.items() if r not in inside)
    out_comm = sorted(c for r, c in comm.items() if r not in inside)
    m = median(outside)
    xs = [values[r] - m for r in ranks]
    zs = [x / bar for x in xs]
    if out_comm:  # with comm known, each of them must also wait less than the ranks elsewhere
        mc = median(out_comm)
        zs = [z if comm[r] < mc else 0.0 for z, r in zip(zs, ranks, strict=True)]
    return zs, xs


def judged_basis(phase: str, rows: dict[int, dict[str, Any]], comm: dict[int, float]) -> str | None:
    """Which summary value a phase is judged by; None when it cannot be judged in this window."""
    if phase != "compute" or comm:
        return phase
    # Without comm records compute includes the wait for the slowest rank:
    # judge by the forward pass, the one piece of compute measured alone.
    # Whatever share of the step it is: excess is measured in bars of the step, so a
    # forward pass that is a sliver of a long step cannot make noise look like a bar.
    fp = [float(s.get("fp") or 0.0) for s in rows.values()]
    return "fp" if median(fp) > 0 else None


def window_excess(
    phase: str,
    basis: str,
    values: dict[int, float],
    step: float,
    comm: dict[int, float],
    comm_others: dict[int, float],
    threshold: float,
) -> dict[int, tuple[float, dict[str, Any]]]:
    """Each rank's excess (seconds per step) over the others' median, with its evidence."""
    others = others_medians(values)
    top = max(values.values())
    out: dict[int, tuple[float, dict[str, Any]]] = {}
    for r, v in values.items():
        m = others[r]
        ev: dict[str, Any] = {
            "basis": basis, "value": v, "others_median": m,
            "factor": (v / m) if m > 0 else None, "step": step, "bar": threshold * step,
            "comm": comm.get(r), "others_comm": comm_others.get(r), "longest": v >= top,
        }  # fmt: skip
        if comm:
            ev["shortest_comm"] = comm[r] <= min(comm.values())
            if phase == "compute":
                # The one the others wait for waits least itself.
                ev["corroborated"] = comm[r] < comm_others[r]
        out[r] = (v - m, ev)
    return out


def waited_for(
    rows: dict[int, dict[str, Any]],
    step: float,
    comm: dict[int, float],
    comm_others: dict[int, float],
    threshold: float,
) -> dict[int, float]:
    """Per rank, its largest excess this window in data or checkpoint: what the others waited
    for it.

    The others wait for a rank slow in data or checkpoint; where no marker
    catches that wait (a collective of the script's own, not DDP's) it reads
    as their compute. With 2 ranks the other's median is the slow rank
    itself, so the fast one's compute excess is as large as the slow one's
    data excess: seen in a real 2-rank job whose rank 1 was slowed in data,
    where rank 0 was also found "compute-slow" by the same +3.5 ms. (With 3
    ranks, half of it; from 4 the median of the others holds the wait.)
    Only with comm markers: without them compute is judged by the forward pass.
    """
    if not comm:
        return {}
    out: dict[int, float] = {}
    for phase in ("data", "ckpt"):
        values = {r: float(s.get(phase) or 0.0) for r, s in rows.items()}
        excess = window_excess(phase, phase, values, step, comm, comm_others, threshold)
        for r, (x, _) in excess.items():
            out[r] = max(out.get(r, 0.0), x)
    return {r: x for r, x in out.items() if x > 0}
