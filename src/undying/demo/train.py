"""A small seeded DDP job: a regression MLP with dropout, SGD with momentum and an LR schedule.

Run it with ``undying run -n 4 train.py``. It logs the job-wide mean loss of
every step (all-reduced before backward, so every rank logs the same value),
which is what the demo and the tests compare between a run with a fault and
one without.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import undying


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--loader", choices=("dataloader", "stateful"), default="dataloader")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--init-process-group", action="store_true",
                   help="call torch.distributed.init_process_group before undying.init(), as old "
                   "scripts do")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="make every step last at least this long on every rank (a slow job, not a "
                   "hang)")
    p.add_argument("--fail-at-step", type=int, default=0,
                   help="raise a ValueError at this step (a bug, not a fault)")
    p.add_argument("--fail-rank", type=int, default=-1,
                   help="with --fail-at-step: only on this rank (-1: every rank)")
    p.add_argument("--numerics", choices=("off", "skip", "stop"), default="off",
                   help="check each step's loss and gradient norm (undying.Numerics); a fault that "
                   "replays the same way skips the batch or stops the job")
    p.add_argument("--bad-sample", type=int, default=-1,
                   help="make this sample's features NaN: the batch holding it fails every time (a "
                   "bad batch)")
    p.add_argument("--env-out", default="",
                   help="write the torchrun environment this process got to "
                   "ENV_OUT/<rank>-<pid>.json (tests)")
    p.add_argument("--skip-steps", default="",
                   help="comma-separated steps whose body does nothing (the fault-free twin of a "
                   "skipped batch)")
    return p.parse_args()


# What torchrun sets for a worker (and undying run as well): the names a torchrun script reads.
TORCHRUN_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                  "MASTER_PORT", "OMP_NUM_THREADS")


def dump_environment(folder: str) -> None:
    seen = {k: v for k, v in os.environ.items()
            if k in TORCHRUN_NAMES or k.startswith(("TORCHELASTIC_", "TORCH_NCCL"))}
    with open(os.path.join(folder, f"{os.environ['RANK']}-{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)


def main() -> None:
    args = parse_args()
    if args.env_out:
        dump_environment(args.env_out)
    if args.init_process_group:
        dist.init_process_group("gloo")
    job = undying.init()

    torch.manual_seed(1234)
    data = torch.Generator().manual_seed(99)
    x = torch.randn(args.samples, args.features, generator=data)
    w = torch.randn(args.features, 1, generator=data)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(args.samples, 1, generator=data)
    if args.bad_sample >= 0:
        x[args.bad_sample] = float("nan")
    skip = {int(s) for s in args.skip_steps.split(",") if s}
    numerics = undying.Numerics(on_persistent=args.numerics) if args.numerics != "off" else None
    dataset = TensorDataset(x, y)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(dataset, seed=7)
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: DataLoader = StatefulDataLoader(dataset, batch_size=args.batch_size,
                                                sampler=sampler, num_workers=args.num_workers)
    else:
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.num_workers)

    layers: list[nn.Module] = []
    width = args.features
    for _ in range(args.layers):
        layers += [nn.Linear(width, args.hidden), nn.ReLU(), nn.Dropout(0.1)]
        width = args.hidden
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)

    ddp = job.ddp(model)
    state = job.state(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    for step in job.steps(state, epochs=args.epochs, numerics=numerics):
        with step:
            if step.index in skip:
                continue
            started = time.monotonic()
            inputs, targets = step.batch
            if step.index == args.fail_at_step and args.fail_rank in (-1, job.rank):
                raise ValueError(f"a bug in the training script at step {step.index}")
            loss = F.mse_loss(ddp(inputs), targets)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            step.log(loss=mean_loss / job.world_size)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))


if __name__ == "__main__":
    main()
