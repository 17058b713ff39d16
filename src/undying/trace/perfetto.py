"""A job's trace files as Chrome trace-event JSON, the format Perfetto's UI and chrome://tracing
open.

Why this format: it is the one a person already has a viewer for. Every
rank's steps, forward passes, data waits, collectives and checkpoint saves,
and the job's incidents, land on one time axis: a process per rank (``pid`` =
rank + 1, named "rank N (node)"), a thread per kind of marker, complete
events (``ph`` "X", ``ts`` and ``dur`` in microseconds) for the markers and
instant events (``ph`` "i") for incidents, with a slice over the recovery when
the incident has one. The job's own process (``pid`` 0) holds every incident;
an incident of one rank shows on that rank's process too.

Times: records carry their start as wall-clock seconds (``t``) and their
length (``dur``); incidents their fault time (``fault_t``) from the event log.
Both are put on one axis starting at the earliest of them (``ts`` 0), and the
start's unix time is kept in ``otherData.t0_unix``.

Collectives of one step overlap (DDP launches a bucket's all-reduce while the
backward pass still runs), and a viewer draws complete events of one thread
as a stack that must nest; so each gradient bucket gets its own thread.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from undying.trace.analyze import find_job_dir
from undying.trace.files import is_trace_file

__all__ = ["chrome_trace", "write_chrome_trace", "THREADS"]

# Thread ids per kind of marker (a collective's bucket k gets COMM_TID + k).
THREADS = {
    "step": (1, "steps"),
    "fp": (2, "forward pass"),
    "data": (3, "data wait"),
    "ckpt/block": (4, "checkpoint stall"),
    "ckpt/write": (5, "checkpoint write"),
    "comm": (10, "collectives"),
}
JOB_PID = 0
INCIDENT_TID = 9  # beside the markers' threads, on a rank's process


def _records(
    job_dir: Path, rank_dirs: dict[int, Path]
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every readable record of every rank; partial or foreign lines are skipped (as
    ``diagnose`` does)."""
    for rank, rdir in sorted(rank_dirs.items()):
        for p in sorted(rdir.iterdir()):
            if not p.is_file() or not is_trace_file(p.name):
                continue
            with open(p, "rb") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(record, dict):
                        yield rank, record


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _thread(record: dict[str, Any]) -> tuple[int, str] | None:
    kind = record.get("kind")
    if kind == "ckpt":
        return THREADS.get(f"ckpt/{record.get('part', 'block')}")
    if kind == "comm":
        bucket = record.get("bucket")
        k = (bucket if isinstance(bucket, int) and not isinstance(bucket, bool)
             and 0 <= bucket < 1000 else 0)
        tid, name = THREADS["comm"]
        return tid + k, f"{name} (bucket {k})"
    return THREADS.get(str(kind))


def _name(record: dict[str, Any]) -> str:
    kind, step = record.get("kind"), record.get("step")
    if kind == "comm":
        return f"{record.get('op', 'collective')} step {step}"
    if kind == "ckpt":
        part = "write" if record.get("part") == "write" else "stall"
        return f"checkpoint {part} step {record.get('save_step', step)}"
    words = {"step": "step", "fp": "forward", "data": "data wait"}
    return f"{words.get(str(kind), kind)} {step}"


def chrome_trace(
    job_dir_or_trace_dir: Path, incidents: Iterable[dict[str, Any]] = ()
) -> dict[str, Any]:
    """The job's records (and ``incidents``, as ``read_job`` gives them) as one trace-event JSON
    object.

    ``job_dir_or_trace_dir`` is what ``undying diagnose`` takes: a trace dir, a
    job's folder in it, or a rank folder. Raises ``TraceDirError`` (a usage
    error) when it holds no trace files.
    """
    job_dir, rank_dirs, _ = find_job_dir(Path(job_dir_or_trace_dir))
    spans: list[tuple[int, dict[str, Any], float, float]] = []  # (rank, record, t, dur)
    nodes: dict[int, str] = {}
    for rank, record in _records(job_dir, rank_dirs):
        t, dur = _num(record.get("t")), _num(record.get("dur"))
        if t is None or dur is None or dur < 0:
            continue
        if isinstance(record.get("node"), str):
            nodes[rank] = record["node"]
        spans.append((rank, record, t, dur))
    incidents = [i for i in incidents if _num(i.get("fault_t")) is not None]
    starts = [t for _, _, t, _ in spans] + [float(i["fault_t"]) for i in incidents]
    t0 = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = []
    threads: dict[tuple[int, int], str] = {}

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    for rank, record, t, dur in spans:
        thread = _thread(record)
        if thread is None:
            continue
        pid, (tid, tname) = rank + 1, thread
        threads[(pid, tid)] = tname
        args = {k: v for k, v in record.items()
                if k not in ("v", "t", "dur", "job", "rank", "node", "kind")}
        events.append({"name": _name(record), "cat": str(record.get("kind")), "ph": "X",
                       "ts": us(t), "dur": round(dur * 1e6, 3), "pid": pid, "tid": tid,
                       "args": args})
    for inc in incidents:
        fault_t = float(inc["fault_t"])
        who = inc.get("rank")
        rank = who if isinstance(who, int) and not isinstance(who, bool) else -1
        name = f"incident #{inc.get('id', '?')}: {inc.get('kind')}" + (
            f" rank {rank}" if rank >= 0 else "")
        args = {k: inc.get(k) for k in ("kind", "rank", "step", "action", "status", "mttr_s",
                                        "phases", "error")}
        pids = [JOB_PID] + ([rank + 1] if rank in rank_dirs else [])
        for pid in pids:
            threads[(pid, INCIDENT_TID)] = "incidents"
            events.append({"name": name, "cat": "incident", "ph": "i", "s": "p", "ts": us(fault_t),
                           "pid": pid, "tid": INCIDENT_TID, "args": args})
            mttr = _num(inc.get("mttr_s"))
            if mttr is not None and mttr > 0:  # the recovery, as a slice
                events.append({"name": f"{name}: recovery", "cat": "incident", "ph": "X",
                               "ts": us(fault_t), "dur": round(mttr * 1e6, 3), "pid": pid,
                               "tid": INCIDENT_TID, "args": args})
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": JOB_PID, "tid": 0,
         "args": {"name": f"job {job_dir.name}"}},
        {"name": "process_sort_index", "ph": "M", "pid": JOB_PID, "tid": 0,
         "args": {"sort_index": -1}},
    ]
    for rank in sorted(rank_dirs):
        label = f"rank {rank}" + (f" ({nodes[rank]})" if rank in nodes else "")
        meta.append({"name": "process_name", "ph": "M", "pid": rank + 1, "tid": 0,
                     "args": {"name": label}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank + 1, "tid": 0,
                     "args": {"sort_index": rank}})
    for (pid, tid), tname in sorted(threads.items()):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": tname}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"sort_index": tid}})
    events.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"job": job_dir.name, "t0_unix": t0, "ranks": sorted(rank_dirs),
                          "incidents": len(incidents)}}


def write_chrome_trace(trace: dict[str, Any], path: Path) -> Path:
    """Write ``trace`` to ``path`` atomically (a viewer never opens half a file); returns the
    path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(trace, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
