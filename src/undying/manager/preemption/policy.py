"""Preemption's decisions, pure functions of what the manager knows: what a SIGTERM does, the stop
step, and how the job ends (which checkpoint a relaunch resumes from, what it re-runs, and why).

``preemption.Preemption`` is the executor: it asks the ranks where they are,
tells them the stop step, waits within the grace period, looks on disk when no
dying gasp was reported, and carries out :func:`settle`'s :class:`Outcome`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from undying.protocol.worker_wire import CheckpointSaved

__all__ = ["OnSigterm", "on_sigterm", "stop_step", "Saved", "Outcome", "gasp_outcome",
           "fallback_outcome", "resume_reruns"]


class OnSigterm(str, enum.Enum):
    BEGIN = "begin"  # agree on a stop step, take the dying gasp, end PREEMPTED
    AGAIN = "again"  # a dying gasp is under way: it stands (logged)
    IGNORE = "ignore"  # the job is stopping or over already


def on_sigterm(*, preempting: bool, winding_down: bool) -> OnSigterm:
    """A second SIGTERM changes nothing;
    one that comes while the job stops for another reason neither."""
    if preempting:
        return OnSigterm.AGAIN
    return OnSigterm.IGNORE if winding_down else OnSigterm.BEGIN


def stop_step(proposals: Mapping[int, int], newest: int) -> int:
    """The step every rank stops after: the furthest any rank proposed (none runs past its answer),
    else the newest committed one."""
    return max(proposals.values(), default=newest)


@dataclass(frozen=True)
class Saved:
    """A checkpoint on disk, as the decisions need it."""

    step: int
    path: str
    kind: str | None
    name: str


@dataclass(frozen=True)
class Outcome:
    """How a preemption ends: the checkpoint a relaunch resumes from
    (step -1: none) and why it is that one."""

    step: int
    path: str
    what: str
    # every rank had finished: the job succeeded, the SIGTERM came at the end
    succeeded: bool = False
    gasp_t: float | None = None  # when the dying gasp of the stop step was written (its phase)
    reused: bool = False

    @property
    def exit_reason(self) -> str:
        if self.succeeded:
            return "every rank finished its last step (a SIGTERM came at the end)"
        return (f"preempted, checkpoint at step {self.step} ({self.what}); "
                "run the same command to resume"
                if self.step >= 0 else f"preempted, no checkpoint: {self.what}")


def gasp_outcome(*, all_done: bool, reused: Saved | None, gasp_reuse_s: float,
                 gasp: CheckpointSaved | None, stop: int, t0: float) -> Outcome | None:
    """The ending when the dying gasp stands (reused, or reported for the stop step);
    None: look on disk."""
    if all_done:
        return Outcome(-1, "", "every rank finished", succeeded=True)
    if reused is not None:
        return Outcome(reused.step, reused.path,
                       f"reused the dying gasp written at most {gasp_reuse_s:.0f}s earlier",
                       reused=True)
    if gasp is not None and gasp.step == stop and not gasp.error:
        what = (f"dying gasp written in {gasp.write_s:.3f}s, {gasp.t - t0:.3f}s after SIGTERM"
                if gasp.kind == "dying-gasp" else "the checkpoint of that step already existed")
        return Outcome(gasp.step, gasp.path, what, gasp_t=gasp.t)
    return None


def fallback_outcome(*, gasp: CheckpointSaved | None, stop: int, late: Sequence[int], grace: float,
                     latest: Saved | None, committed: int) -> Outcome:
    """No dying gasp reported: one found on disk unreported,
    the latest valid checkpoint, or none."""
    if gasp is not None and gasp.error:
        why = gasp.error
    elif late:
        who = f"rank {late[0]}" if len(late) == 1 else f"ranks {', '.join(map(str, late))}"
        why = f"{who} still running when the grace period of {grace:.1f}s ran out, killed"
    else:
        why = f"not written within the grace period of {grace:.1f}s"
    if latest is None:
        return Outcome(-1, "", f"the dying gasp of step {stop} was not taken ({why}) "
                               "and there is no checkpoint")
    if latest.kind == "dying-gasp" and latest.step == stop:
        # Written, but its report was cut off by the kill: it stands as a dying gasp.
        return Outcome(latest.step, latest.path,
                       f"dying gasp {latest.name} found on disk, unreported ({why})")
    rerun = (f"steps {latest.step + 1}..{committed} will be re-run" if committed > latest.step
             else "no step is lost")
    taken = "could not be written" if gasp is not None and gasp.error else "was not taken"
    return Outcome(latest.step, latest.path,
                   f"the dying gasp of step {stop} {taken} ({why}); the latest valid "
                   f"checkpoint {latest.name} ({latest.kind}) stands: {rerun}")


def resume_reruns(outcome: Outcome, *, gasp: CheckpointSaved | None, stop: int,
                  rank_steps: Sequence[int]) -> int:
    """What a resume from the outcome's checkpoint runs again: every step committed after it
    (0: nothing lost)."""
    gasp_ok = gasp is not None and gasp.step == stop and not gasp.error
    committed_end = max([stop if gasp_ok else -1, *rank_steps])
    return max(0, committed_end - outcome.step) if outcome.step >= 0 and not outcome.reused else 0
