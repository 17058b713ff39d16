"""job.ddp(model) is a DistributedDataParallel to the script: gradient accumulation both ways, against plain DDP.

Two real processes on gloo (loopback). Each trains the same seeded model
twice, once through ``job.ddp`` and once through a plain ``DistributedDataParallel``,
with three micro-batches per optimizer step, the first two without the
all-reduce (``no_sync()``, then ``require_backward_grad_sync = False``), and
compares the gradients bit for bit after every micro-step, also across a
rebuild of the wrapper's DDP (a new generation).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parents[2]


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _accumulate(ddp: torch.nn.Module, model: torch.nn.Module, way: str, rank: int, seed: int) -> list[list[float]]:
    """Three micro-batches, the first two without sync; the gradients (flattened) after each."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    model.zero_grad(set_to_none=True)
    seen = []
    for micro in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        last = micro == 2
        if way == "no_sync":
            context = contextlib.nullcontext() if last else ddp.no_sync()
        else:
            ddp.require_backward_grad_sync = last
            context = contextlib.nullcontext()
        with context:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        seen.append(torch.cat([t.flatten() for t in _grads(model)]).tolist())
    return seen


def _child(out: str) -> None:
    import undying

    job = undying.init()
    rank = dist.get_rank()
    mine, plain_model = _model(), _model()
    ddp = job.ddp(mine)
    plain = DistributedDataParallel(plain_model)
    facts = {
        "isinstance": isinstance(ddp, DistributedDataParallel),
        "module": ddp.module is mine,
        "process_group": ddp.process_group is not None,
        "keys": sorted(ddp.state_dict()) == sorted(plain.state_dict()),
        "named": [n for n, _ in ddp.named_parameters()] == [n for n, _ in plain.named_parameters()],
        "sync_default": ddp.require_backward_grad_sync,
    }
    results = {}
    for round_, way in enumerate(("no_sync", "flag", "no_sync")):
        if round_ == 2:
            ddp.invalidate()  # what a new generation does: the next forward builds another DDP
        results[way + str(round_)] = (_accumulate(ddp, mine, way, rank, round_),
                                      _accumulate(plain, plain_model, way, rank, round_))
    facts["sync_after"] = ddp.require_backward_grad_sync
    with ddp.no_sync():
        facts["inside_no_sync"] = ddp.require_backward_grad_sync
    Path(out).write_text(json.dumps({"facts": facts, "results": results}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_job_ddp_is_a_ddp_and_accumulates_gradients_as_ddp_does(tmp_path: Path, reap: list[int]) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("UNDYING_")}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
        code = (f"from tests.unit.test_ddp_wrapper import _child; _child({str(tmp_path / f'{rank}.json')!r}); "
                "from undying.worker.boot import end_process; end_process()")  # (as a worker ends: no teardown)
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, start_new_session=True)
        reap.append(proc.pid)
        procs.append(proc)
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    outs = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for out in outs:
        assert out["facts"] == {"isinstance": True, "module": True, "process_group": True, "keys": True,
                                "named": True, "sync_default": True, "sync_after": True, "inside_no_sync": False}
        for way, (wrapped, plain) in out["results"].items():
            assert wrapped == plain, f"{way}: the wrapper's gradients differ from plain DDP's"
    for way in outs[0]["results"]:
        first, second = outs[0]["results"][way][0], outs[1]["results"][way][0]
        # Without sync the ranks' gradients are their own; the last micro-step all-reduces them to one.
        assert first[0] != second[0] and first[1] != second[1], f"{way}: a micro-step without sync was all-reduced"
        assert first[2] == second[2], f"{way}: the last micro-step did not all-reduce"
