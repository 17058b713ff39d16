"""The Grafana dashboard we ship queries only metrics the job exports, by the names a scrape shows."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from undying.config import JobConfig
from undying.jobfiles.events import EventLog
from undying.manager.manager import Manager
from undying.manager.views.metrics import metric_names, new_registry

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "undying.json"
METRIC = re.compile(r"\bundying_[a-z0-9_]+\b")


def queries(node: Any) -> Iterator[str]:
    """Every PromQL text in the dashboard: panel targets, annotations, template variables."""
    if isinstance(node, dict):
        for key, value in node.items():
            # (a template variable's "query" is PromQL when it calls label_values(...), else a datasource type)
            if isinstance(value, str) and (key in ("expr", "definition") or key == "query" and "(" in value):
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


@pytest.fixture
def exported(tmp_path: Path) -> Iterator[set[str]]:
    """The names a real manager's registry exposes (every family is there from the first scrape)."""
    manager = Manager(JobConfig(job_id="g", job_dir=str(tmp_path), nproc_per_node=2), EventLog(tmp_path / "e.db"))
    try:
        yield metric_names(new_registry(manager.status, manager.history))
    finally:
        manager.close()


def test_every_query_names_a_metric_the_job_exports(exported: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    found = list(queries(dashboard))
    assert len(found) >= 20, found
    unknown = {name: q for q in found for name in METRIC.findall(q) if name not in exported}
    assert not unknown, f"the dashboard queries metrics the job does not export: {unknown}"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    for panel in panels:  # a panel with no metric of ours shows nothing
        assert panel["targets"] and all(METRIC.search(t["expr"]) for t in panel["targets"]), panel["title"]
    used = {name for q in found for name in METRIC.findall(q)}
    for headline in ("undying_step_seconds_bucket", "undying_rank_step_seconds_bucket", "undying_incidents_total",
                     "undying_goodput_ratio", "undying_spares_ready", "undying_step_value", "undying_checkpoint_last_step",
                     "undying_checkpoint_save_seconds_bucket", "undying_checkpoint_bytes",
                     "undying_checkpoint_failures_total", "undying_recovery_seconds_bucket"):
        assert headline in used, f"the dashboard does not show {headline}"


def test_the_dashboard_is_laid_out() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
    assert "http" not in DASHBOARD.read_text()  # no link leaves the repository
