"""The manager's heap and Python's cyclic garbage collector: no long pause in a burst of commits.

Decision (issue #28: a commit handled within 100 ms at 1,024 nodes x 8 ranks).
The manager is one thread that takes every node's commits of a step in a burst.
Measured with ``bench/control_plane.py --nodes 1024`` (2 cores): the collector's
full collections (its oldest generation) ran about once a step, each 74-85 ms,
and found nothing to free; they were the commit p99 (122 ms) and the event
loop's longest stalls. What they walk is what lives for the whole job: the
interpreter's modules and the job's book (its ranks, its nodes' connections).
So, as Python's documentation of ``gc.freeze`` describes for such a heap:

- ``at_start``: once, before the job's loop, one full collection and then
  everything alive is frozen (moved out of the collector's generations, never
  walked again); the first generation's threshold is raised, so the small
  collections run less often (the manager's garbage is nearly all freed by
  reference counting; what the collector is for, cycles, is rare);
- ``job_running``: each time the job (again) runs, what it built meanwhile (the
  ranks, the nodes' connections) is frozen too. Without a collection first (a
  pause on the way to the first step): a cycle that is garbage at that moment
  stays in memory, once per (re)start of the job's steps.

Afterwards a full collection walks only what the job made since: 5-16 ms in the
same bench. Memory is unchanged (nothing is copied; freed objects are freed).
"""

from __future__ import annotations

import gc

__all__ = ["at_start", "job_running", "THRESHOLD0"]

# Python's default is 700 allocations (less their frees) between two collections of the
# youngest generation; the manager's bursts allocate a few per commit.
THRESHOLD0 = 20_000


def at_start() -> None:
    """Before the manager's loop: collect once, freeze what lives, collect the young less often."""
    gc.collect()
    gc.freeze()
    threshold0, threshold1, threshold2 = gc.get_threshold()
    gc.set_threshold(max(THRESHOLD0, threshold0), threshold1, threshold2)


def job_running() -> None:
    """The job's steps run (again): what was built to run them lives as long, and is frozen."""
    gc.freeze()
