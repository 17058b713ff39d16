"""A restore the planner cannot make fails the process with the planner's words: no silent fallback.

Two real processes on a real gloo group run one restore round of
``worker.rejoin`` (the status exchange, the planning, for a sharded state the
collective read of the checkpoint directory) where no complete state exists.
Each must raise the planner's ``MissingShardsError`` naming what is missing,
tell the manager (a ``Fatal`` with that text), and report no restore.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

CASES = {
    # rank 0 a survivor whose own state is all it has, rank 1 lost, no ring copy, no checkpoint on disk.
    "sharded": ("no complete state: 1 shard(s) lost with every holder and replica, and there is no checkpoint",
                "(tp=1, pp=0) (ranks 1)"),
    # rank 0 torn by the failed step, rank 1 a replacement: no clean whole state anywhere.
    "ddp": ("no complete state", "rank 0: committed 5, clean=False, has_state=True"),
}


def _member(rank: int, case: str, tmp: str, out: Any) -> None:
    """One rank: a real gloo group, a JobContext, one restore round; what happened goes to ``out``."""
    os.environ["UNDYING_REPLICATE"] = "ring"
    import torch.distributed as dist

    from undying.checkpoint.planner import Member, MissingShardsError
    from undying.config import CheckpointConfig, Timeouts
    from undying.protocol.worker_wire import Fatal, Progress
    from undying.worker.checkpoints import Checkpoints
    from undying.worker.context import JobContext
    from undying.worker.env import WorkerEnv
    from undying.worker.faults import FaultSwitch
    from undying.worker.rejoin import Rejoin
    from undying.worker.restore import MODE_REPLICATED, MODE_SHARDED, MODE_UNKNOWN, RankStatus
    from undying.worker.shards import Shards
    from undying.worker.tracing import WorkerTracing

    dist.init_process_group("gloo", init_method=f"file://{tmp}/group", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    sent: list[Any] = []
    env = WorkerEnv("job", rank, rank, 2, 2, "127.0.0.1", 1, "127.0.0.1", 1, 1, False, "gloo", Timeouts(),
                    CheckpointConfig(checkpoint_dir=f"{tmp}/checkpoints"))
    ctx = JobContext(env, rank, 2, rank, 1, sent.append, FaultSwitch(rank, sent.append, {}),
                     WorkerTracing(None, rank, sent.append))
    ctx.current_step = 5
    shards = Shards(ctx)
    rejoin = Rejoin(ctx, dist.FileStore(f"{tmp}/control", 2), shards, Checkpoints(ctx), [])
    if case == "sharded":
        status = RankStatus(Member(0, 5), MODE_SHARDED) if rank == 0 else RankStatus(Member.lost(1))
    else:
        status = RankStatus(Member(0, 5, clean=False), MODE_REPLICATED) if rank == 0 else \
            RankStatus(Member.lost(1), MODE_UNKNOWN)
    try:
        with rejoin._told():
            rejoin._restore(status, None, regroup=False)
        error = None
    except MissingShardsError as e:
        error = str(e)
    out.put({
        "rank": rank, "error": error,
        "fatal": [m.error for m in sent if isinstance(m, Fatal)],
        "progress": [m.phase for m in sent if isinstance(m, Progress)],
    })
    dist.destroy_process_group()
    out.close()
    out.join_thread()  # (the answer is written before the process ends)
    from undying.worker.boot import end_process

    end_process()  # as a worker ends, not by the interpreter's teardown of gloo's threads


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_planning_failure_surfaces_as_an_error_naming_the_problem(case: str, tmp_path: Path,
                                                                    reap: list[int]) -> None:
    (tmp_path / "checkpoints").mkdir()
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    procs = [mp.Process(target=_member, args=(rank, case, str(tmp_path), out)) for rank in (0, 1)]
    for p in procs:
        p.start()
        assert p.pid is not None
        reap.append(p.pid)
    results = []
    try:
        for _ in procs:
            results.append(out.get(timeout=120))
    except queue.Empty:
        pytest.fail(f"a rank gave no answer in 120 s: {results}")
    for p in procs:
        p.join(30)
    what, named = CASES[case]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["error"] is not None, f"rank {r['rank']} planned a restore that cannot exist: {r}"
        assert what in r["error"] and named in r["error"], r["error"]
        assert r["fatal"] == [f"MissingShardsError: {r['error']}"], "the manager hears the planner's words"
        assert not {"shards_restored", "rolled_back", "state_restored"} & set(r["progress"]), r["progress"]
