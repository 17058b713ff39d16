"""What ``undying run`` says at its start and at its end, and a job's account read back from its
log.

The banner names the job, its folder, the status page and the one command that
shows the status. The end summary says how the job went: steps, wall time,
incidents with their MTTR, steps re-run, goodput with its losses, and where the
checkpoints are. Both are plain lines (the launcher's stderr may be a file).

``logged_account`` computes progress and goodput from a job's SQLite log with
the manager's own pure functions (``manager.progress``, ``manager.goodput``),
so a finished job reads as the running one did.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from undying.cli.restarts import incidents_line, logged_has_steps, no_step_summary, wrapped
from undying.cli.words import duration
from undying.errors import UsageError
from undying.jobfiles.events import LogReader
from undying.jobfiles.goodput import Goodput, Stall, StepLedger, account
from undying.jobfiles.jobdir import JobDir
from undying.jobfiles.progress import PLAN_EVENT, JobSteps, Plan, Progress, compute, mean_values
from undying.jobfiles.reruns import rerun_words

__all__ = ["Account", "logged_account", "banner", "print_banner", "end_summary",
           "print_end_summary", "loss_words", "duration", "logged_verification",
           "verification_line"]

TERMINAL = frozenset({"succeeded", "failed", "stopped", "preempted"})
# The losses as a person reads them.
LOSS_WORDS = {"startup": "start-up", "checkpoint": "checkpoint stalls", "detection": "detection",
              "recovery": "recovery", "spare_wait": "waiting for a replacement",
              "rerun": "re-run work", "preemption": "preemption", "shutdown": "shutdown",
              "in_flight": "step in flight"}


@dataclass(frozen=True)
class Account:
    progress: Progress
    goodput: Goodput


def logged_account(path: Path, *, step: int | None = None) -> Account:
    """Progress and goodput of the job whose log is ``path``, running or not.

    ``step``: the slowest rank's step as the caller read it (else the newest
    step every rank completed). The end is the job's ``ended_at``; for a job
    that never recorded one (running, or interrupted), the newest record.
    """
    with LogReader(path) as reader:
        job = reader.job()
        steps = JobSteps(int(job.get("world_size") or 1))
        ledger = StepLedger()
        newest = 0.0
        for c in reader.iter_commits():  # (one by one: a long job's log is never held whole)
            newest = max(newest, c.t)
            done = steps.commit(c.rank, c.step, c.t)
            if done is not None:
                ledger.done(c.step, done[0])
        last = steps.recent[-1][0] if steps.recent else None
        values = None
        if last is not None:
            latest: dict[int, dict[str, float]] = {}
            for commit in reader.commits_of_step(last):
                latest[commit.rank] = commit.metrics  # (the newest execution of each rank's)
            values = (last, mean_values(latest.values()))
        plans = reader.events(PLAN_EVENT)
        plan = Plan.from_detail(plans[-1].data) if plans else None
        stalls = [Stall(int(e.data.get("step", 0)), e.t, float(e.data.get("blocking_s") or 0.0))
                  for e in reader.events("checkpoint_saved")]
        incidents = reader.incidents()
        newest = max(newest, reader.newest_event_t() or 0.0)
    state = job.get("state")
    ended = state in TERMINAL
    started = float(job.get("started_at") or (ledger.first_t or newest))
    end = float(job["ended_at"]) if ended and job.get("ended_at") else max(newest, started)
    progress = compute(step if step is not None else (last or 0), plan, list(steps.recent),
                       world_size=steps.world_size,
                       values=values if values and values[1] else None, running=False)
    goodput = account(ledger, incidents, stalls, start=started, end=end, ended=ended)
    return Account(progress, goodput)


# --- words ------------------------------------------------------------------


def loss_words(goodput: dict[str, Any], *, least: float = 0.0005) -> str:
    """The losses above ``least`` of the wall time, largest first: "start-up 3.1 s, recovery 0.9
    s"."""
    wall = float(goodput.get("wall_s") or 0.0)
    losses = sorted(((v, k) for k, v in (goodput.get("losses") or {}).items()
                     if wall and v / wall >= least),
                    reverse=True)
    return ", ".join(f"{LOSS_WORDS.get(k, k)} {duration(v)}" for v, k in losses) or "none"


def goodput_line(goodput: dict[str, Any]) -> str:
    ratio = goodput.get("ratio")
    if ratio is None:
        return "goodput: - (no time has passed)"
    return (f"goodput {ratio:.1%} ({duration(goodput.get('goodput_s'))} of "
            f"{duration(goodput.get('wall_s'))} on steps that count); lost: "
            f"{loss_words(goodput)}")


def incident_line(incident: dict[str, Any], goodput: dict[str, Any] | None = None) -> str:
    """One incident in a line: what, whose, when, what was done, and its MTTR with what it cost."""
    mttr = incident.get("mttr_s")
    line = (f"#{incident['id']} {incident['kind']} of rank {incident['rank']} at step "
            f"{incident['step']}: {incident.get('action') or '-'}, {incident.get('status')}")
    if mttr is not None:
        line += f", MTTR {duration(mttr)}"
    spent = next((i for i in (goodput or {}).get("incidents") or []
                  if i.get("id") == incident.get("id")), None)
    if spent:
        parts = [f"{LOSS_WORDS.get(k[:-2], k[:-2])} {duration(v)}" for k, v in spent.items()
                 if k.endswith("_s") and v >= 0.005]
        line += f" (cost: {', '.join(parts)})"
    return line


# --- the banner ---------------------------------------------------------------

# Where the banner's values start (under "  status page: ").
_BANNER_MORE = " " * 15


def banner(job_id: str, job_dir: str | Path, url: str, *, ranks: int, open_status: bool = False,
           token_from: str = "") -> list[str]:
    """The lines ``undying run`` prints once its manager answers (``token_from``: where its token
    came from), each within 80 columns: a path or URL that cannot break stands alone on its
    line."""
    page = f"{url.rstrip('/')}/"
    how = "open to anyone on its address (--open-status)" if open_status else \
        f"add ?token=<the token in {Path(job_dir) / 'token'}>"
    lines = wrapped(f"undying: job {job_id} started, {ranks} rank{'s' if ranks != 1 else ''}"
                    + (f", token from {token_from}" if token_from else ""), "", "  ")
    lines += wrapped(f"job dir:     {job_dir}", "  ", _BANNER_MORE)
    lines += wrapped(f"status page: {page}", "  ", _BANNER_MORE)
    lines += wrapped(f"({how})", _BANNER_MORE)
    lines += wrapped(f"status:      undying status --job-dir {job_dir}", "  ", _BANNER_MORE)
    lines += wrapped("(--watch to follow it)", _BANNER_MORE)
    return lines


def print_banner(job_id: str, job_dir: str | Path, url: str, *, ranks: int,
                 open_status: bool = False, out: TextIO | None = None,
                 token_from: str = "") -> None:
    stream = out or sys.stderr
    try:
        stream.write("\n".join(banner(job_id, job_dir, url, ranks=ranks, open_status=open_status,
                                       token_from=token_from)) + "\n")
        stream.flush()
    except OSError:
        # A terminal that hung up as the job started (EIO): the job runs on all the same.
        pass


# --- the end summary ----------------------------------------------------------


def end_summary(job_dir: str | Path) -> list[str]:
    """How the job in ``job_dir`` went, from its log: the lines ``undying run`` prints at its
    end."""
    jd = JobDir(Path(job_dir))
    with LogReader(jd.events_db) as reader:
        job = reader.job()
        incidents = reader.incidents()
        steps = logged_has_steps(reader)
    account_ = logged_account(jd.events_db)
    goodput = account_.goodput.to_dict()
    progress = account_.progress
    state = job.get("state", "?")
    any_recovered = any(i.get("status") == "recovered" for i in incidents)
    if state == "failed" and progress.step == 0 and not any_recovered:
        return []  # nothing trained and nothing recovered: the failure's own line says it all
    if not steps:  # (a torchrun script: its wall time and restarts, never "step 0" or "0.0%")
        return no_step_summary(job, incidents, wall_s=goodput["wall_s"], job_dir=jd.path)
    total = f" of {progress.total_steps}" if progress.total_steps is not None else ""
    lines = wrapped(f"undying: job {job.get('job_id')} {state}: step {progress.step}{total}, "
                    f"wall time {duration(goodput['wall_s'])}", "", "  ")
    if progress.values:
        shown = ", ".join(f"{k} {v:.6g}" for k, v in sorted(progress.values.items()))
        lines += _entry(f"last values (step {progress.values_step}, mean over ranks): {shown}")
    lines += _entry(goodput_line(goodput))
    lines += _entry(incidents_line(incidents))
    for incident in incidents:
        lines += wrapped(incident_line(incident, goodput), "    ", "      ")
    rerun = job.get("rerun_steps") or []
    lines += _entry(f"steps re-run: {len(rerun)}" + (f" ({_steps_words(rerun)})" if rerun else ""))
    relaunch = job.get("relaunch_rerun")
    if isinstance(relaunch, dict):  # steps the last launch committed and this one trained again
        lines += _entry(f"this launch {rerun_words(relaunch)}")
    last = job.get("last_checkpoint") or {}
    where = job.get("checkpoint_dir") or "-"
    saved = (f" (newest: step {last['step']}, {last.get('path')})"
             if last.get("step") is not None else " (none saved by this launch)")
    lines += _entry(f"checkpoints: {where}{saved}")
    verification = logged_verification(jd.events_db, step=progress.step)
    if verification is not None:
        lines += _entry(verification_line(verification))
    lines += _entry(f"details: undying status --job-dir {jd.path}")
    return lines


def _entry(text: str) -> list[str]:
    """One entry of the end summary, within 80 columns (a path that cannot break alone on its
    line)."""
    return wrapped(text, "  ", "    ")


def print_end_summary(job_dir: str | Path, out: TextIO | None = None) -> None:
    """Print the end summary; a log that cannot be read is said in one line (the job's exit code
    stands)."""
    stream = out or sys.stderr
    try:
        lines = end_summary(job_dir)
    except (OSError, UsageError, LogReader.Error, ValueError) as e:
        lines = [f"undying: no summary: the job's log in {job_dir} cannot be read ({e})"]
    except Exception as e:  # noqa: BLE001 - a summary never turns a job's result into a traceback
        lines = [f"undying: no summary ({type(e).__name__}: {e})"]
    if lines:
        try:
            stream.write("\n".join(lines) + "\n")
            stream.flush()
        except OSError:
            # A terminal that hung up (EIO): the job's exit code stands, the log has the account.
            pass


def logged_verification(path: Path, *, step: int) -> dict[str, Any] | None:
    """What ``--verify-every`` did, from the job's log (None: not asked): verified, and not
    verified, steps.

    Once the loop ended (its ``verify_summary``) the counts are rank 0's book;
    while it runs, the verdicts logged so far against the steps due by ``step``.
    """
    with LogReader(path) as reader:
        started = reader.events("verify_started")
        if not started:
            return None
        since = started[-1].t
        verdicts = [e.data for e in reader.events("verify_result") if e.t >= since]
        summaries = [e.data for e in reader.events("verify_summary") if e.t >= since]
        restarts = len([e for e in reader.events("verify_restarted") if e.t >= since])
        gave_up = [str(e.data.get("reason", "")) for e in reader.events("verify_gave_up")
                   if e.t >= since]
        refused = len([e for e in reader.events("verify_refused") if e.t >= since])
    every = max(1, int(started[-1].data.get("every") or 1))
    out: dict[str, Any] = {"every": every, "restarts": restarts,
                           "gave_up": gave_up[-1] if gave_up else "",
                           "refused": refused, "error": started[-1].data.get("error", "")}
    if summaries:
        done = summaries[-1]
        out.update(final=True, verified=int(done.get("verified", 0)),
                   mismatched=int(done.get("mismatched", 0)),
                   skipped=int(done.get("skipped", 0)), not_done=int(done.get("not_done", 0)),
                   errors=int(done.get("errors", 0)), refused=int(done.get("refused", refused)))
        out["unverified"] = out["skipped"] + out["not_done"] + out["errors"]
        return out
    verified = len(verdicts)
    due = step // every
    mismatched = len([v for v in verdicts if v.get("passed") is False])
    out.update(final=False, verified=verified, mismatched=mismatched,
               due=due, unverified=max(0, due - verified))
    return out


def verification_line(v: dict[str, Any]) -> str:
    """``verification: every K steps: ...`` in one line: nothing unverified is ever counted as
    passed."""
    every = int(v.get("every", 1))
    head = f"verification: every {every} step{'s' if every != 1 else ''}: "
    if v.get("final"):
        line = (head + f"{v['verified']} verified ({v['mismatched']} mismatched), "
                f"{v['unverified']} not verified"
                + (f" ({v['skipped']} skipped: the verifier behind or down, {v['not_done']} "
                   f"unanswered at the end, {v['errors']} could not be replayed)"
                   if v["unverified"] else ""))
    else:
        line = (head + f"{v['verified']} of {v['due']} due steps verified so far "
                f"({v['mismatched']} mismatched), {v['unverified']} not (yet) verified")
    if v.get("restarts"):
        times = "s" if v["restarts"] != 1 else ""
        line += f"; the verifier was restarted {v['restarts']} time{times}"
    if v.get("gave_up"):
        line += f"; given up: {v['gave_up']}"
    if v.get("error"):
        line += f"; {v['error']}"
    if v.get("refused"):
        line += f"; {v['refused']} file(s) in verify/ refused (not the job's MAC)"
    return line


def _steps_words(steps: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, steps[:most]))
    return shown + (f" and {len(steps) - most} more" if len(steps) > most else "")
