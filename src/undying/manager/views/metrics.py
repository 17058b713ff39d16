"""Prometheus metrics of one job, read from the manager's status on every scrape.

The manager already keeps the job's truth (``Manager.status()``), so the metrics
are a view of it rather than a second set of counters updated at each event:
a custom collector turns the status dict into metric families when Prometheus
scrapes ``GET /metrics``. Nothing drifts between what the page, the CLI and
Prometheus show, and a manager restarted from its SQLite log exposes the same
totals as before (they are recomputed from the incidents it reloaded).

What only grows over the whole run (the histograms of step times and
checkpoint saves, the bytes written) and goodput come from the manager's
``RunHistory`` (``history.py``), fed once per commit and per save; it too is
read back from the log by a restarted manager.

Every family is yielded on every scrape, empty when there is nothing to say
yet (no made-up zero for a step time never measured), so the names a scraper
sees, and a dashboard may query, do not depend on how far the job got
(``METRIC_NAMES``). Counters that a dashboard takes ``increase()`` of start at 0
for every value of their labels known beforehand (every incident kind).

Each app gets its own ``CollectorRegistry``: the process-wide default registry
would mix several managers in one process (tests run many) and carries the
Python process collectors, which say nothing about the job.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from undying.jobfiles.records import IncidentKind, JobState, RankState
from undying.manager.views.history import LABELLED_RANKS, Histogram, RunHistory

__all__ = ["StatusCollector", "RECOVERY_BUCKETS", "CONTENT_TYPE", "new_registry", "exposition",
           "metric_names"]

# Recovery (fault to first completed step) takes about a second with a warm
# spare, a few without one, and up to the recovery timeout (600 s by default)
# when something is badly wrong: buckets cover all three.
RECOVERY_BUCKETS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                                       600.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Ranks in these states have a process that is (or is about to be) training.
_ALIVE = {RankState.STARTING.value, RankState.RUNNING.value, RankState.RECOVERING.value}

StatusSource = Callable[[], Mapping[str, Any]]


class StatusCollector(Collector):
    """Metric families computed from one status dict per scrape.

    ``status`` is ``Manager.status`` or anything returning the same shape; keys
    added later (``trace``, ``step_times``) are read with defaults so that an
    older manager still yields every other metric.
    """

    def __init__(self, status: StatusSource, history: RunHistory | None = None) -> None:
        self._status = status
        self._history = history if history is not None else RunHistory()

    def collect(self) -> Iterator[Metric]:
        status = self._status()
        job_id = str(status.get("job_id") or "")
        yield from _job(status, job_id)
        yield from _ranks(status.get("ranks") or [])
        yield from _steps(status, self._history)
        yield from _incidents(status.get("incidents") or [])
        yield from _checkpoints(status.get("checkpoints") or {}, int(status.get("step") or 0),
                                self._history)
        yield from _trace(status.get("trace") or {})
        goodput = status.get("goodput") or {}
        if goodput.get("ratio") is not None:  # worked out with the status (views.job_goodput)
            self._history.set_goodput(float(goodput["ratio"]), goodput.get("losses") or {})
        yield from _goodput(self._history)


def _job(status: Mapping[str, Any], job_id: str) -> Iterator[Metric]:
    info = GaugeMetricFamily("undying_job_info", "The job this manager runs (always 1).",
                             labels=["job_id"])
    info.add_metric([job_id], 1)
    yield info
    state = GaugeMetricFamily(
        "undying_job_state", "1 for the job's current state, 0 for the others.", labels=["state"]
    )
    current = str(status.get("state") or "")
    for s in JobState:
        state.add_metric([s.value], 1.0 if s.value == current else 0.0)
    yield state
    yield GaugeMetricFamily(
        "undying_generation", "The current process-group generation (one more per recovery).",
        value=float(status.get("generation") or 0),
    )
    yield GaugeMetricFamily("undying_world_size", "Ranks the job trains on.",
                            value=float(status.get("world_size") or 0))
    yield GaugeMetricFamily(
        "undying_spares_ready", "Hot spare processes warm and ready to replace a rank.",
        value=float(status.get("spares_ready") or 0),
    )
    restarts = (status.get("checkpoints") or {}).get("restarts") or 0
    yield CounterMetricFamily(
        "undying_job_restarts",
        "Restarts of every rank: from a checkpoint (the last rung before failing), "
        "or a whole-group restart of a script without the step API.",
        value=float(restarts),
    )


def _checkpoints(checkpoints: Mapping[str, Any], step: int,
                 history: RunHistory) -> Iterator[Metric]:
    """Saves: the last one, how long they stall and write, what they wrote, which failed, what is at
    risk."""
    health = checkpoints.get("health") or {}
    yield CounterMetricFamily("undying_checkpoint_failures",
                              "Checkpoint saves that failed (every attempt).",
                              value=float(health.get("failures") or 0))
    yield GaugeMetricFamily("undying_checkpoint_failing",
                            "1 while the latest checkpoint save failed and none has succeeded "
                            "since.", value=1.0 if health.get("failing") else 0.0)
    last = checkpoints.get("last") or checkpoints.get("resumed_from") or {}
    behind = GaugeMetricFamily("undying_checkpoint_steps_behind",
                               "Committed steps newer than the newest checkpoint: what a restart "
                               "from disk re-runs.")
    last_step = GaugeMetricFamily("undying_checkpoint_last_step",
                                  "The step of the newest checkpoint saved (or resumed from).")
    if isinstance(last.get("step"), int):
        behind.add_metric([], float(max(0, step - int(last["step"]))))
        last_step.add_metric([], float(last["step"]))
    yield behind
    yield last_step
    size = GaugeMetricFamily("undying_checkpoint_bytes", "Bytes of the newest checkpoint saved.")
    if isinstance((checkpoints.get("last") or {}).get("bytes"), int):
        size.add_metric([], float(checkpoints["last"]["bytes"]))
    yield size
    yield CounterMetricFamily("undying_checkpoint_written_bytes",
                              "Bytes written by every checkpoint saved.",
                              value=float(history.bytes_written))
    yield _histograms("undying_checkpoint_save_seconds",
                      "Seconds of each save: the training loop's stall (part=blocking, the copy) "
                      "and the write beside training (part=write).", "part", history.save_seconds)


def _ranks(ranks: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
    alive = sum(1 for r in ranks if r.get("state") in _ALIVE and r.get("pid"))
    yield GaugeMetricFamily("undying_ranks_alive",
                            "Ranks with a live process (starting, running or recovering).",
                            value=float(alive))
    by_state = Counter(str(r.get("state")) for r in ranks)
    states = GaugeMetricFamily("undying_ranks", "Ranks in each state.", labels=["state"])
    for s in RankState:
        states.add_metric([s.value], float(by_state.get(s.value, 0)))
    yield states
    step = GaugeMetricFamily("undying_rank_step", "The last step each rank committed.",
                             labels=["rank"])
    restarts = CounterMetricFamily("undying_rank_restarts",
                                   "Times each rank got a new process after a fault (replaced, or "
                                   "restarted with every rank).", labels=["rank"])
    for r in ranks:
        step.add_metric([str(r.get("rank"))], float(r.get("step") or 0))
        restarts.add_metric([str(r.get("rank"))], float(r.get("restarts") or 0))
    yield step
    yield restarts


def _steps(status: Mapping[str, Any], history: RunHistory) -> Iterator[Metric]:
    # A gauge, not a counter: a whole-job restart from a checkpoint moves it back.
    yield GaugeMetricFamily("undying_step", "Steps completed by every rank (the job's step).",
                            value=float(status.get("step") or 0))
    yield CounterMetricFamily("undying_rerun_steps",
                              "Steps run again after a fault (the step in flight).",
                              value=float(len(status.get("rerun_steps") or [])))
    times = [t for t in (status.get("step_times") or []) if len(t) == 2 and t[1] is not None]
    last = GaugeMetricFamily("undying_last_step_seconds",
                             "Duration of the last step every rank committed.")
    if times:
        last.add_metric([], float(times[-1][1]))
    yield last
    logged = GaugeMetricFamily("undying_step_value",
                               "The newest completed step's values given to step.log (the mean "
                               "over the ranks), by name: the first 8 names logged.",
                               labels=["name"])
    for name, value in sorted(history.last_values.items()):
        logged.add_metric([name], value)
    yield logged
    yield _histograms("undying_step_seconds",
                      "Seconds of each step of the job: from the last commit of the step before to "
                      "the last commit of this one (every rank's).", None,
                      {"": history.step_seconds})
    yield _histograms("undying_rank_step_seconds",
                      f"Seconds between a rank's consecutive commits; ranks 0-{LABELLED_RANKS - 1} "
                      "each have their own rank label, the ranks after them share "
                      f"rank=\"{LABELLED_RANKS}+\".", "rank", history.rank_step_seconds)


def _incidents(incidents: Sequence[Mapping[str, Any]]) -> Iterator[Metric]:
    # Every kind at 0 from the start: increase() over a series that appears at 1 misses that first
    # incident.
    kinds = Counter({k.value: 0 for k in IncidentKind})
    kinds.update(str(i.get("kind") or "") for i in incidents)
    total = CounterMetricFamily("undying_incidents", "Incidents by fault kind (each kind from 0).",
                                labels=["kind"])
    for kind, n in sorted(kinds.items()):
        total.add_metric([kind], float(n))
    yield total
    # The action is decided after the incident opens (and may be escalated): counted once decided,
    # by the action.
    actions = Counter((str(i.get("kind") or ""), str(i["action"])) for i in incidents
                      if i.get("action"))
    taken = CounterMetricFamily("undying_incident_actions",
                                "Incidents by fault kind and the action decided.",
                                labels=["kind", "action"])
    for (kind, action), n in sorted(actions.items()):
        taken.add_metric([kind, action], float(n))
    yield taken
    open_now = sum(1 for i in incidents if i.get("status") == "open")
    yield GaugeMetricFamily("undying_incidents_open", "Incidents whose recovery has not finished.",
                            value=float(open_now))
    mttrs = [float(i["mttr_s"]) for i in incidents if isinstance(i.get("mttr_s"), (int, float))]
    yield _histogram(
        "undying_recovery_seconds",
        "Seconds from a fault to the job's first completed step after it (MTTR).",
        mttrs, RECOVERY_BUCKETS,
    )


def _histogram(name: str, doc: str, values: Sequence[float],
               bounds: Sequence[float]) -> HistogramMetricFamily:
    buckets: list[tuple[str, float]] = [
        (_le(b), float(sum(1 for v in values if v <= b))) for b in bounds
    ]
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(math.fsum(values)))


def _le(bound: float) -> str:
    return repr(float(bound))


def _trace(trace: Mapping[str, Any]) -> Iterator[Metric]:
    enabled = GaugeMetricFamily(
        "undying_trace_enabled",
        "1 while the trace markers are on: step (with ckpt, fp and data) and comm switch "
        "separately.", labels=["markers"],
    )
    for markers in ("step", "comm"):
        enabled.add_metric([markers], 1.0 if trace.get(markers) else 0.0)
    yield enabled
    yield GaugeMetricFamily(
        "undying_trace_switch_error",
        "1 while the watched switch file is malformed (the last good setting holds).",
        value=1.0 if trace.get("error") else 0.0,
    )


def _histograms(name: str, doc: str, label: str | None,
                histograms: Mapping[str, Histogram]) -> HistogramMetricFamily:
    """A histogram family from ``RunHistory``'s counts, one series per label value (``label`` None:
    one series)."""
    family = HistogramMetricFamily(name, doc, labels=[label] if label else [])
    for value, h in sorted(histograms.items(), key=lambda kv: (len(kv[0]), kv[0])):
        if label is None and not h.count:
            continue  # nothing measured yet: the family stays empty rather than a row of zeros
        buckets = [(_le(bound), float(n)) for bound, n in h.cumulative()]
        buckets.append(("+Inf", float(h.count)))
        family.add_metric([value] if label else [], buckets, sum_value=h.total)
    return family


def _goodput(history: RunHistory) -> Iterator[Metric]:
    ratio = GaugeMetricFamily("undying_goodput_ratio",
                              "Share of the job's wall time spent on steps that count (ML "
                              "Goodput), 0 to 1.")
    lost = GaugeMetricFamily("undying_goodput_lost_seconds",
                             "Wall time that did not go to steps that count, by cause (start-up, "
                             "recovery, ...).", labels=["cause"])
    if history.goodput is not None:
        share, losses = history.goodput
        ratio.add_metric([], share)
        for cause, seconds in sorted(losses.items()):
            lost.add_metric([cause], seconds)
    yield ratio
    yield lost


def new_registry(status: StatusSource, history: RunHistory | None = None) -> CollectorRegistry:
    """A registry of its own holding one collector over ``status`` (and the run's ``history``, if
    given)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(status, history))
    return registry


def metric_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` can expose (``_total``, ``_bucket``, ``_count``, ``_sum``
    included)."""
    names: set[str] = set()
    for family in registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
    return names


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format (served as ``CONTENT_TYPE``)."""
    return generate_latest(registry)
