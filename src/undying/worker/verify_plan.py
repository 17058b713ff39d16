"""What ``--verify-every K`` decides, as pure functions: when to verify, whose step, what a
verdict means.

Every K steps (steps K, 2K, ...) one rank's step is replayed by the job's
verifier (``worker.verify``): the suspect's local gradient fingerprint against
the one the replay computes from the same batch and random state, starting
from the pre-step state of a *holder*, another rank (a data-parallel replica
holds the same state). The suspect turns with every verification, so with W
ranks each rank is checked every W x K steps.

Rank 0 keeps the book (``Ledger``) and tells every rank its decision at each
verified step (a few integers, ``Decision``): whether this step is verified,
and whether the job rolls back. A mismatch rolls the job back to the *last
verified state*: the pre-step state of the newest step whose verification
passed, or, with none yet, the pre-step state of the failed step itself (the
holder's copy, which the replay trusted), and the job re-runs from that step.

Bounded: at most ``max_pending`` verifications wait for the verifier; past
that, steps are not verified (counted as skipped, the book says overdue)
rather than waited for: verification never blocks a step.

No torch and no I/O here: the mechanism (``worker.verify``) carries these out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from undying.inputs import MAX_EVERY, check_every  # (one reader of K: the CLI, the env, Numerics)

__all__ = [
    "check_every", "due", "suspect_of", "holder_of", "Decision", "Ledger", "MAX_EVERY",
    "MAX_PENDING",
]

# verifications waiting for the verifier; past it, steps go unverified (and it is said)
MAX_PENDING = 64


def due(step: int, every: int) -> bool:
    """Whether step ``step`` (from 1) is verified: steps K, 2K, 3K, ..."""
    return step >= 1 and step % every == 0


def suspect_of(step: int, every: int, world: int) -> int:
    """The rank whose step ``step`` is replayed: the ranks in turn, one per verification."""
    return (step // every - 1) % world


def holder_of(suspect: int, world: int) -> int:
    """The rank whose pre-step state the replay starts from: the next one, never the suspect
    (unless alone)."""
    return (suspect + 1) % world


@dataclass(frozen=True)
class Decision:
    """Rank 0's word to every rank at a verified step, sent as ``encode()``'s integers."""

    # this step is verified (False: skipped, too many wait for the verifier, or rolling back)
    issue: bool
    # 0: none; else every rank loads the pre-step state of this step and re-runs from it
    rollback_to: int = 0
    bad_step: int = 0  # with a roll-back: the step whose verification failed
    bad_rank: int = -1  # ... and the rank whose gradients differed
    round_no: int = 0  # the round after this decision (a roll-back starts a new one)
    source_round: int = 0  # with a roll-back: the round whose files hold the state rolled back to

    def encode(self) -> list[int]:
        return [int(self.issue), self.rollback_to, self.bad_step, self.bad_rank, self.round_no,
                self.source_round]

    @staticmethod
    def decode(values: list[int]) -> Decision:
        issue, rollback_to, bad_step, bad_rank, round_no, source_round = (int(v) for v in values)
        return Decision(bool(issue), rollback_to, bad_step, bad_rank, round_no, source_round)


@dataclass
class Ledger:
    """Rank 0's book of verifications: what waits, what passed, what the next decision is."""

    max_pending: int = MAX_PENDING
    pending: dict[int, int] = field(default_factory=dict)  # step -> suspect, in the order issued
    # the newest step whose verification passed (its pre-step state is the last verified)
    passed: int = 0
    passed_round: int = 0  # the round that verified it (its files are named by it)
    round_no: int = 0
    verified: int = 0  # verifications answered (passed or not)
    mismatched: int = 0
    skipped: int = 0  # verified steps not verified: the queue was full
    errors: int = 0  # replays that could not run (the verifier said why)
    overdue: bool = False  # the queue is full now: the verifier is behind (or stopped)
    # the verifier kept dying: no step is verified from now on (each counted skipped)
    given_up: bool = False

    def settle(self, results: list[tuple[int, bool | None]]) -> Decision | None:
        """Take the verifier's answers ((step, match); None: the replay could not run); a
        roll-back, or None.

        Answers are taken in step order; answers to steps not pending (an
        earlier round's) are ignored. The first mismatch decides: the job goes
        back to the last verified state, and whatever else waited is dropped.
        """
        for step, match in sorted(results, key=lambda r: r[0]):
            if step not in self.pending:
                continue
            suspect = self.pending.pop(step)
            if match is None:
                self.errors += 1
                continue
            self.verified += 1
            if match:
                if step > self.passed or self.passed_round != self.round_no:
                    self.passed, self.passed_round = step, self.round_no
                continue
            self.mismatched += 1
            use_passed = 0 < self.passed < step or self.passed_round != self.round_no
            target, source = ((self.passed, self.passed_round) if use_passed and self.passed
                              else (step, self.round_no))
            self.pending.clear()
            self.overdue = False
            self.round_no += 1
            return Decision(False, target, step, suspect, self.round_no, source)
        if len(self.pending) < self.max_pending:
            self.overdue = False
        return None

    def decide(self, step: int, suspect: int, results: list[tuple[int, bool | None]]) -> Decision:
        """The decision at verified step ``step``: a roll-back found in ``results``, or whether
        to verify it."""
        back = self.settle(results)
        if back is not None:
            return back
        # the same step again (re-run after a peer's fault): verified once more
        if step in self.pending:
            del self.pending[step]
        if self.given_up:
            self.skipped += 1
            return Decision(False, round_no=self.round_no)
        if len(self.pending) >= self.max_pending:
            self.skipped += 1
            self.overdue = True
            return Decision(False, round_no=self.round_no)
        self.pending[step] = suspect
        return Decision(True, round_no=self.round_no)

    def drop_after(self, step: int) -> None:
        """Forget what waits for steps after ``step`` (the job went back to ``step``): they run
        again."""
        for waiting in [s for s in self.pending if s > step]:
            del self.pending[waiting]

    def summary(self) -> dict[str, int]:
        """What the job's verification did, for its report: nothing silently passed."""
        return {"verified": self.verified, "passed": self.verified - self.mismatched,
                "mismatched": self.mismatched, "skipped": self.skipped,
                "not_done": len(self.pending), "errors": self.errors}
