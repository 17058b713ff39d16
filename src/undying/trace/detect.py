"""Finding slow ranks and slow nodes from per-rank window summaries.

The same code runs online in the manager (summaries arrive from the workers)
and offline in ``undying diagnose`` (summaries made from the trace files), so
the two can never disagree about what counts as slow. It is pure: no clock, no
I/O, no randomness; the same summaries in the same order give the same findings.

What is compared. In a synchronous job every rank's step takes about as long
as the slowest rank's, so step times say nothing about *who* is slow. Phases
do: the slow rank spends longer computing (or waiting for data, or stalled in
a checkpoint) and, because the others wait for it inside the collectives, the
*shortest* time in communication. For each window of steps and each phase
(compute, data, ckpt), a rank's value is compared with the median of the
other ranks' values; the difference, the *excess*, is measured in *bars*: one
bar is ``threshold`` (default 0.08) times the window's median step time. One
bar for all phases, in step time, because that is what the job pays: a data
wait that grows from 1 ms to 3 ms is no problem, one that grows by 15% of the
step is.

How a finding is made. A window's excess is noisy: on a loaded machine single
steps jitter by tens of percent, and even a robust mean over 10 steps wobbles
by about half a bar (measured on real 4-rank traces on a 2-core machine:
0.045 of the step). Requiring N windows in a row above the bar is either
noisy (N=2 raised false findings in most simulated 1,000-step jobs at that
noise) or slow (N=3 misses the 50-step target). So each (rank, phase) keeps
*evidence*, a one-sided CUSUM: every window adds its excess in bars, at most
2, minus a slack of 0.75, and the evidence never goes below 0 (nor above
twice the level that reports). ``patience + 0.5`` bars of evidence (2.5 by
default) make a finding: two windows at twice the bar, two or three of a rank
slowed by 15% of the step (whose excess is about 1.6 bars once the step itself
grew), while a rank whose excess wobbles around 0 loses 0.75 a window and
almost never gets there. Capping each window at 2 bars keeps one freak window
from making a finding alone; the slack of 0.75 (rather than the textbook half
of the shift to detect) keeps a rank that sits persistently a little under
the bar (a CPU it shares with something else) from adding up to a finding
over hundreds of steps.

Corroboration and special cases:

- compute, with comm markers on: the rank must also wait less than the others
  in the collectives (a rank that computes longer but also waits longer is not
  the one the job waits for); a window where it does not adds no evidence.
  The evidence says whether it had the longest compute and the shortest wait.
  The forward pass is a second witness, and the larger of the two excesses
  counts: on a machine with fewer cores than ranks the others' "wait" burns
  CPU (gloo polls) that the slow rank then lacks, and the compute/wait
  balance hides a slowdown the forward pass shows plainly (measured: a rank
  sleeping 7.5 ms per forward showed no compute excess at all, and 2.5x the
  others' forward time).
- compute, with comm markers off: ``compute`` then still contains the wait
  for the slowest rank, so every rank shows about the same; the forward pass,
  the one piece of compute measured alone, is compared instead, by its own
  excess. A rank slow only in its backward pass then goes unseen, and one
  slower throughout shows only its forward share: turn comm markers on to
  diagnose compute. The forward pass is judged whatever share of the step it
  is. It once had to be 2% of the step at least: the demo's forward pass
  (0.4 ms) is 4% of its 9 ms step on an idle 2-core machine but under 1% of
  the 45-67 ms step the same job takes on a loaded one, so compute went
  unjudged and a rank sleeping 22 ms per forward pass (74x the others') was
  never found. A small share needs no gate: the excess is measured in bars of
  the step, so a sliver of the step cannot make noise look like a bar.
- warm-up: a rank's first window in each generation (the job's first steps,
  and the first after a recovery or a restart) is not judged. Its steps pay
  one-time costs that land on one rank or another at random: DDP rebuilding
  its buckets after the first step, the new group's first collectives, the
  trace files opened. Measured on a 2-core machine, in 14 real 2- and 4-rank
  jobs with comm markers: a first window lifted one rank's compute 1.25-2.8
  bars above the others' in 5 (over 2 bars, half a finding in one window, in
  2); with one more noisy window it made a false "compute-slow since step 1"
  beside an injected data slowdown. None of 24 jobs without comm markers.
- since which step and by how much: the windows of the run that made the
  finding, not all those since the evidence first rose (``onset``); offline,
  ``undying diagnose`` then finds the step itself from the per-step phases.
- nodes: all the ranks of one node (2 or more, and not every rank of the job)
  slow together make one ``slow_node`` finding, not one per rank. A node has
  its own evidence: each window adds the excess, over the median of the ranks
  on *other* nodes, of its least slow rank; it reports at half a bar less than
  a rank (noise rarely lifts all its ranks at once), and a rank ready to be
  reported waits up to ``patience + 1`` windows while its node's evidence
  rises, so that a slow node is not first reported rank by rank. A node one
  of whose ranks is already reported in that phase is not reported: that rank
  explains the node's numbers (a slightly slow node-mate would otherwise turn
  one slow rank into a slow node after a while).
- each (rank or node, phase) is reported once; it may be reported again after
  it recovered: ``patience`` windows in a row that added no evidence (its
  evidence then starts again from 0).

The numbers: at the default threshold and patience, over simulated jobs with
realistic noise (per-rank step jitter of 10-15% plus occasional 2x steps, 2 to
8 ranks) no finding in 1,000-step uniform jobs, and a rank slowed by 15% of
the step found within 50 steps in each phase; on real traces of a 4-rank job
on a 2-core machine, no finding in the uniform job and the slowed rank found
20 steps after the slowdown began. See docs/diagnosis.md.

The window's arithmetic (each rank's excess, a node's, what the others waited
for) is ``trace/excess.py``; what is kept per rank and node, and the numbers a
finding shows, ``trace/evidence.py``; this module decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median
from typing import Any

from undying.trace.evidence import Track, node_finding, rank_finding
from undying.trace.excess import (
    judged_basis,
    node_excess,
    others_medians,
    waited_for,
    window_excess,
)
from undying.trace.finding import Finding, describe_finding, onset

__all__ = ["Finding", "SlowDetector", "PHASES", "describe_finding", "onset", "run_detector"]

PHASES = ("compute", "data", "ckpt")


class SlowDetector:
    """Turns window summaries from every rank into ``Finding``s.

    ``add`` takes one rank's summary (the dict ``StepSummarizer`` makes) and
    returns the findings that windows completed by it produced. A window is
    judged once every expected rank sent it: ``world_size`` ranks when given,
    else every rank seen so far, once a later window was seen (one window
    later than with ``world_size``: pass it when it is known); a rank
    still missing when summaries of ``lag`` later windows arrived is left out
    of it (it may be dead or replaced). ``flush`` judges whatever is left
    (offline, at the end).

    ``threshold`` is the bar, a fraction of the median step time; ``patience``
    the number of windows a rank at twice the bar needs to be reported (more
    at less, see the module doc). Windows with fewer than ``min_steps`` steps
    (a rank that joined late) are left out, being too noisy to judge by, and
    so are a rank's first ``warmup`` windows in each generation.
    """

    def __init__(
        self,
        threshold: float = 0.08,
        patience: int = 2,
        *,
        world_size: int | None = None,
        lag: int = 2,
        min_steps: int = 3,
        warmup: int = 1,
    ) -> None:
        if not 0 < threshold < 1:
            raise ValueError(
                f"threshold is a fraction of the step time, between 0 and 1, got {threshold}"
            )
        if patience < 1:
            raise ValueError(f"patience must be at least 1 window, got {patience}")
        self.threshold = threshold
        self.patience = patience
        self.world_size = world_size
        self.lag = max(1, lag)
        self.min_steps = min_steps
        self.warmup = max(0, warmup)
        # A node's evidence is its least slow rank's: noise rarely lifts all of
        # them at once, so half a bar less is enough, and it lets the node be
        # reported before its ranks' patience with it runs out.
        self.node_report_at = self.report_at - 0.5
        self.max_defer = patience + 1  # windows a ready rank waits for its node
        # Bars taken off every window's excess: a rank must stand well over half
        # a bar above the others, window after window, to gather evidence.
        self.slack = 0.75
        self.nodes: dict[int, str] = {}  # rank -> node, learned from the summaries
        self.late = 0  # summaries that came after their window was judged
        self.windows = 0  # windows judged
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}  # window -> rank -> summary
        self._last = -(2**62)  # the last window judged
        self._gen = 0
        self._max_seen = -(2**62)
        self._ranks: set[int] = set()
        # rank -> (its newest generation, its first window there): its warm-up, not judged
        self._first_window: dict[int, tuple[int, int]] = {}
        self._tracks: dict[tuple[int, str], Track] = {}
        self._node_tracks: dict[tuple[str, str], Track] = {}

    def _track(self, rank: int, phase: str) -> Track:
        return self._tracks.setdefault((rank, phase), Track())

    def _node_track(self, node: str, phase: str) -> Track:
        return self._node_tracks.setdefault((node, phase), Track())

    @property
    def report_at(self) -> float:
        """The evidence (in bars) that makes a finding."""
        return self.patience + 0.5

    # --- input --------------------------------------------------------------

    def add(self, summary: dict[str, Any]) -> list[Finding]:
        """Take one rank's window summary; return the findings it completed (often none)."""
        rank = summary.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool):
            return []
        window = summary.get("window")
        if not isinstance(window, int):
            window = int(summary.get("first_step") or 0)
        gen = int(summary.get("gen") or 0)
        node = summary.get("node")
        if isinstance(node, str) and node:
            self.nodes[rank] = node
        self._ranks.add(rank)
        if window <= self._last:
            if gen <= self._gen:
                self.late += 1
                return []
            # The job went back to an earlier step (a restart from a checkpoint):
            # judge the re-run windows anew; what was learned about ranks stays.
            self._last = window - 1
            self._pending = {}
            self._max_seen = window
        self._gen = max(self._gen, gen)
        self._max_seen = max(self._max_seen, window)
        first = self._first_window.get(rank)
        if first is None or gen > first[0]:
            first = self._first_window[rank] = (gen, window)
        if first[0] == gen and window < first[1] + self.warmup:
            summary = {**summary, "warmup": True}  # its first windows in this generation
        slot = self._pending.setdefault(window, {})
        old = slot.get(rank)
        if old is None or gen >= int(old.get("gen") or 0):
            slot[rank] = summary
        return self._judge_ready(final=False)

    def flush(self) -> list[Finding]:
        """Judge every window still waiting for a rank (the end of an offline trace)."""
        return self._judge_ready(final=True)

    def _expected(self) -> int:
        return self.world_size if self.world_size else len(self._ranks)

    def _judge_ready(self, *, final: bool) -> list[Finding]:
        found: list[Finding] = []
        while self._pending:
            window = min(self._pending)
            slot = self._pending[window]
            complete = len(slot) >= self._expected() and (
                # Without a world size, "every rank seen so far" means little until
                # the job moved on: wait for a later window before trusting it.
                self.world_size is not None or self._max_seen > window
            )
            if not (final or complete or self._max_seen >= window + self.lag):
                break
            del self._pending[window]
            self._last = window
            found.extend(self._judge(slot))
        return found

    # --- one window ---------------------------------------------------------

    def _judge(self, slot: dict[int, dict[str, Any]]) -> list[Finding]:
        rows = {r: s for r, s in slot.items()
                if int(s.get("steps") or 0) >= self.min_steps and not s.get("warmup")}
        if len(rows) < 2:
            return []
        step = median(float(s.get("step") or 0.0) for s in rows.values())
        if step <= 0:
            return []
        self.windows += 1
        bar = self.threshold * step
        first = min(int(s.get("first_step") or 0) for s in rows.values())
        comm_known = all(s.get("comm") is not None for s in rows.values())
        comm = {r: float(s["comm"]) for r, s in rows.items()} if comm_known else {}
        comm_others = others_medians(comm) if comm_known else {}
        groups = self._node_groups(rows)
        found: list[Finding] = []
        waited = waited_for(rows, step, comm, comm_others, self.threshold)
        for phase in PHASES:
            basis = judged_basis(phase, rows, comm)
            if basis is None:
                continue
            values = {r: float(s.get(basis) or 0.0) for r, s in rows.items()}
            per_rank = window_excess(phase, basis, values, step, comm, comm_others, self.threshold)
            if basis == "compute" and waited:
                # What a rank waited for another's data or checkpoint outside the traced collectives
                # (a script's own all_reduce) shows as its compute: not its own slowness.
                per_rank = {r: (x - max((w for q, w in waited.items() if q != r), default=0.0), ev)
                            for r, (x, ev) in per_rank.items()}  # fmt: skip
            fp_excess: dict[int, tuple[float, dict[str, Any]]] = {}
            fpv: dict[int, float] | None = None
            if phase == "compute" and basis == "compute":
                # With comm markers too, the forward pass is a second witness (see the module doc).
                fpb = judged_basis(phase, rows, {})
                if fpb == "fp":
                    fpv = {r: float(s.get("fp") or 0.0) for r, s in rows.items()}
                    fp_excess = window_excess(phase, "fp", fpv, step, {}, {}, self.threshold)
            for rank, (x, ev) in per_rank.items():
                z = x / bar if ev.get("corroborated", True) else 0.0
                if rank in fp_excess and fp_excess[rank][0] / bar > z:
                    x = fp_excess[rank][0]
                    ev = {**fp_excess[rank][1], "comm": ev.get("comm"),
                          "others_comm": ev.get("others_comm")}
                    z = x / bar
                self._update(self._track(rank, phase), z, x, first, ev, step)
            for node, ranks in groups.items():
                zs, xs = node_excess(ranks, values, comm, bar)
                # The forward pass witnesses for a node as it does for its ranks.
                if fpv is not None:
                    fzs, fxs = node_excess(ranks, fpv, {}, bar)
                    if min(fzs) > min(zs):
                        zs, xs = fzs, fxs
                # The node is as slow as its least slow rank: all of them, or it is not the node.
                z = min(zs)
                ev = {f"rank{r}": x for r, x in zip(ranks, xs, strict=True)}
                self._update(self._node_track(node, phase), z, sum(xs) / len(xs), first, ev, step)
            found.extend(self._decide(phase, per_rank, groups))
        return found

    def _update(
        self, track: Track, z: float, x: float, first: int, ev: dict[str, Any], step: float
    ) -> None:
        """Add one window's excess (``z`` in bars, ``x`` in seconds) to a rank's or node's
        evidence."""
        before = track.evidence
        gain = min(z, 2.0) - self.slack
        # Capped, so that evidence piled up by a long slow spell does not outlast it.
        track.evidence = min(2 * self.report_at, max(0.0, before + gain))
        track.calm = 0 if gain > 0 else track.calm + 1
        if track.active and track.calm >= self.patience:
            track.active = False  # recovered: it may be reported again, on fresh evidence
            track.evidence = 0.0
        if track.evidence > 0:
            if before == 0:
                track.since, track.run_sum, track.run_n = first, 0.0, 0
                track.sums, track.counts = {}, {}
                track.history.clear()
            track.history.append((first, z, x))
            track.run_sum += x
            track.run_n += 1
            if gain > 0:  # the numbers of the windows that were slow, not of those in between
                track.basis = ev.get("basis", track.basis)
                for key, value in ev.items():
                    if isinstance(value, (int, float)):  # bools count the windows where they held
                        track.sums[key] = track.sums.get(key, 0.0) + float(value)
                        track.counts[key] = track.counts.get(key, 0) + 1
        else:
            track.run_sum, track.run_n, track.deferred = 0.0, 0, 0
            if not track.active:
                track.base_steps.append(step)

    def _decide(
        self, phase: str, per_rank: dict[int, tuple[float, dict[str, Any]]],
        groups: dict[str, list[int]],
    ) -> list[Finding]:
        """The findings of one phase in this window: nodes first, then ranks not covered by a
        node."""
        found: list[Finding] = []
        ready = {r for r in per_rank if self._track(r, phase).evidence >= self.report_at}
        covered: set[int] = set()
        for node, ranks in groups.items():
            nt = self._node_track(node, phase)
            if nt.active:
                covered.update(ranks)
            elif (
                nt.evidence >= self.node_report_at
                and len(ranks) < len(per_rank)
                # One of its ranks already reported explains the node's numbers.
                and not any(self._track(r, phase).active for r in ranks)
            ):
                nt.active = True
                covered.update(ranks)
                for r in ranks:
                    self._track(r, phase).active = True  # one finding for all of them
                tracks = [self._track(r, phase) for r in ranks]
                found.append(node_finding(node, ranks, phase, nt, tracks))
        for rank in sorted(ready - covered):
            track = self._track(rank, phase)
            if track.active:
                continue
            node = self.nodes.get(rank, "")
            if (node in groups and track.deferred < self.max_defer
                    and self._node_track(node, phase).evidence > 0):
                track.deferred += 1  # its whole node may be slow: wait a little for it to show
                continue
            track.active = True
            found.append(rank_finding(rank, self.nodes.get(rank, ""), phase, track))
        return found

    def phase_excess(
        self,
        phase: str,
        rows: dict[int, dict[str, Any]],
        step: float,
        comm: dict[int, float],
        comm_others: dict[int, float],
    ) -> dict[int, tuple[float, dict[str, Any]]]:
        """One window's numbers for one phase, as the detector compares them.

        ``rows`` maps rank to summary, ``step`` is the window's median step time,
        ``comm`` each rank's collective wait (empty when not all ranks have
        one) and ``comm_others`` the median of the others' waits. Returns, per
        rank, its excess in seconds per step over the others' median and the
        evidence (basis, value, others' median, comm...); empty when the phase
        cannot be judged in this window. For reports and benches: ``add`` does
        the same arithmetic.
        """
        basis = judged_basis(phase, rows, comm)
        if basis is None:
            return {}
        values = {r: float(s.get(basis) or 0.0) for r, s in rows.items()}
        return window_excess(phase, basis, values, step, comm, comm_others, self.threshold)

    def _node_groups(self, rows: dict[int, dict[str, Any]]) -> dict[str, list[int]]:
        """This window's nodes that hold 2 ranks or more; none when all its ranks are on one
        node."""
        groups: dict[str, list[int]] = {}
        for r in sorted(rows):
            groups.setdefault(self.nodes.get(r, ""), []).append(r)
        if len(groups) < 2:
            return {}
        groups.pop("", None)  # ranks whose node is unknown belong to no group
        return {n: rs for n, rs in groups.items() if len(rs) >= 2}

    # --- for reports ----------------------------------------------------------

    def active(self) -> list[tuple[str, Any, str]]:
        """What is reported now and not recovered: (``"rank"``, rank, phase) and (``"node"``,
        node, phase)."""
        out: list[tuple[str, Any, str]] = [
            ("node", n, p) for (n, p), t in self._node_tracks.items() if t.active
        ]
        covered = {(r, p) for (_, n, p) in out for r in self._node_ranks(n)}
        out += [("rank", r, p) for (r, p), t in self._tracks.items()
                if t.active and (r, p) not in covered]
        return out

    def _node_ranks(self, node: str) -> list[int]:
        return [r for r, n in self.nodes.items() if n == node]


def run_detector(summaries: Iterable[dict[str, Any]], detector: SlowDetector) -> list[Finding]:
    """Feed ``summaries`` in order, then flush: every finding, in the order they were made."""
    found: list[Finding] = []
    for s in summaries:
        found.extend(detector.add(s))
    found.extend(detector.flush())
    return found
