"""Divergence: a run after a fault that is not the run it replaces is said, never assumed away.

Recovery is bit-identical only when the rank that re-runs a step trains on
the same batch, and from the same state, as the run without the fault. Both
are checked here from what the workers report:

- ``StepBegun``: each rank fingerprints its step's batch when the step
  begins. A fingerprint for a (rank, step) that was reported before (a step
  re-run after a fault: by a survivor, or by the replacement of a rank that
  died in it) must be the one reported first. A dataset built from an
  unseeded generator, or a batch fetched at the end of the previous step
  (prefetch), makes a replacement's batch another one.
- ``state_restored`` / ``state_loaded``: a rank that received its state from
  a peer reports the fingerprint of its state once loaded and the donor's;
  they must be equal (a state the script keeps outside ``job.state``, or a
  ``load_state_dict`` that does not restore what ``state_dict`` gave, shows
  here).

A mismatch is an incident ``diverged`` (observed: the job trains on), naming
the rank, the step and which fingerprint differed. Only the newest steps of
each rank are kept (a re-run goes back at most to the last checkpoint's step
in the same manager; older ones are not compared).
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from undying.jobfiles.records import Incident, IncidentDetail, IncidentKind, IncidentStatus
from undying.manager.core import JobCore
from undying.protocol.worker_wire import Progress, StepBegun

__all__ = ["Divergence", "KEPT_STEPS"]

log = logging.getLogger("undying.manager")

KEPT_STEPS = 4096  # per rank: the batch fingerprints of this many newest steps

_WHY = ("a replacement must build the same dataset and draw the same batch as the rank it "
        "replaces (seed the setup, fetch batches inside the step, keep what carries across steps "
        "in job.state; see docs/adopting.md)")


class Divergence:
    """The manager's record of batch fingerprints, and the ``diverged`` incidents it finds."""

    def __init__(self, core: JobCore) -> None:
        self.core = core
        # rank -> step -> (fingerprint, generation)
        self._batches: dict[int, dict[int, tuple[str, int]]] = {}
        self._world = core.book.world_size
        self._said: set[tuple[int, int, str]] = set()  # (rank, step, which): one incident each

    def on_begun(self, message: StepBegun) -> None:
        world = self.core.book.world_size
        # a regroup: each rank's share of the data is another one from here on
        if world != self._world:
            self._batches.clear()
            self._world = world
        seen = self._batches.setdefault(message.rank, {})
        first = seen.get(message.step)
        if first is None:
            seen[message.step] = (message.batch, message.generation)
            if len(seen) > KEPT_STEPS:
                for step in sorted(seen)[: len(seen) - KEPT_STEPS]:
                    del seen[step]
            return
        if first[0] != message.batch:
            self._diverged(message.rank, message.step, "batch", first[0], message.batch,
                           f"rank {message.rank} began step {message.step} with another batch "
                           f"than it had in generation {first[1]} (fingerprint {message.batch}, "
                           f"first {first[0]})")

    def on_progress(self, message: Progress) -> None:
        """A peer's state loaded: its fingerprint must be the donor's."""
        if message.phase not in ("state_restored", "state_loaded"):
            return
        mine, donor = message.detail.get("digest"), message.detail.get("donor_digest")
        if not mine or not donor or mine == donor:
            return
        self._diverged(message.rank, message.step, "state", str(donor), str(mine),
                       f"rank {message.rank}'s state at step {message.step}, loaded from a peer, "
                       f"is not the state it was sent (fingerprint {str(mine)[:16]}, "
                       f"the donor's {str(donor)[:16]})")

    def warning(self) -> str:
        """What the job's end says of a run that diverged ("" when none did):
        it is not the run without faults."""
        found = sorted({(rank, step) for rank, step, _ in self._said})
        if not found:
            return ""
        where = ", ".join(f"rank {rank} at step {step}" for rank, step in found[:5])
        more = ", ..." if len(found) > 5 else ""
        return (f"; warning: the run diverged after a fault ({where}{more}): its losses "
                "are not those of the run without it (see the diverged incidents)")

    def _diverged(self, rank: int, step: int, which: str, expected: str, got: str,
                  what: str) -> None:
        if (rank, step, which) in self._said:
            return
        self._said.add((rank, step, which))
        core = self.core
        now = time.time()
        detail: dict[str, Any] = {"rank": rank, "fingerprint": which, "expected": expected,
                                  "got": got, "reason": _WHY}
        incident = Incident(id=len(core.incidents) + 1, kind=IncidentKind.DIVERGED, rank=rank,
                            step=step, fault_t=now, recovery=0, action="report",
                            status=IncidentStatus.OBSERVED,
                            error=f"diverged: {what}: the losses from here on are not those of "
                                  "the run without the fault",
                            detail=cast(IncidentDetail, detail))
        incident.phases["detected"] = now
        core.incidents.append(incident)
        core.events.incident(incident)
        log.warning("job %s gen %d: %s", core.config.job_id, core.generations.current,
                    incident.error)
