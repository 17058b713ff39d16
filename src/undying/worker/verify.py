"""``--verify-every K``: a step replayed by another process, its gradient fingerprint
compared bit for bit.

The decisions are ``worker.verify_plan``'s; this module carries them out.

- **The verifier.** When the loop starts, rank 0 starts the *verifier*: the
  job's own script, run again as a process outside the job's process group
  (a world of one, with the suspect's batch shipped to it), whose
  ``job.steps`` serves replays (``serve``) instead of training. It starts cold,
  off every step's path; requests wait for it in the job dir's ``verify/``
  folder. It leaves when rank 0's process does (it watches its parent).
- **A verified step** (steps K, 2K, ...). At its start rank 0 reads the
  verifier's answers and says (one small broadcast) whether this step is
  verified and whether the job rolls back. The *holder* (``holder_of``)
  copies its pre-step state and writes it to ``verify/`` from a thread; the
  *suspect* (``suspect_of``), once its gradients are in and checked, writes
  its batch and its local gradient fingerprint (the numeric guard's: one sum
  per gradient, before the all-reduce) the same way. Nothing waits for the
  verifier: the step commits as it would have.
- **The replay.** The verifier loads the holder's state, reseeds as the
  suspect did for that step (``worker.rng``), runs the script's body on the
  suspect's batch up to ``optimizer.step()`` (stopped there, nothing stepped)
  and compares the fingerprints: equal bit for bit, or an ``sdc`` found.
- **A mismatch** rolls every rank back to the last verified state (the holder's
  file of it, so a rank whose memory is corrupt does not restore its own
  copy: the restore planner's ``plan_verify_rollback`` names it) and the job
  re-runs from that step; rank 0 reports the ``sdc``
  incident naming the rank and how many committed steps are re-run.
- **The end.** When the last step is done, rank 0 waits for the answers still
  due while the verifier makes progress (not past ``STALL_S`` without one), so
  a flip in the last steps is found too; what stays unanswered is reported as
  not done (``verify_summary``), never as passed.

Rank 0 starts and watches the verifier's process through
``worker.verifier_process``; the ``verify/`` folder's names, writes and clean-up are
``worker.verify_folder``'s.

Every file of ``verify/`` carries the job's MAC (``worker.verify_files``): a
file another process planted or changed there is refused, never loaded (rank 0
says so: ``verify_refused``).

**A verifier that dies** (killed, OOM) is started again at the next verified
step (or while rank 0 waits at the end): the requests wait for it in the
folder. One that dies ``MAX_RESTARTS`` times in a row without answering in
between is given up on, with the reason (``verify_gave_up``); the steps after
it are counted as not verified, never as passed.

What it cannot see: a corruption the verifier computes too (a deterministic
bug of the model or the library, a corrupt input batch), and a fault that
changes neither gradient sum of the suspect. It needs the step's batch from
``job.steps``' loader (``step.batch``) and a replicated (DDP) state.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from undying.checkpoint.planner import plan_verify_rollback
from undying.protocol.codec import Message
from undying.protocol.env import JOB_DIR_ENV, VERIFY_EVERY_ENV
from undying.protocol.verify_wire import VERIFY_CODEC, VerifyRequest, VerifyResult
from undying.protocol.worker_wire import Progress
from undying.worker.verifier import serve, serving
from undying.worker.verifier_process import how_it_ended, spawn_verifier, stopped
from undying.worker.verify_files import ForgedFile, key_for_verifier, load_sealed, unseal
from undying.worker.verify_folder import VerifyFolder
from undying.worker.verify_plan import (
    Decision,
    Ledger,
    check_every,
    due,
    holder_of,
    suspect_of,
)

__all__ = [
    "Verification", "start_verification", "verify_every", "serving", "serve", "SDC_PHASE",
]

log = logging.getLogger("undying.worker")

SDC_PHASE = "sdc"
# each verdict, to the manager: a quarantined host requalifies on them
VERIFIED_PHASE = "verify_result"
STALL_S = 5.0  # at the loop's end: how long rank 0 waits for an answer the verifier still owes
# ... and for a verifier still starting (importing torch, building the script's model)
STARTUP_S = 60.0
_POLL_S = 0.02
# a verifier that dies this many times in a row without an answer between is given up on
MAX_RESTARTS = 3
# forged files said one by one (verify_refused); past these, counted in the summary
_REFUSED_SAID = 3


def verify_every(asked: int | None) -> int | None:
    """K from ``Numerics(verify_every=K)``, else from ``undying run --verify-every K``.

    None: no verification.
    """
    if asked is not None:
        return asked
    raw = os.environ.get(VERIFY_EVERY_ENV)
    return check_every(raw, VERIFY_EVERY_ENV) if raw else None


def start_verification(
    every: int | None, *, managed: bool, rank: int, world: int, seed: int,
    generation: Callable[[], int], send: Callable[[Message], None],
) -> Verification | None:
    """``--verify-every K`` for one loop (rank 0 starts the verifier), or None: not asked, or
    not possible."""
    job_dir = os.environ.get(JOB_DIR_ENV, "")
    if every is None:
        return None
    key = key_for_verifier()
    if not managed or not job_dir or key is None:
        log.warning("verify_every=%d needs a job run by `undying run` (its job dir and key): "
                    "steps are not verified", every)
        return None
    verification = Verification(every, rank=rank, world=world, seed=seed, job_dir=job_dir,
                                generation=generation, send=send, key=key)
    verification.start()
    return verification


def _detached(state_dict: Any) -> Any:
    """A copy no later step can change (the holder's pre-step state, taken before the body
    runs)."""
    return copy.deepcopy(state_dict)


class Verification:
    """One rank's part in ``--verify-every`` for one ``job.steps`` loop (rank 0 also keeps the
    book)."""

    def __init__(self, every: int, *, rank: int, world: int, seed: int, job_dir: str,
                 generation: Callable[[], int], send: Callable[[Message], None],
                 key: bytes) -> None:
        self.every = every
        self._key = key  # the job's verify key: every file here is sealed and checked with it
        self._rank = rank
        self._world = world
        self._seed = seed
        self._generation = generation
        self._send = send
        self._files = VerifyFolder(job_dir, key)  # names, writes, clean-up (worker.verify_folder)
        self.folder = self._files.path
        self._ledger = Ledger()
        self._round_no = 0
        # (step, suspect, holder) of the step verified now
        self._issued: tuple[int, int, int] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._overdue_said = False
        self._errors_said = False
        self._refused = 0  # files that failed the job's MAC (never loaded)
        self._deaths = 0  # the verifier's deaths since its last answer
        self._restarts = 0
        self._gave_up = ""  # why the verifier was given up on ("" while it is kept)
        self._stopped_since: float | None = None  # since when it was seen stopped (SIGSTOP)

    # --- the loop's seams -------------------------------------------------------------

    def start(self) -> None:
        """Rank 0: the verifier process, and the notice that says what is verified (and by
        whom)."""
        if self._rank != 0:
            return
        self._files.clear_stale()
        self._files.owner = os.getpid()
        detail: dict[str, Any] = {"every": self.every, "folder": str(self.folder),
                                  "world_size": self._world}
        try:
            self._process = self._spawn()
            detail["pid"] = self._process.pid
        # no verifier: said once, the job trains unverified (the summary says not done)
        except OSError as e:
            detail["error"] = f"the verifier could not start: {e}"
        self._send(Progress(0, self._generation(), "verify_started", time.time(), detail=detail))

    def due(self, index: int) -> bool:
        return due(index, self.every)

    def begin(self, index: int, state: Any) -> int | None:
        """At a verified step's start: rank 0's decision, on every rank; a step to roll back to,
        or None.

        A collective (one broadcast): a peer's fault raises here, as in any
        collective, and the loop recovers as for an aborted step.
        """
        suspect = suspect_of(index, self.every, self._world)
        decision = self._agree(lambda: self._ledger.decide(index, suspect, self._results()))
        self._issued = None
        if decision.rollback_to:
            return self._roll_back(state, decision, committed=index - 1)
        if decision.issue:
            holder = holder_of(suspect, self._world)
            self._issued = (index, suspect, holder)
            if self._rank == holder:
                self._files.in_background(self._files.file("pre", self._round_no, index, "pt"),
                                          _detached(state.state_dict()))
        return None

    def after_check(self, step: Any, prints: list[int]) -> None:
        """The suspect, once its gradients passed the numeric checks: its batch and fingerprint,
        for the replay."""
        issued = self._issued
        if (issued is None or issued[0] != step.index or issued[1] != self._rank
                or step.batch is None):
            return
        request = VerifyRequest(self._files.round(self._round_no), step.index, self._rank,
                                issued[2], self._seed, list(prints), time.time())
        batch = _detached(step.batch)
        self._files.in_background(
            self._files.file("batch", self._round_no, step.index, "pt"), batch,
            then=(self._files.file("req", self._round_no, step.index, "json"),
                  VERIFY_CODEC.encode(request)))

    def finish(self, state: Any, committed: int) -> int | None:
        """After the last step: wait (bounded) for what the verifier owes; a step to roll back
        to, or None."""
        if self._rank == 0:
            self._wait_for_answers()
        decision = self._agree(lambda: self._ledger.settle(self._results()) or Decision(False))
        if decision.rollback_to:
            return self._roll_back(state, decision, committed=committed)
        return None

    def close(self) -> None:
        """The loop ended: the report (rank 0), the verifier stopped, the folder's files removed."""
        self._files.join_writes(timeout=30)
        if self._rank != 0:
            return
        summary = self._ledger.summary()
        process = self._process
        exited = None if process is None else process.poll()
        note = ("steps not verified: "
                + (f"{summary['skipped']} skipped (the verifier was behind or down), "
                   f"{summary['not_done']} unanswered at the end, "
                   f"{summary['errors']} that could not be replayed"))
        self._send(Progress(0, self._generation(), "verify_summary", time.time(), detail={
            **summary, "every": self.every, "verifier_exit": exited, "restarts": self._restarts,
            "refused": self._refused, "gave_up": self._gave_up, "note": note}))
        if process is not None and exited is None:
            process.kill()  # a stopped verifier takes SIGKILL too; it holds nothing of the job's
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self._files.remove_own()

    # --- rank 0's book ----------------------------------------------------------------

    def _results(self) -> list[tuple[int, bool | None]]:
        """The verifier's answers to this round's requests, read once (their files removed)."""
        out: list[tuple[int, bool | None]] = []
        prefix = f"res-{self._files.round(self._round_no)}-"
        for path in sorted(self.folder.glob(prefix + "*.json")):
            try:
                result = VERIFY_CODEC.decode(unseal(path, self._key))
                path.unlink()
            except ForgedFile as e:
                self._refuse(path, e)
                continue
            except (OSError, ValueError) as e:
                log.info("verification answer %s unreadable (%s): left for the next look",
                         path.name, e)
                continue
            if not isinstance(result, VerifyResult):
                continue
            self._deaths = 0  # it answers: a death from here on is a new one
            if result.match is False and result.differing == [-1]:
                out.append((result.step, None))  # the replay could not run: not a verdict
                if not self._errors_said:
                    self._errors_said = True
                    self._send(Progress(
                        0, self._generation(), "verify_error", time.time(), step=result.step,
                        detail={"suspect": result.rank,
                                "log": str(self.folder / "verifier.log")}))
                continue
            out.append((result.step, result.match))
            self._send(Progress(0, self._generation(), "verify_result", time.time(),
                                step=result.step,
                                detail={"suspect": result.rank,
                                        "passed": result.match}))  # VERIFIED_PHASE
        return out

    def _agree(self, decide: Callable[[], Decision]) -> Decision:
        """Rank 0 decides; every rank gets the same decision (one broadcast of a few
        integers)."""
        values = torch.zeros(7, dtype=torch.int64)
        if self._rank == 0:
            self._keep_verifier()
            decision = decide()
            # the last verified state's file is the one kept
            self._files.forget_older_states(self._ledger.passed)
            values[:6] = torch.tensor(decision.encode(), dtype=torch.int64)
            values[6] = self._files.owner
            if self._ledger.overdue and not self._overdue_said:
                self._overdue_said = True
                self._send(Progress(0, self._generation(), "verify_overdue", time.time(), detail={
                    "waiting": len(self._ledger.pending),
                    "oldest": min(self._ledger.pending, default=0),
                    "skipped": self._ledger.skipped,
                    "note": "the verifier is behind or stopped: steps go on unverified, none "
                            "counted as passed"}))
            elif not self._ledger.overdue:
                self._overdue_said = False
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(values, src=0)
        decided = Decision.decode(values[:6].tolist())
        self._files.owner = int(values[6])
        self._round_no = decided.round_no
        return decided

    def _wait_for_answers(self) -> None:
        """Rank 0 at the end: until nothing is owed, or the verifier is gone or silent for
        STALL_S."""
        last = time.monotonic()
        owed = len(self._ledger.pending)
        ready = False
        while self._ledger.pending:
            if self._process is not None and self._keep_verifier():
                # a new one: it takes the requests still in the folder
                ready, last = False, time.monotonic()
            if self._process is None or self._process.poll() is not None:
                return  # gone for good: nothing will come; the summary says not done
            if not ready and (self.folder / f"ready-{self._process.pid}").exists():
                ready, last = True, time.monotonic()  # up now: from here it answers or stalls
            have = self._files.answered(self._round_no)
            still = len([s for s in self._ledger.pending if s not in have])
            if still == 0:
                return
            if still < owed:
                owed, last = still, time.monotonic()
            elif time.monotonic() - last > (STALL_S if ready else STARTUP_S):
                return
            time.sleep(_POLL_S)

    def _keep_verifier(self) -> bool:
        """Rank 0: a verifier that died is started again (True: a new one runs), or given up on
        with the reason."""
        process = self._process
        if process is None or self._gave_up:
            return False
        code = process.poll()
        if code is None and self._stopped_too_long(process.pid):
            log.warning("the verifier (pid %d) was stopped for %.0fs: killed, and replaced",
                        process.pid, STALL_S)
            process.kill()  # (SIGKILL ends a stopped process too)
            code, self._stopped_since = process.wait(), None
        if code is None:
            return False
        self._deaths += 1
        reason = ""
        if self._deaths > MAX_RESTARTS:
            reason = (f"the verifier died {self._deaths} times in a row without an answer "
                      f"(the last {how_it_ended(code)}; see {self.folder / 'verifier.log'}): "
                      "steps from here on are not verified")
        else:
            try:
                self._process = self._spawn()
            except OSError as e:
                reason = (f"the verifier died ({how_it_ended(code)}) and could not start again: "
                          f"{e}")
        if reason:
            self._gave_up = reason
            self._ledger.given_up = True
            self._send(Progress(0, self._generation(), "verify_gave_up", time.time(), detail={
                "reason": reason, "restarts": self._restarts,
                "pending": len(self._ledger.pending)}))
            return False
        self._restarts += 1
        self._send(Progress(0, self._generation(), "verify_restarted", time.time(), detail={
            "pid": self._process.pid if self._process else None, "old_pid": process.pid,
            "exit": how_it_ended(code), "restarts": self._restarts,
            "waiting": len(self._ledger.pending),
            "note": "the verifier died; a new one takes the requests still waiting in the "
                    "folder"}))
        return True

    def _stopped_too_long(self, pid: int) -> bool:
        """Stopped (SIGSTOP, a debugger) for STALL_S on: it answers nothing until it is replaced."""
        if not stopped(pid):
            self._stopped_since = None
            return False
        self._stopped_since = self._stopped_since or time.monotonic()
        return time.monotonic() - self._stopped_since > STALL_S

    def _refuse(self, path: Path, error: ForgedFile) -> None:
        """A file that failed the job's MAC: removed unread, and said (the first few one by
        one)."""
        self._refused += 1
        with contextlib.suppress(OSError):
            path.unlink()
        log.warning("%s", error)
        if self._refused <= _REFUSED_SAID:
            self._send(Progress(0, self._generation(), "verify_refused", time.time(), detail={
                "file": path.name, "reason": str(error), "refused": self._refused}))

    # --- the roll-back ----------------------------------------------------------------

    def _roll_back(self, state: Any, decision: Decision, *, committed: int) -> int:
        """Every rank: the verified state (the holder's file of it) loaded; the loop re-runs from
        its step."""
        self._files.join_writes(timeout=60)
        path = self._files.file("pre", decision.source_round, decision.rollback_to, "pt")
        # The one planner: from the holder's file, never a rank's own memory nor the suspect's
        # unverified copy.
        plan = plan_verify_rollback(
            world_size=self._world, bad_step=decision.bad_step, bad_rank=decision.bad_rank,
            rollback_to=decision.rollback_to, committed=committed, file=path.name,
            holder=holder_of(suspect_of(decision.rollback_to, self.every, self._world),
                             self._world))
        # ForgedFile: never loaded
        state.load_state_dict(load_sealed(self.folder / plan.source.path, self._key))
        state.discard_gradients()
        if self._rank == 0:  # what the verifier still has of the old round
            self._files.drop_requests(decision.round_no - 1)
        rerun = plan.lost_steps
        if self._rank == 0:
            summary = (f"step {decision.bad_step}: rank {decision.bad_rank}'s gradients differ "
                       f"from their replay on the verifier, bit for bit: silent data corruption; "
                       f"rolled back to the state after step {decision.rollback_to - 1} (the last "
                       f"verified) and re-running {rerun} committed "
                       f"step{'s' if rerun != 1 else ''}")
            detail = {"suspect": decision.bad_rank, "rolled_back_to": decision.rollback_to - 1,
                      "rerun_steps": rerun, "source": path.name, "restore_plan": plan.describe(),
                      "summary": summary}
            self._send(Progress(0, self._generation(), "sdc", time.time(), step=decision.bad_step,
                                detail=detail))
        return decision.rollback_to

    # --- the verifier's process ------------------------------------------------------

    def _spawn(self) -> subprocess.Popen[bytes]:
        """The job's script again, as the verifier (``worker.verifier_process``)."""
        return spawn_verifier(self.folder, self.every, self._seed, self._key)
