"""How long Kubernetes must wait between SIGTERM and SIGKILL for a dying gasp.

Two figures, one derived from the other:

- the *dying-gasp budget* G, passed to every agent as ``undying run
  --grace-period G``: undying's own deadline to finish the step in flight,
  write the checkpoint and exit (it kills what still runs at G, so the latest
  valid checkpoint then stands, and the log says so);
- ``terminationGracePeriodSeconds`` = ceil(G x 1.5 + 10): the kubelet's
  deadline, after which it SIGKILLs the container. It must be longer than G,
  or Kubernetes kills the gasp before undying's own fallback can act: x1.5
  covers a slower disk or a busier node than the measurement saw, +10 s the
  agent stopping its workers (``--stop-grace``, 10 s by default) and the
  preStop hook's own start.

G comes from a previous run's event log (``--from-job-dir``), the way the
manager sizes it at run time (``Manager.grace_period``): the checkpoint's
size over the slowest write speed seen, x2, at least 5 s, plus two of the
slowest recent steps; raised to twice a measured SIGTERM-to-exit time when the
job was preempted before. Else from ``--grace-period``, else 60 s, and the
manifests say that it was not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from undying.checkpoint.gasp import Measurement
from undying.errors import UsageError
from undying.jobfiles.events import LogReader

__all__ = [
    "DEFAULT_GASP_S",
    "K8S_FACTOR",
    "K8S_EXTRA_S",
    "Grace",
    "kubernetes_grace_s",
    "from_seconds",
    "default",
    "from_job_dir",
]

DEFAULT_GASP_S = 60.0
K8S_FACTOR = 1.5
K8S_EXTRA_S = 10.0
# The manager keeps this many recent step times for its own figure; the same here.
_RECENT_STEPS = 50


def kubernetes_grace_s(gasp_s: float) -> int:
    """terminationGracePeriodSeconds for a dying-gasp budget of ``gasp_s`` seconds."""
    return math.ceil(gasp_s * K8S_FACTOR + K8S_EXTRA_S)


@dataclass(frozen=True)
class Grace:
    """The dying-gasp budget, the kubelet's grace period, and how they were reached."""

    gasp_s: float  # passed to the agents as --grace-period
    measured: bool  # False: a default or a flag, nobody measured this job
    basis: str  # one line for the manifest's comment and the report

    @property
    def kubernetes_s(self) -> int:
        return kubernetes_grace_s(self.gasp_s)

    def explain(self) -> str:
        return (f"terminationGracePeriodSeconds {self.kubernetes_s} = dying-gasp budget "
                f"{_num(self.gasp_s)} s x {K8S_FACTOR:g} + {K8S_EXTRA_S:g} s; "
                f"the budget: {self.basis}")


def from_seconds(seconds: float) -> Grace:
    if not math.isfinite(seconds) or seconds <= 0:
        raise UsageError(f"--grace-period must be a number of seconds > 0, got {seconds!r}")
    return Grace(_ceil_tenth(seconds), False, "--grace-period (given, not measured by undying k8s)")


def default() -> Grace:
    return Grace(DEFAULT_GASP_S, False,
                 f"NOT MEASURED: a default of {DEFAULT_GASP_S:g} s; size it with --from-job-dir "
                 "DIR (a previous run with checkpoints) or --grace-period SECONDS")


def from_job_dir(job_dir: str | Path) -> Grace:
    """The budget a previous run of this job measured, read from ``<job_dir>/events.db``."""
    path = Path(job_dir)
    if not path.is_dir():
        raise UsageError(f"--from-job-dir {job_dir}: no such folder; pass the --job-dir of a "
                         "previous run")
    with LogReader(path / "events.db") as reader:
        try:
            job = reader.job()
            saves: list[Any] = [e.data for e in reader.events("checkpoint_saved")]
            commits = [(c.rank, c.step, c.t) for c in reader.commits()]
        # a file that is no event log, one of another schema, a value that is no JSON
        except Exception as e:
            raise UsageError(f"--from-job-dir {job_dir}: cannot read {path / 'events.db'}: "
                             f"{e}") from None
    return _estimate(job, saves, commits, str(path / "events.db"))


def _estimate(job: dict[str, Any], saves: list[Any], commits: list[tuple[int, int, float]],
              where: str) -> Grace:
    writes = [(int(s["bytes"]), float(s["write_s"])) for s in saves
              if isinstance(s, dict) and not s.get("error") and _positive(s.get("bytes"))
              and _positive(s.get("write_s"))]
    last = job.get("last_checkpoint")
    if (not writes and isinstance(last, dict) and _positive(last.get("bytes"))
            and _positive(last.get("write_s"))):
        writes = [(int(last["bytes"]), float(last["write_s"]))]
    preemption = job.get("preemption") if isinstance(job.get("preemption"), dict) else None
    took = preemption.get("sigterm_to_exit_s") if preemption else None
    if not writes and not _positive(took):
        raise UsageError(
            f"--from-job-dir: {where} holds no checkpoint write and no dying gasp to size the "
            "grace period from; run the job with --save-every or --save-interval first, or pass "
            "--grace-period SECONDS")
    step_s = _slowest_recent_step(commits)
    parts = []
    gasp = 0.0
    if writes:
        size = max(b for b, _ in writes)
        speed = min(b / s for b, s in writes)
        m = Measurement(size, speed, f"slowest of {len(writes)} checkpoint write(s)")
        gasp = m.grace_period_s() + 2 * step_s
        parts.append(f"{size} bytes at {speed / 1e6:.1f} MB/s ({m.source}): "
                     f"write {m.write_s:.3f} s, x2, at least 5 s, plus 2 steps of {step_s:.3f} s "
                     f"= {gasp:.1f} s")
    if _positive(took):
        assert took is not None
        doubled = max(5.0, 2 * float(took))
        parts.append(f"a dying gasp took {float(took):.3f} s from SIGTERM to exit, x2, "
                     f"at least 5 s = {doubled:.1f} s")
        gasp = max(gasp, doubled)
    basis = f"measured in {where}: " + "; ".join(parts) + (
        f"; the larger, {_num(_ceil_tenth(gasp))} s" if len(parts) > 1 else "")
    return Grace(_ceil_tenth(gasp), True, basis)


def _slowest_recent_step(commits: list[tuple[int, int, float]]) -> float:
    """The manager's figure:
    the slowest of the recent intervals between a rank's consecutive commits."""
    last: dict[int, tuple[int, float]] = {}
    intervals: list[float] = []
    for rank, step, t in commits:
        prev = last.get(rank)
        if prev is not None and prev[0] == step - 1 and t >= prev[1]:
            intervals.append(t - prev[1])
        last[rank] = (step, t)
    return max(intervals[-_RECENT_STEPS:], default=0.0)


def _positive(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def _ceil_tenth(seconds: float) -> float:
    return math.ceil(round(seconds * 10, 6)) / 10


def _num(seconds: float) -> str:
    return f"{seconds:g}"
