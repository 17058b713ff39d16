"""What invariant mode costs: plain DDP all-reduce vs undying's fixed-order reduction, same model, same job.

The job is defined by ``--virtual-ranks V`` slices of ``--micro-batch`` samples
per step. On ``N`` physical ranks (2 and 4 by default, on gloo over loopback):

* **plain**: ``job.ddp`` as today; each rank trains on its ``V/N`` slices as one
  batch, DDP's reducer all-reduces the gradient (bucketed, overlapped with backward);
* **invariant**: ``job.steps(..., virtual_ranks=V)``; each rank runs its ``V/N``
  virtual ranks one after the other, keeps their gradients apart, and they are
  folded in virtual-rank order (all-to-all, a fold per slice, all-gather:
  ``undying.worker.virtual.fold_across``).

Both run in the same processes, interleaved (a block of ``--steps`` steps of one,
then of the other, the order swapped each round) for ``--rounds`` rounds after
a warm-up block, so load from other processes falls on both alike. The step
time of each block is its wall time / steps (rank 0's, after a barrier).
Printed: the median and spread (min-max) over rounds, and the ratio
invariant / plain. ``--reduce-only`` adds the reduction alone: ``all_reduce``
of the flattened gradient vs ``fold_across`` of this rank's ``V/N`` of them.

    python bench/invariant.py                        # 2 and 4 ranks
    python bench/invariant.py --ranks 2 --hidden 512 --out docs/data/invariant-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from undying.worker.job import Job
from undying.worker.virtual import fold_across, layout


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="physical rank counts (default 2 4)")
    p.add_argument("--virtual-ranks", type=int, default=4)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=32, help="samples per virtual rank per step")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reduce-only", action="store_true", help="also time the reduction alone")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return p.parse_args()


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    width = args.features
    for _ in range(args.layers):
        layers += [nn.Linear(width, args.hidden), nn.ReLU()]
        width = args.hidden
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _batch(args: argparse.Namespace, slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(args.micro_batch * slices, args.features)
    return x, x[:, :1].tanh()


def _timed_block(steps: Any, body: Any, count: int) -> float:
    dist.barrier()
    started = time.perf_counter()
    for _ in range(count):
        step = next(steps)
        with step:
            body(step)
    dist.barrier()
    return (time.perf_counter() - started) / count


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    slices = len(layout(args.virtual_ranks, world)[rank])
    total = 1 + 2 * args.steps * (args.rounds + 1)

    plain_job, inv_job = Job(None), Job(None)
    plain_model, inv_model = build_model(args), build_model(args)
    plain_ddp, inv_ddp = plain_job.ddp(plain_model), inv_job.ddp(inv_model)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=1e-3)
    inv_opt = torch.optim.SGD(inv_model.parameters(), lr=1e-3)
    plain_steps = plain_job.steps(plain_job.state(model=plain_model, optimizer=plain_opt), total=total)
    inv_steps = inv_job.steps(inv_job.state(model=inv_model, optimizer=inv_opt), total=total,
                              virtual_ranks=args.virtual_ranks)

    def plain_body(step: Any) -> None:
        x, y = _batch(args, slices)
        plain_opt.zero_grad()
        F.mse_loss(plain_ddp(x), y).backward()
        plain_opt.step()

    def inv_body(step: Any) -> None:
        for v in step.virtual_ranks():
            x, y = _batch(args, 1)
            loss = F.mse_loss(inv_ddp(x), y)
            loss.backward()
            v.log(loss=loss)
        inv_opt.step()

    times: dict[str, list[float]] = {"plain": [], "invariant": []}
    blocks = [("plain", plain_steps, plain_body), ("invariant", inv_steps, inv_body)]
    for _name, steps, body in blocks:  # warm-up: DDP's first iteration, allocations
        _timed_block(steps, body, args.steps)
    for r in range(args.rounds):
        for name, steps, body in blocks if r % 2 == 0 else blocks[::-1]:
            times[name].append(_timed_block(steps, body, args.steps))
    result: dict[str, Any] = {"step_s": times}
    if args.reduce_only:
        result["reduce_s"] = _reduce_only(args, inv_model, world, rank)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _reduce_only(args: argparse.Namespace, model: nn.Module, world: int, rank: int) -> dict[str, list[float]]:
    """The reduction alone, ``--rounds`` x ``--steps`` times each, interleaved."""
    n = sum(p.numel() for p in model.parameters())
    flat = torch.randn(n)
    mine = [torch.randn(n) for _ in layout(args.virtual_ranks, world)[rank]]
    out: dict[str, list[float]] = {"all_reduce": [], "ordered_fold": []}

    def all_reduce() -> None:
        dist.all_reduce(flat)

    def ordered_fold() -> None:
        fold_across(mine, args.virtual_ranks, world)

    for r in range(args.rounds):
        for name, op in (("all_reduce", all_reduce), ("ordered_fold", ordered_fold))[:: 1 if r % 2 == 0 else -1]:
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.steps):
                op()
            dist.barrier()
            out[name].append((time.perf_counter() - started) / args.steps)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": 1000 * statistics.median(values), "min_ms": 1000 * min(values), "max_ms": 1000 * max(values)}


def main() -> None:
    args = parse_args()
    params = sum(p.numel() for p in build_model(args).parameters())
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
        "load_1m": os.getloadavg()[0], "torch": torch.__version__, "params": params, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "ranks": {}}
    print(f"model: {params} parameters ({params * 4 / 2**20:.1f} MiB of gradient), V={args.virtual_ranks}, "
          f"{args.micro_batch} samples per virtual rank, load {report['load_1m']:.1f} on {os.cpu_count()} CPUs")
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.spawn(worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
            result = json.loads(Path(out).read_text())
        entry = {name: _summary(v) for name, v in result["step_s"].items()}
        entry["ratio"] = entry["invariant"]["median_ms"] / entry["plain"]["median_ms"]
        line = (f"{world} ranks, step: plain {entry['plain']['median_ms']:.1f} ms "
                f"[{entry['plain']['min_ms']:.1f}-{entry['plain']['max_ms']:.1f}], invariant "
                f"{entry['invariant']['median_ms']:.1f} ms [{entry['invariant']['min_ms']:.1f}-"
                f"{entry['invariant']['max_ms']:.1f}], ratio {entry['ratio']:.2f}")
        if "reduce_s" in result:
            reduce = {name: _summary(v) for name, v in result["reduce_s"].items()}
            reduce["ratio"] = reduce["ordered_fold"]["median_ms"] / reduce["all_reduce"]["median_ms"]
            entry["reduce"] = reduce
            line += (f"; reduction alone: all_reduce {reduce['all_reduce']['median_ms']:.1f} ms, ordered fold "
                     f"{reduce['ordered_fold']['median_ms']:.1f} ms, ratio {reduce['ratio']:.2f}")
        print(line, flush=True)
        report["ranks"][str(world)] = entry
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
